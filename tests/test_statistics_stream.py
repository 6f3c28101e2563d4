"""The loop-2 source's statistics on a side stream (``statistics_stream``): the CUDA source
selects and gathers the contribution there beside a values pass that sums the dense output
alone, and gives the same outputs as the one-stream source; the backend stores the
references on that stream and joins it before a forward returns."""

from __future__ import annotations

import pytest
import torch

from flashloop_backend.capabilities import Capability
from flashloop_backend.kernels.op_inputs import PackedKV, PackedSourceInputs, SourceInputs
from flashloop_backend.kernels.op_protocols import SourceOutputs


def _beside():
    from flashloop_backend.kernels.cuda.packed_source import SourceTuning

    return SourceTuning(statistics_rows=4)


def _same_statistics(got, expected, exact_dense: bool = True) -> None:
    out, indices, mass, output, contribution = got[:5]
    assert torch.equal(indices, expected[1])
    assert torch.equal(mass, expected[2])
    if exact_dense:  # the same sums in the same order, the LSE merged alike
        assert torch.equal(out, expected[0])
        assert torch.equal(output, expected[3])
    # the contribution sums the same terms in another order
    torch.testing.assert_close(contribution, expected[4], atol=1e-5, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("retention", [0.1, 0.99])
def test_the_source_beside_its_statistics_gives_the_one_stream_outputs(retention):
    from flashloop_backend.kernels.cuda.packed_source import packed_dense_source_cuda
    from flashloop_backend.kernels.torch_ref.packed import packed_dense_source
    from tests.test_cuda_kernels import _packed_rows

    args, lengths = _packed_rows(2, sparse=False)
    if retention > 0.5:  # a zero query: every key ties and K reaches the BF16 tail
        q = args[0].clone()
        q[0] = 0
        args = (q, *args[1:])
    bucket = 1088
    expected = packed_dense_source_cuda(*args, lengths, retention, bucket)
    stream = torch.cuda.Stream()
    got = packed_dense_source_cuda(
        *args, lengths, retention, bucket, tuning=_beside(), statistics_stream=stream
    )
    assert len(expected) == 5 and len(got) == 6
    assert got[5].stream is stream
    torch.cuda.current_stream().wait_stream(stream)
    _same_statistics(got, expected)
    reference = packed_dense_source(*args, lengths, retention, bucket)
    torch.testing.assert_close(got[4], reference[4].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_more_rows_than_statistics_rows_keep_one_stream():
    from flashloop_backend.kernels.cuda.packed_source import SourceTuning, packed_dense_source_cuda
    from tests.test_cuda_kernels import _packed_rows

    args, lengths = _packed_rows(2, sparse=False)
    tuning = SourceTuning(statistics_rows=2)
    got = packed_dense_source_cuda(
        *args, lengths, 0.1, 128, tuning=tuning, statistics_stream=torch.cuda.Stream()
    )
    assert len(got) == 5


@pytest.mark.gpu
def test_the_source_beside_its_statistics_replays_from_a_cuda_graph():
    """Captured with its fork and join, replayed three times: the same outputs each time,
    and both streams' arrival counters back at 0."""
    from flashloop_backend.kernels.cuda import arrivals
    from flashloop_backend.kernels.cuda.packed_source import packed_dense_source_cuda
    from tests.test_cuda_kernels import _packed_rows

    args, lengths = _packed_rows(2, sparse=False)
    stream = torch.cuda.Stream()

    def run():
        got = packed_dense_source_cuda(
            *args, lengths, 0.1, 128, tuning=_beside(), statistics_stream=stream
        )
        torch.cuda.current_stream().wait_stream(stream)
        return got[:5]

    first = run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        replayed = run()
    for _ in range(3):
        for t in replayed:
            t.zero_()
        graph.replay()
        _same_statistics(replayed, first)
    torch.cuda.synchronize()
    roles = {role for device, role in arrivals._COUNTERS if device == first[0].device}
    assert roles == {"main", "statistics"}
    assert not any(counters.any() for counters in arrivals._COUNTERS.values())


def test_packed_source_inputs_pass_the_stream_only_when_given():
    """An implementation that does not declare ``statistics_stream`` is called with the
    protocol's arguments alone; one given a stream gets it by keyword."""
    seen = {}

    def source(*args, **kwargs):
        seen.clear()
        seen.update(kwargs)
        return tuple(torch.zeros(1) for _ in range(5))

    paged = SourceInputs(*(torch.zeros(1) for _ in range(5)), 0.1, 8)
    kv = PackedKV(None, 0, None)
    result = PackedSourceInputs(kv, paged).call(source)
    assert seen == {} and result.statistics is None
    marker = object()
    PackedSourceInputs(kv, paged, statistics_stream=marker).call(source)
    assert seen == {"statistics_stream": marker}
    assert SourceOutputs(*(torch.zeros(1) for _ in range(5))).statistics is None


def test_only_the_cuda_source_declares_a_statistics_stream():
    from flashloop_backend.kernels.op_protocols import OpName
    from flashloop_backend.registry import Registry

    declaring = {
        (name, op)
        for name, provider in Registry.discover().kernels.items()
        for op, impl in provider.impls.items()
        if Capability.STATISTICS_STREAM in impl.support.capabilities
    }
    assert declaring == {("cuda", OpName.PACKED_SOURCE)}
