"""CUDA C++ kernels built on first use (``kernels/cuda``): the NVRTC loader on the GPU, and
the reason it gives where it cannot build."""

import ctypes

import pytest
import torch

from flashloop_backend.kernels.cuda import loader

SCALE_ADD = r"""
extern "C" __global__ void scale_add(const float* x, float* y, float a, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] += a * x[i];
}
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the reason a CPU machine gives")
def test_a_machine_without_cuda_says_why_it_cannot_build():
    assert "no CUDA device" in loader.unavailable()


@pytest.mark.gpu
def test_a_built_kernel_runs_on_the_current_stream_and_in_a_cuda_graph():
    assert loader.unavailable() is None
    kernel = loader.build(SCALE_ADD, "scale_add", ("scale_add",))["scale_add"]
    n = 1000
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    expected = y + 2.5 * x

    def launch():
        args = [ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr())]
        kernel((4, 1, 1), (256, 1, 1), [*args, ctypes.c_float(2.5), ctypes.c_int64(n)])

    launch()
    torch.testing.assert_close(y, expected)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    graph.replay()
    graph.replay()
    torch.testing.assert_close(y, expected + 5.0 * x)
    with pytest.raises(loader.CudaBuildError, match="NVRTC could not build"):
        loader.build('extern "C" __global__ void broken( {', "broken", ("broken",))


def _packed_rows(levels, sparse, context=1024, tail=40, batch=3, seed=0, depths=None, group=64):
    """A store of ``batch`` packed prompts at Ouro's head shape (16 heads x 128, groups of
    ``group``), BF16 tails, metadata of every row at depth ``levels - 1`` (or at
    ``depths``, one a row)."""
    from flashloop_backend.kv.levels import level_metadata
    from flashloop_backend.kv.store import PackedKVStore

    gen = torch.Generator(device="cuda").manual_seed(seed)
    heads, dim, block = 16, 128, 16
    pages = batch * 4 * context // group + 8
    store = PackedKVStore(pages, 2, heads, dim, group, device="cuda")
    for s in range(batch):
        shape = (context, 2, heads, dim)
        keys = [torch.randn(shape, device="cuda", generator=gen)]
        values = [torch.randn(shape, device="cuda", generator=gen)]
        for _ in range(3):
            keys.append(keys[-1] + 0.3 * torch.randn(shape, device="cuda", generator=gen))
            values.append(values[-1] + 0.3 * torch.randn(shape, device="cuda", generator=gen))
        active = None
        if sparse:
            keep = torch.rand(context, device="cuda", generator=gen) < 0.5
            active = [torch.ones_like(keep)] * 3 + [keep]
        store.encode(s, keys, values, active)
    pages = (context + tail) // block + 1
    cache_k = torch.randn(batch * pages, block, heads, dim, device="cuda", generator=gen)
    cache_v = torch.randn_like(cache_k)
    tables = torch.arange(batch * pages, device="cuda", dtype=torch.int32).reshape(batch, pages)
    lengths = torch.tensor([context + tail, context + 7, 0][:batch], device="cuda").int()
    q = torch.randn(batch, heads, dim, device="cuda", generator=gen)
    depths = [levels - 1] * batch if depths is None else depths
    meta = level_metadata(store, list(range(batch)), depths, "cuda")
    args = (q.bfloat16(), store, 1, meta, cache_k.bfloat16(), cache_v.bfloat16(), tables)
    return args, lengths


@pytest.mark.gpu
@pytest.mark.parametrize("few_rows", [False, True])
@pytest.mark.parametrize("levels", [1, 2, 4])
def test_the_cuda_streaming_reader_matches_the_reference(levels, few_rows):
    """Plain reads at 1, 2 and 4 dense levels plus BF16 tails (a row of length 0 reads
    nothing) against the torch reference, split over the SMs or one CTA per (row, head)
    (the ``few_rows`` hint of a loop 3-4 fallback)."""
    from flashloop_backend.kernels.cuda.packed_stream import packed_decode_cuda
    from flashloop_backend.kernels.torch_ref.packed import packed_decode_reference

    args, lengths = _packed_rows(levels, sparse=False)
    expected = packed_decode_reference(*args, lengths).float()
    got = packed_decode_cuda(*args, lengths, None, few_rows).float()
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    assert torch.equal(got[2], torch.zeros_like(got[2]))


@pytest.mark.gpu
@pytest.mark.parametrize("group", [32, 128])
def test_the_cuda_streaming_reader_reads_groups_of_32_and_128(group):
    """Groups of 32 tokens give a lane 4 tokens a group (one V flush a group), of 128 give
    16 (two); at 2 and 4 levels against the torch reference."""
    from flashloop_backend.kernels.cuda.packed_stream import packed_decode_cuda
    from flashloop_backend.kernels.torch_ref.packed import packed_decode_reference

    for levels in (2, 4):
        args, lengths = _packed_rows(levels, sparse=False, group=group)
        expected = packed_decode_reference(*args, lengths).float()
        got = packed_decode_cuda(*args, lengths).float()
        torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


def test_the_reader_copies_in_halves_from_three_levels_with_one_stage():
    """The default copy by level count: K and V halves from three levels (the launch
    measured faster there), whole blocks below; a ring of two stages never splits."""
    from flashloop_backend.kernels.cuda.packed_stream import (
        DEFAULT_STREAM,
        StreamTuning,
        copies_in_halves,
    )

    assert [copies_in_halves(n, DEFAULT_STREAM) for n in (1, 2, 3, 4)] == [0, 0, 1, 0]
    assert copies_in_halves(4, StreamTuning(level_chunk=0))
    assert copies_in_halves(4, StreamTuning(split_copy=True))  # asked for: no level units
    assert copies_in_halves(2, StreamTuning(split_copy=True))
    assert not copies_in_halves(4, StreamTuning(split_copy=False, level_chunk=0))
    assert not copies_in_halves(4, StreamTuning(stages=2, split_copy=True))


def test_four_levels_copy_in_one_level_units_so_two_ctas_fit_an_sm():
    """At four levels the default copies one level's K or V half at a time through a
    ring of three units: a 4-warp CTA then needs under half of an SM's 228 KB, where the
    whole group of every level needed 147 KB (one CTA an SM). Launches the kernel cannot
    build are refused by name."""
    from flashloop_backend.kernels.cuda.packed_stream import (
        DEFAULT_STREAM,
        StreamTuning,
        chunk_levels,
        shared_bytes,
    )

    assert [chunk_levels(n, DEFAULT_STREAM) for n in (1, 2, 3, 4)] == [0, 0, 0, 1]
    assert shared_bytes(4, 64, 128, DEFAULT_STREAM) == 4 * 3 * 4608 + 4 * 130 * 4
    whole = StreamTuning(level_chunk=0)
    assert shared_bytes(4, 64, 128, whole) == 4 * 4 * 9216 + 4 * 130 * 4
    assert shared_bytes(3, 64, 128, StreamTuning(level_chunk=1, ring_units=4)) == (
        4 * 4 * 4608 + 4 * 130 * 4
    )
    with pytest.raises(
        ValueError, match=r"level_chunk=2 needs one ring stage .* levels read \(3\)"
    ):
        chunk_levels(3, StreamTuning(level_chunk=2))
    with pytest.raises(ValueError, match="ring_units=6: 2 to 5 at 4 levels in units of 2"):
        chunk_levels(4, StreamTuning(level_chunk=2, ring_units=6))
    with pytest.raises(ValueError, match="level_chunk=-1: levels per copy unit are 0"):
        chunk_levels(4, StreamTuning(level_chunk=-1))
    assert chunk_levels(4, StreamTuning(split_copy=False)) == 0  # whole blocks, as asked


@pytest.mark.gpu
@pytest.mark.parametrize("warps", [4, 3])
@pytest.mark.parametrize("levels", [2, 3, 4])
def test_the_split_copy_reads_what_the_whole_block_copy_reads(levels, warps):
    """One ring stage with each group copied in a K half and a V half computes the same
    products in the same order as the whole-block copy: equal outputs, bit for bit, and
    the reference's within tolerance."""
    from flashloop_backend.kernels.cuda.packed_stream import StreamTuning, packed_decode_cuda
    from flashloop_backend.kernels.torch_ref.packed import packed_decode_reference

    args, lengths = _packed_rows(levels, sparse=False, context=2048)
    whole = StreamTuning(warps=warps, stages=1, split_copy=False, level_chunk=0)
    halves = StreamTuning(warps=warps, stages=1, split_copy=True, level_chunk=0)
    expected = packed_decode_cuda(*args, lengths, tuning=whole)
    got = packed_decode_cuda(*args, lengths, tuning=halves)
    assert torch.equal(got, expected)
    reference = packed_decode_reference(*args, lengths).float()
    torch.testing.assert_close(got.float(), reference, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("levels", "chunk", "units", "depths"),
    [
        (4, 1, 3, None),
        (4, 2, 3, None),
        (4, 2, 2, None),
        (4, 1, 4, None),
        (4, 1, 2, None),
        (4, 2, 5, None),  # the largest ring: a group's first unit issues the next group's
        (4, 1, 9, None),
        (4, 4, 3, None),  # a unit of every level
        (3, 1, 3, None),
        (2, 2, 2, None),
        (2, 2, 3, None),
        (4, 1, 3, [3, 1, 2]),  # rows below the batch's depth skip levels, not commits
    ],
)
def test_the_level_unit_copy_reads_what_the_whole_block_copy_reads(levels, chunk, units, depths):
    """Copying each group in units of a few levels' K or V half through a small ring
    computes the same products in the same order as the whole-block copy: equal outputs,
    bit for bit, over rows of several splits, a short row and an empty one."""
    from flashloop_backend.kernels.cuda.packed_stream import StreamTuning, packed_decode_cuda

    args, lengths = _packed_rows(levels, sparse=False, context=2048, depths=depths)
    whole = StreamTuning(stages=1, split_copy=False, level_chunk=0)
    chunked = StreamTuning(stages=1, level_chunk=chunk, ring_units=units)
    expected = packed_decode_cuda(*args, lengths, tuning=whole)
    assert torch.equal(packed_decode_cuda(*args, lengths, tuning=chunked), expected)
    few = packed_decode_cuda(*args, lengths, None, True, tuning=chunked)  # one CTA a head
    assert torch.equal(few, packed_decode_cuda(*args, lengths, None, True, tuning=whole))


