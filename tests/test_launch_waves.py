"""Grids fitted to whole waves (``wave_splits``) and the phase trace of the CUDA loop-2
kernels (``kernels/cuda/trace.py``): the split rule on its own on the CPU, the kernels'
outputs under both on the GPU."""

import ctypes

import pytest
import torch

from flashloop_backend.kernels.cuda.trace import POINTS, traced
from flashloop_backend.kernels.triton.packed_decode import wave_splits


@pytest.mark.parametrize(
    ("pairs", "groups", "most", "capacity", "want"),
    [
        (16, 128, 17, 264, 16),  # 17 splits would leave 8 CTAs for a second wave
        (16, 128, 33, 396, 24),  # one wave of two groups a warp, not two of one
        (16, 128, 33, 528, 33),  # 528 CTAs fit at once: one group a warp
        (256, 512, 3, 396, 3),  # many groups a warp: a second wave costs little
        (256, 512, 2, 264, 2),  # one wave is no tenth faster than two full ones
        (16, 4, 4, 528, 4),  # the caller caps the count at the groups
        (1, 1, 1, 8, 1),
    ],
)
def test_the_split_count_fits_its_ctas_to_whole_waves(pairs, groups, most, capacity, want):
    assert wave_splits(pairs, groups, most, capacity, warps=4) == want


def test_the_split_count_never_exceeds_the_tuning_s():
    for most in range(1, 40):
        assert 1 <= wave_splits(16, 128, most, 264, warps=4) <= most


class _Params(ctypes.Structure):
    _fields_ = [("x", ctypes.c_void_p), ("n", ctypes.c_int)]


def test_a_trace_buffer_follows_the_parameters_and_names_a_wrong_shape():
    buffer = torch.zeros((4, len(POINTS["keys"]), 2), dtype=torch.int64)
    params = traced(_Params(1234, 7), buffer, 4, "keys")
    assert (params.x, params.n, params.trace) == (1234, 7, buffer.data_ptr())
    assert ctypes.sizeof(params) == 24  # the pointer 8-byte aligned after the int, as in C
    with pytest.raises(ValueError, match=r"int64 \[CTAs, 6, 2\]"):
        traced(_Params(), torch.zeros((4, 5, 2), dtype=torch.int64), 4, "keys")
    with pytest.raises(ValueError, match="needs 8 contiguous CTA rows; got 4"):
        traced(_Params(), buffer, 8, "keys")


def _rows():
    from tests.test_cuda_kernels import _packed_rows

    return _packed_rows(2, sparse=False, context=4096, tail=40, batch=3)


@pytest.mark.gpu
def test_whole_waves_select_the_same_keys_and_sum_the_same_outputs():
    from dataclasses import replace

    from flashloop_backend.kernels.cuda.packed_source import (
        DEFAULT_SOURCE,
        packed_dense_source_cuda,
    )
    from flashloop_backend.kernels.cuda.packed_stream import DEFAULT_STREAM, packed_decode_cuda

    args, lengths = _rows()
    outputs = [
        packed_dense_source_cuda(
            *args, lengths, 0.1, 512, tuning=replace(DEFAULT_SOURCE, whole_waves=whole)
        )
        for whole in (False, True)
    ]
    for got, want in zip(*outputs, strict=True):
        if got.is_floating_point():
            torch.testing.assert_close(got.float(), want.float(), atol=1e-3, rtol=1e-3)
        else:
            assert torch.equal(got, want)
    reads = [
        packed_decode_cuda(*args, lengths, tuning=replace(DEFAULT_STREAM, whole_waves=whole))
        for whole in (False, True)
    ]
    torch.testing.assert_close(reads[1].float(), reads[0].float(), atol=1e-2, rtol=1e-2)


