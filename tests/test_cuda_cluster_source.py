"""The one-launch cluster source (``kernels/cuda/packed_source_cluster``): on a GPU it takes
the same keys as the three-launch source and sums the same outputs, replays from a CUDA
graph, and fits the shared memory its dispatch rule assumes; the rule itself on the CPU."""

import ctypes

import pytest
import torch

from flashloop_backend.kernels.cuda.packed_source_cluster import (
    SHARED_LIMIT,
    STATIC_SHARED,
    shared_reason,
)

from .test_cuda_kernels import _packed_rows

CLUSTER_ALWAYS, CLUSTER_NEVER = 10**6, 0
# the FP32 sums group the same products in other splits; the BF16 output rounds once more
FLOAT_TOLERANCE = {"atol": 1e-4, "rtol": 1e-3}
BF16_TOLERANCE = {"atol": 1e-2, "rtol": 1e-2}


def test_a_cta_holds_the_logits_of_a_32k_row_but_not_of_a_256k_one():
    assert shared_reason(2, 64, 128, 32768) is None
    assert shared_reason(2, 64, 128, 65536) is None
    reason = shared_reason(2, 64, 128, 262144)
    assert reason is not None
    assert "262144 positions" in reason and f"at most {SHARED_LIMIT} B" in reason


def _source(args, lengths, retention, bucket, pairs):
    from flashloop_backend.kernels.cuda.packed_source import SourceTuning, packed_dense_source_cuda

    tuning = SourceTuning(cluster_pairs=pairs)
    return packed_dense_source_cuda(*args, lengths, retention, bucket, tuning=tuning)


def _assert_same_source(got, want):
    names = ("out", "indices", "mass", "output", "contribution")
    for name, g, w in zip(names, got, want, strict=True):
        if name == "indices":
            assert torch.equal(g, w), (g != w).nonzero()[:8]
        elif name == "out":
            torch.testing.assert_close(g.float(), w.float(), **BF16_TOLERANCE, msg=name)
        else:
            torch.testing.assert_close(g, w, **FLOAT_TOLERANCE, msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize(("context", "batch"), [(1024, 3), (19968, 2)])
def test_the_cluster_source_takes_the_keys_the_three_launches_take(context, batch):
    """Rows with BF16 tails of 40 and 7 tokens (and at 1,024 an empty row): the same
    indices exactly (the threshold and ties do not depend on the LSE), the sums within
    FP32 regrouping; at 19,968 tokens each warp streams several groups."""
    args, lengths = _packed_rows(2, sparse=False, context=context, batch=batch)
    bucket = -(-(context + 40) // 10) + 64
    want = _source(args, lengths, 0.1, bucket, CLUSTER_NEVER)
    got = _source(args, lengths, 0.1, bucket, CLUSTER_ALWAYS)
    _assert_same_source(got, want)


@pytest.mark.gpu
def test_the_cluster_source_takes_the_earliest_ties():
    """A zero query scores every key 0: both sources take the first K positions, into the
    BF16 tail, and the mass is K / T."""
    args, lengths = _packed_rows(2, sparse=False)
    q = args[0].clone()
    q[0] = 0
    args = (q, *args[1:])
    got = _source(args, lengths, 0.99, 1088, CLUSTER_ALWAYS)
    count = -(-int(lengths[0]) * 99 // 100)
    expected = torch.arange(1088, device="cuda", dtype=torch.int32)
    assert torch.equal(got[1][0], torch.where(expected < count, expected, -1).expand(16, -1))
    torch.testing.assert_close(got[2][0], torch.full_like(got[2][0], count / int(lengths[0])))
    _assert_same_source(got, _source(args, lengths, 0.99, 1088, CLUSTER_NEVER))


@pytest.mark.gpu
def test_the_cluster_source_matches_the_reference_statistics():
    from flashloop_backend.kernels.torch_ref.packed import packed_dense_source

    args, lengths = _packed_rows(2, sparse=False)
    expected = packed_dense_source(*args, lengths, 0.1, 128)
    got = _source(args, lengths, 0.1, 128, CLUSTER_ALWAYS)
    names = ("out", "indices", "mass", "output", "contribution")
    for name, e, g in zip(names, expected, got, strict=True):
        if name == "indices":  # near-ties may order differently: nearly all agree
            assert (e == g).float().mean().item() > 0.98
        else:
            torch.testing.assert_close(g.float(), e.float(), atol=2e-2, rtol=2e-2, msg=name)


@pytest.mark.gpu
def test_the_cluster_source_replays_from_a_cuda_graph():
    args, lengths = _packed_rows(2, sparse=False, batch=1)
    first = _source(args, lengths, 0.1, 128, CLUSTER_ALWAYS)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = _source(args, lengths, 0.1, 128, CLUSTER_ALWAYS)
    for _ in range(3):
        for t in replayed:
            t.zero_()
        graph.replay()
        assert all(torch.equal(a, b) for a, b in zip(replayed, first, strict=True))


@pytest.mark.gpu
def test_the_cluster_kernel_static_shared_memory_is_within_its_bound():
    """The dispatch rule counts ``STATIC_SHARED`` bytes besides the rings and logits."""
    from flashloop_backend.kernels.cuda import loader

    args, lengths = _packed_rows(2, sparse=False, batch=1)
    _source(args, lengths, 0.1, 128, CLUSTER_ALWAYS)
    kernels = [
        k
        for module in loader._MODULES.values()
        for name, k in module.items()
        if name == "packed_source_cluster"
    ]
    assert kernels
    for kernel in kernels:
        static = ctypes.c_int()
        # CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
        assert loader._driver().cuFuncGetAttribute(ctypes.byref(static), 1, kernel.function) == 0
        assert 0 < static.value <= STATIC_SHARED