@pytest.mark.gpu
def test_the_cuda_source_keys_pass_writes_the_logits_and_lse():
    """The loop-2 keys pass: every position's scaled logit below the row's length, packed
    groups and BF16 tail alike, and the rows' LSE, against the torch reference."""
    from flashloop_backend.kernels.cuda.packed_source import source_keys
    from flashloop_backend.kernels.torch_ref.packed import packed_history
    from flashloop_backend.kernels.triton.packed_decode import packed_span

    args, lengths = _packed_rows(2, sparse=False)
    q, store, layer, meta, cache_k, cache_v, tables = args
    span = packed_span(store, meta, tables, 16)
    logits = torch.full((3, 16, span), float("nan"), device="cuda")
    lse = torch.empty(3, 16, device="cuda")
    source_keys(q, store, layer, meta, cache_k, tables, lengths, logits, lse, 128**-0.5)
    keys, _ = packed_history(store, layer, meta, cache_k, cache_v, tables, q.dtype)
    want = torch.einsum("rhd,rthd->rht", q.float(), keys) / 128**0.5
    for r in range(2):
        n = int(lengths[r])
        torch.testing.assert_close(logits[r, :, :n], want[r, :, :n], atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(lse[r], torch.logsumexp(want[r, :, :n], -1), atol=2e-2, rtol=0)
    assert torch.isneginf(lse[2]).all()  # a row of length 0


@pytest.mark.gpu
def test_the_one_launch_selection_merges_the_keys_pass_lse_as_the_merge_launch():
    """Given the keys pass's split states, the selection writes each row's lse (a row of
    length 0: -inf) as ``merge_lse`` does and selects as it does from that lse."""
    from flashloop_backend.kernels.cuda.packed_source import source_keys
    from flashloop_backend.kernels.cuda.select_top_k import select_positions_cuda
    from flashloop_backend.kernels.triton.packed_decode import packed_span

    args, lengths = _packed_rows(2, sparse=False)
    q, store, layer, meta, cache_k, _, tables = args
    span = packed_span(store, meta, tables, 16)
    logits = torch.empty(3, 16, span, device="cuda")
    lse = torch.empty(3, 16, device="cuda")
    states = source_keys(q, store, layer, meta, cache_k, tables, lengths, logits, lse, 128**-0.5)
    merged = torch.full_like(lse, float("nan"))
    picks = [torch.empty(3, 16, 128, dtype=torch.int32, device="cuda") for _ in range(2)]
    launched = select_positions_cuda(logits, lse, lengths, picks[0], 0.1)
    inside = select_positions_cuda(logits, merged, lengths, picks[1], 0.1, split_states=states)
    torch.testing.assert_close(merged, lse, atol=1e-5, rtol=1e-6)
    assert torch.isneginf(merged[2]).all()
    assert torch.equal(picks[0], picks[1]) and torch.equal(launched.plan, inside.plan)
    torch.testing.assert_close(inside.part_mass, launched.part_mass, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_the_cuda_streaming_reader_hands_compact_levels_to_the_triton_reader():
    from flashloop_backend.kernels.cuda.packed_stream import packed_decode_cuda
    from flashloop_backend.kernels.torch_ref.packed import packed_decode_reference

    args, lengths = _packed_rows(4, sparse=True)
    assert args[3].compact_from == 3
    expected = packed_decode_reference(*args, lengths).float()
    torch.testing.assert_close(
        packed_decode_cuda(*args, lengths).float(), expected, atol=2e-2, rtol=2e-2
    )


@pytest.mark.gpu
@pytest.mark.parametrize(("levels", "sparse"), [(3, False), (4, False), (4, True)])
def test_the_cuda_selected_key_correction_matches_the_reference(levels, sparse):
    """The loop 3-4 correction over dense levels and a compact fourth, keys below and
    above the packed length, a row with no selected key (output - contribution)."""
    from flashloop_backend.kernels.cuda.packed_selected import packed_sparse_correction_cuda
    from flashloop_backend.kernels.torch_ref.packed import (
        packed_dense_source,
        packed_sparse_correction,
    )
    from flashloop_backend.kv.levels import level_metadata

    args, lengths = _packed_rows(levels, sparse)
    q, store, layer, _, cache_k, cache_v, tables = args
    two = level_metadata(store, [0, 1, 2], [1, 1, 1], "cuda")
    _, indices, mass, output, contribution = packed_dense_source(
        q, store, layer, two, cache_k, cache_v, tables, lengths, 0.1, 128
    )
    assert (indices[0] >= 1024).any()  # BF16 tail keys are selected too
    state = (indices, mass, output, contribution)
    expected = packed_sparse_correction(*args, *state).float()
    got = packed_sparse_correction_cuda(*args, *state).float()
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got[2], (output[2] - contribution[2]).float(), atol=1e-2, rtol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("sparse", [False, True])
def test_the_cuda_correction_reads_blocks_of_keys_on_many_pages(sparse):
    """Selections whose 16-key blocks touch more than 8 pages: one key on each of 16
    pages, runs on one page, keys a compact level lacks between keys it keeps, and BF16
    tail keys, against the torch reference."""
    from flashloop_backend.kernels.cuda.packed_selected import packed_sparse_correction_cuda
    from flashloop_backend.kernels.torch_ref.packed import packed_sparse_correction

    args, _ = _packed_rows(4, sparse)
    q = args[0]
    rows, heads = q.shape[0], q.shape[1]
    isolated = [64 * p + (7 * p) % 64 for p in range(16)]
    runs = [*range(300, 323), *range(640, 650)]
    spread = [3 + 61 * k for k in range(16)]
    tail = [1024, 1030]  # below both rows' lengths
    picks = [sorted(set(isolated + runs + tail)), sorted(set(spread + runs)), sorted(isolated)]
    bucket = 96
    indices = torch.full((rows, heads, bucket), -1, dtype=torch.int32, device="cuda")
    for r in range(rows - 1):  # the last row has length 0: it selects nothing
        for h in range(heads):
            chosen = picks[(r + h) % len(picks)]
            indices[r, h, : len(chosen)] = torch.tensor(chosen, dtype=torch.int32)
    gen = torch.Generator(device="cuda").manual_seed(3)
    mass = torch.rand(rows, heads, device="cuda", generator=gen)
    output = torch.randn(rows, heads, 128, device="cuda", generator=gen)
    contribution = 0.5 * torch.randn(rows, heads, 128, device="cuda", generator=gen)
    state = (indices, mass, output, contribution)
    expected = packed_sparse_correction(*args, *state).float()
    got = packed_sparse_correction_cuda(*args, *state).float()
    torch.testing.assert_close(got, expected, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_the_values_pass_finish_equals_the_finish_launch_at_every_launch():
    """The loop-2 source with the values pass's last CTA finishing against the Triton
    finish launch over the same partials, launched again and replayed from a CUDA graph:
    each launch puts the arrival counters back to 0, so every launch finishes once and
    alike."""
    from flashloop_backend.kernels.cuda import arrivals
    from flashloop_backend.kernels.cuda.packed_source import (
        SourceTuning,
        packed_dense_source_cuda,
    )

    args, lengths = _packed_rows(2, sparse=False)

    def run(fused):
        tuning = SourceTuning(finish_in_kernel=fused)
        return packed_dense_source_cuda(*args, lengths, 0.1, 128, tuning=tuning)

    expected = run(False)
    first = run(True)
    for got, want in zip(first, expected, strict=True):
        if got.is_floating_point():
            torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
        else:
            assert torch.equal(got, want)
    again = run(True)
    assert all(torch.equal(a, b) for a, b in zip(again, first, strict=True))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = run(True)
    for _ in range(3):
        for t in replayed:
            t.zero_()
        graph.replay()
        assert all(torch.equal(a, b) for a, b in zip(replayed, first, strict=True))
    torch.cuda.synchronize()
    assert not arrivals._COUNTERS[(first[0].device, "main")].any()


@pytest.mark.gpu
def test_the_cuda_source_matches_the_reference_statistics():
    from flashloop_backend.kernels.cuda.packed_source import packed_dense_source_cuda
    from flashloop_backend.kernels.torch_ref.packed import packed_dense_source

    args, lengths = _packed_rows(2, sparse=False)
    expected = packed_dense_source(*args, lengths, 0.1, 128)
    got = packed_dense_source_cuda(*args, lengths, 0.1, 128)
    names = ("out", "indices", "mass", "output", "contribution")
    for name, e, g in zip(names, expected, got, strict=True):
        if name == "indices":  # near-ties may order differently: nearly all agree
            agree = (e == g).float().mean().item()
            assert agree > 0.98, agree
        else:
            torch.testing.assert_close(g.float(), e.float(), atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.gpu
def test_the_cuda_source_takes_the_earliest_ties_in_both_passes():
    """A zero query scores every key 0: the selection takes the first K positions, and the
    values pass's contribution sums exactly those (1/T each), in packed groups and the
    BF16 tail alike; the other rows keep matching the reference."""
    from flashloop_backend.kernels.cuda.packed_source import packed_dense_source_cuda
    from flashloop_backend.kernels.torch_ref.packed import packed_dense_source

    args, lengths = _packed_rows(2, sparse=False)
    q = args[0].clone()
    q[0] = 0
    args = (q, *args[1:])
    retention = 0.99  # K reaches into row 0's BF16 tail
    expected = packed_dense_source(*args, lengths, retention, 1088)
    got = packed_dense_source_cuda(*args, lengths, retention, 1088)
    count = -(-int(lengths[0]) * 99 // 100)
    want = torch.arange(1088, device="cuda", dtype=torch.int32)
    want = torch.where(want < count, want, -1)
    assert torch.equal(got[1][0], want.expand(16, -1))
    for name, e, g in zip(("output", "contribution"), expected[3:], got[3:], strict=True):
        torch.testing.assert_close(g[0], e[0].float(), atol=1e-2, rtol=1e-2, msg=name)
    torch.testing.assert_close(got[2][0], torch.full_like(got[2][0], count / int(lengths[0])))
    torch.testing.assert_close(got[3][1:], expected[3][1:].float(), atol=2e-2, rtol=2e-2)


def _oracle_selection(logits, lengths, retention, bucket):
    """Indices [R, H, Kb] of the top K = max(1, ceil(retention * T)) logits per (row,
    head), earlier positions first among equals, in position order, -1 past K."""
    from flashloop_backend.kernels.torch_ref.sparse_decode import selected_counts

    span = logits.shape[-1]
    pos = torch.arange(span, device=logits.device)
    visible = pos < lengths[:, None, None].long()
    masked = torch.where(visible, logits, float("-inf"))
    order = torch.sort(-masked, dim=-1, stable=True).indices
    counts = selected_counts(lengths, retention)[:, None, None]
    rank = torch.arange(span, device=logits.device)
    chosen = torch.where(rank < counts, order, span)  # span sorts past every position
    chosen = torch.sort(chosen, dim=-1).values[..., :bucket]
    return torch.where(chosen < span, chosen, -1).to(torch.int32)


@pytest.mark.gpu
@pytest.mark.parametrize("span", [64, 8192, 40000])
@pytest.mark.parametrize("logits_kind", ["continuous", "integers", "constant"])
@pytest.mark.parametrize(
    "launch",
    [
        {"batch": 4},
        {"batch": 8},
        {"batch": 4, "rank_list": 512},
        {"batch": 4, "rank_list": 1024},
        {"batch": 4, "rank_list": 64},
    ],
)
def test_the_one_launch_selection_matches_the_triton_selection_and_the_oracle(
    span, logits_kind, launch
):
    """Rows of every length class (1, odd, full span), logits continuous, drawn from a few
    values (many ties at the threshold) or constant (every key in one bin: more than the
    candidate list holds at 8192 and 40000, so the digits search the row), in a strided
    view, under each launch (tiles in flight, lists ranked directly): the CUDA
    selection picks the oracle's positions, the Triton selection's threshold plan, and
    its mass."""
    from flashloop_backend.backends.sparse_state import key_bucket
    from flashloop_backend.kernels.cuda.select_top_k import select_positions_cuda
    from flashloop_backend.kernels.triton.threshold_select import select_positions

    gen = torch.Generator(device="cuda").manual_seed(span)
    rows, heads, retention = 5, 16, 0.1
    padded = torch.randn(rows, heads, span + 8, device="cuda", generator=gen) * 3.0
    if logits_kind == "integers":
        padded = torch.round(padded)
    elif logits_kind == "constant":
        padded = torch.full_like(padded, 1.5)
    logits = padded[..., :span]  # a row stride above the span
    lengths = torch.tensor([1, span, span // 2 + 1, max(1, span - 7), 3], device="cuda")
    lengths = lengths.to(torch.int32)
    visible = torch.arange(span, device="cuda") < lengths[:, None, None]
    lse = torch.where(visible, logits, float("-inf")).logsumexp(-1)
    bucket = key_bucket(retention, span)
    want = _oracle_selection(logits, lengths, retention, bucket)
    triton_indices = torch.full_like(want, 7)
    cuda_indices = torch.full_like(want, 7)
    expected = select_positions(logits, lse, lengths, triton_indices, retention)
    got = select_positions_cuda(logits, lse, lengths, cuda_indices, retention, **launch)
    assert torch.equal(triton_indices, want)
    assert torch.equal(cuda_indices, want)
    assert torch.equal(got.plan, expected.plan)
    assert torch.equal(got.offsets, torch.zeros_like(got.offsets))
    torch.testing.assert_close(got.part_mass.sum(-1), expected.part_mass.sum(-1))
    taken = torch.where(want >= 0, want, 0).long()
    mass = torch.where(want >= 0, (logits.gather(-1, taken) - lse[..., None]).exp(), 0.0)
    torch.testing.assert_close(got.part_mass[..., 0], mass.sum(-1))


@pytest.mark.gpu
def test_the_one_launch_selection_takes_nothing_from_an_empty_row():
    from flashloop_backend.kernels.cuda.select_top_k import select_positions_cuda

    logits = torch.randn(2, 4, 256, device="cuda")
    lse = logits.logsumexp(-1)
    lengths = torch.tensor([0, 256], dtype=torch.int32, device="cuda")
    indices = torch.full((2, 4, 32), 7, dtype=torch.int32, device="cuda")
    selection = select_positions_cuda(logits, lse, lengths, indices, 0.1)
    assert torch.equal(indices[0], torch.full_like(indices[0], -1))
    assert torch.equal(selection.plan[0, :, 1:], torch.tensor([[0, -1]] * 4, device="cuda"))
    assert torch.equal(selection.part_mass[0], torch.zeros_like(selection.part_mass[0]))
    assert (indices[1, :, :26] >= 0).all() and (indices[1, :, 26:] == -1).all()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"logits": torch.zeros(2, 4, 64, dtype=torch.float16)}, "must be float32; got torch.float16"),
        ({"lengths": torch.full((2,), 64)}, "must be int32; got torch.int64"),
        ({"lse": torch.zeros(2, 3)}, r"lse \(2, 3\) must lead with indices' \(rows, heads\) = \(2, 4\)"),
        ({"logits": torch.zeros(2, 4, 128)[..., ::2]}, "unit stride on their last axis"),
        ({"batch": 3}, r"batch=3 must be one of \(4, 8\)"),
        ({"rank_list": 2000}, r"rank_list=2000 must be in \[0, 1024\] \(the threads per CTA\)"),
        ({"states": (torch.zeros(2, 4, 3).half(),) * 2}, "split states must be float32"),
        ({"states": (torch.zeros(2, 3, 3),) * 2}, r"\[rows, heads, splits\] with \(rows, heads\) = \(2, 4\)"),
        ({"states": (torch.zeros(2, 4, 3), torch.zeros(2, 3, 4).transpose(1, 2))}, "share strides"),
    ],
)  # fmt: skip
def test_the_one_launch_selection_names_each_input_it_refuses(change, message):
    """Checked before anything is built or launched, so a CPU machine sees them too."""
    from flashloop_backend.kernels.cuda.select_top_k import select_positions_cuda

    args = {
        "logits": torch.zeros(2, 4, 64),
        "lse": torch.zeros(2, 4),
        "lengths": torch.full((2,), 64, dtype=torch.int32),
        "indices": torch.zeros(2, 4, 16, dtype=torch.int32),
        "batch": 4,
        "states": None,
        "rank_list": 0,
    } | change
    with pytest.raises(ValueError, match=message):
        select_positions_cuda(
            *(args["logits"], args["lse"], args["lengths"], args["indices"], 0.1, args["batch"]),
            split_states=args["states"],
            rank_list=args["rank_list"],
        )


@pytest.mark.parametrize("bad", ["part_mass", "mass", "out", "output", "contribution"])
def test_the_values_pass_finish_names_the_buffer_it_cannot_write(bad):
    """Checked before the counters or a launch, so a CPU machine sees them too."""
    from flashloop_backend.kernels.cuda.packed_source import _finish
    from flashloop_backend.kernels.triton.threshold_select import Selection

    rows, heads, dim = 2, 4, 8
    strided = {
        "part_mass": torch.zeros(rows, heads, 2)[..., :1],
        "mass": torch.zeros(heads, rows).t(),
    }
    strided |= {
        name: torch.zeros(rows, heads, 2 * dim)[..., ::2]
        for name in ("out", "output", "contribution")
    }
    tensors = {
        "part_mass": torch.zeros(rows, heads, 1),
        "mass": torch.zeros(rows, heads),
        **{name: torch.zeros(rows, heads, dim) for name in ("out", "output", "contribution")},
    } | {bad: strided[bad]}
    plan, offsets = torch.zeros(rows, heads, 3).int(), torch.zeros(rows, heads, 1, 2).int()
    selection = Selection(plan, offsets, tensors["part_mass"], 1, 16)
    outputs = tuple(tensors[name] for name in ("out", "mass", "output", "contribution"))
    with pytest.raises(ValueError, match="part_mass and mass" if "mass" in bad else bad):
        _finish(selection, outputs, 3)