@pytest.mark.gpu
def test_traced_loop2_launches_write_what_untraced_ones_write_and_ordered_points():
    from flashloop_backend.kernels.cuda.packed_source import source_keys, source_values
    from flashloop_backend.kernels.cuda.select_top_k import select_positions_cuda
    from flashloop_backend.kernels.triton.packed_decode import packed_span
    from flashloop_backend.kernels.triton.threshold_select import source_outputs

    args, lengths = _rows()
    q, store, layer, meta, cache_k, cache_v, tables = args
    span = packed_span(store, meta, tables, 16)
    traces = {}

    def run(trace: bool):
        logits = torch.zeros(3, 16, span, device="cuda")
        lse = torch.empty(3, 16, device="cuda")
        indices = torch.empty(3, 16, 512, dtype=torch.int32, device="cuda")
        buffers = (
            {
                k: torch.zeros((4096, len(POINTS[k]), 2), dtype=torch.int64, device="cuda")
                for k in POINTS
            }
            if trace
            else {}
        )
        paged = (cache_k, tables, lengths, logits, lse, 128**-0.5)
        states = source_keys(q, store, layer, meta, *paged, merge=False, trace=buffers.get("keys"))
        selection = select_positions_cuda(
            logits, lse, lengths, indices, 0.1, split_states=states, trace=buffers.get("select")
        )
        output = torch.empty(3, 16, 128, device="cuda")
        out, _, mass, output, contribution = source_outputs(q, 512, output)
        finish = (selection, (out, mass, output, contribution))
        values = (cache_v, tables, lengths, logits, lse, selection.plan)
        parts = source_values(
            store, layer, meta, *values, finish=finish, trace=buffers.get("values")
        )
        traces.update(
            {k: (b, {"keys": states[0], "values": parts[0]}.get(k)) for k, b in buffers.items()}
        )
        return logits, indices, selection.plan, output, contribution

    plain, with_trace = run(False), run(True)
    for a, b in zip(plain, with_trace, strict=True):
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
    for kernel, (buffer, parts) in traces.items():
        ctas = 3 * 16 * (parts.shape[2] if parts is not None else 1)
        ns = buffer[:ctas, :, 0]
        assert bool((ns[:, 0] > 0).all()) and not bool(buffer[ctas:].any())
        reached = ns > 0
        for p in range(1, ns.shape[1]):
            both = reached[:, p] & reached[:, p - 1]
            assert bool((ns[both, p] >= ns[both, p - 1]).all()), (kernel, p)


@pytest.mark.gpu
@pytest.mark.parametrize("one_split", [False, True])
def test_pages_from_a_window_match_the_reference_as_windows_turn_over(one_split):
    """The loop-2 passes take their pages from a window of table entries loaded ahead. With
    one split a warp reads 64 groups of a 16K row: its window of 16 groups (two levels)
    turns over three times, twice to a window loaded at a turnover; the outputs still
    match the torch reference."""
    from dataclasses import replace

    from flashloop_backend.kernels.cuda.packed_source import (
        DEFAULT_SOURCE,
        packed_dense_source_cuda,
    )
    from flashloop_backend.kernels.torch_ref.packed import packed_dense_source
    from tests.test_cuda_kernels import _packed_rows

    context = 16384 if one_split else 4096
    args, lengths = _packed_rows(2, sparse=False, context=context, tail=40, batch=3)
    tuning = DEFAULT_SOURCE
    if one_split:
        tuning = replace(tuning, keys_ctas_per_sm=0.01, values_ctas_per_sm=0.01)
    expected = packed_dense_source(*args, lengths, 0.1, 2048)
    got = packed_dense_source_cuda(*args, lengths, 0.1, 2048, tuning=tuning)
    names = ("out", "indices", "mass", "output", "contribution")
    for name, e, g in zip(names, expected, got, strict=True):
        if name == "indices":  # near-ties may pick differently: the sets nearly agree
            span = int(lengths.max())
            chosen = [torch.zeros(*t.shape[:2], span + 1, device=t.device) for t in (e, g)]
            for mask, t in zip(chosen, (e, g), strict=True):
                mask.scatter_(-1, torch.where(t < 0, span, t).long(), 1.0)
            sets = [mask[..., :span] for mask in chosen]
            both, most = (sets[0] * sets[1]).sum(-1), torch.maximum(*(m.sum(-1) for m in sets))
            agree = torch.where(most > 0, both / most.clamp_min(1), 1.0)
            assert agree.min().item() > 0.98, name
        else:
            torch.testing.assert_close(g.float(), e.float(), atol=2e-2, rtol=2e-2, msg=name)
