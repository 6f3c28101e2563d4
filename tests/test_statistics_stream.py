"""The loop-2 source's statistics on a side stream (``statistics_stream``): the CUDA source
selects and gathers the contribution there beside a values pass that sums the dense output
alone, and gives the same outputs as the one-stream source (the contribution to its
precision); the backend stores the references on that stream and joins it before a
forward returns, also inside captured steps."""

from __future__ import annotations

import pytest
import torch

from flashloop_backend.capabilities import Capability
from flashloop_backend.kernels.op_inputs import PackedKV, PackedSourceInputs, SourceInputs
from flashloop_backend.kernels.op_protocols import SourceOutputs


def _beside():
    from flashloop_backend.kernels.cuda.packed_source import SourceTuning

    return SourceTuning(statistics_rows=4)


def _same_statistics(got, expected) -> None:
    out, indices, mass, output, contribution = got[:5]
    assert torch.equal(indices, expected[1])
    assert torch.equal(mass, expected[2])
    # the same dense sums (split counts may differ where the two values passes fit other
    # CTA counts an SM: here both fit two)
    torch.testing.assert_close(output, expected[3], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(out.float(), expected[0].float(), atol=1e-2, rtol=1e-2)
    # the one-stream values pass sums the contribution in FP16 pairs, the gather in FP32
    torch.testing.assert_close(contribution, expected[4], atol=2e-3, rtol=2e-3)


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
    # the FP32 gather sits at least as close to the reference as the FP16 sums
    gather = (got[4] - reference[4].float()).abs().max()
    pairs = (expected[4] - reference[4].float()).abs().max()
    assert gather <= pairs + 1e-6, (gather.item(), pairs.item())


@pytest.mark.gpu
@pytest.mark.parametrize(("limit", "forks"), [(2, False), (3, True)])
def test_up_to_statistics_rows_rows_fork(limit, forks):
    from flashloop_backend.kernels.cuda.packed_source import SourceTuning, packed_dense_source_cuda
    from tests.test_cuda_kernels import _packed_rows

    args, lengths = _packed_rows(2, sparse=False)  # three rows
    tuning = SourceTuning(statistics_rows=limit)
    got = packed_dense_source_cuda(
        *args, lengths, 0.1, 128, tuning=tuning, statistics_stream=torch.cuda.Stream()
    )
    assert len(got) == (6 if forks else 5)
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_the_source_beside_its_statistics_replays_from_a_cuda_graph():
    """Captured with its fork and join, replayed three times: the same outputs each time,
    and both streams' arrival counters back at 0."""
    from flashloop_backend.kernels.cuda import arrivals
    from flashloop_backend.kernels.cuda.packed_source import packed_dense_source_cuda
    from tests.test_cuda_kernels import _packed_rows

    args, lengths = _packed_rows(2, sparse=False)
    stream = torch.cuda.Stream()

    def run():  # 1088 slots: nine splits of the contribution's finish
        got = packed_dense_source_cuda(
            *args, lengths, 0.1, 1088, tuning=_beside(), statistics_stream=stream
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


@pytest.mark.gpu
def test_the_engine_replays_steps_whose_statistics_fork(monkeypatch):
    """All on through the engine with the statistics on the side stream: graph replays
    equal the same steps run eagerly on the graph's buffers bit for bit (the fork and
    join inside each captured layer), and agree with the one-stream source as bf16 runs
    do (the contribution's sums differ in precision)."""
    import json

    from flashloop_backend import FlashLoopConfig, embedded_model_path
    from flashloop_backend.host import SamplingParams, load_model
    from flashloop_backend.host.graphs import GraphSettings
    from flashloop_backend.kernels.cuda import packed_source
    from tests.test_gpu_graphs import ALL_ON, BUCKETS, _engine, _prompts

    config = FlashLoopConfig.from_dict(json.loads(ALL_ON.read_text()))
    model = load_model(embedded_model_path(), "cuda", torch.bfloat16)
    prompts = _prompts()
    forced = [p[-16:] for p in prompts]
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    runs = {}
    for label, rows, capture in (("replay", 4, True), ("buffers", 4, False), ("one", 0, True)):
        tuning = packed_source.SourceTuning(statistics_rows=rows)
        monkeypatch.setattr(packed_source, "DEFAULT_SOURCE", tuning)
        graphs = GraphSettings(buckets=BUCKETS, max_context=512, capture=capture)
        engine = _engine(model, "flashloop", config, graphs)
        assert engine.backend._statistics_stream is not None
        tokens = [r.output_token_ids for r in engine.generate(prompts, params)]
        logprobs = engine.generate(prompts, forced=forced, keep_logprobs=True)
        runs[label] = (tokens, torch.stack([r.logprobs for r in logprobs]))
    assert runs["replay"][0] == runs["buffers"][0]
    assert torch.equal(runs["replay"][1], runs["buffers"][1])
    one, forked = runs["one"][1], runs["replay"][1]
    agreement = (forked.argmax(-1) == one.argmax(-1)).float().mean().item()
    kl = (one.exp() * (one - forked)).sum(-1).mean().item()
    assert agreement >= 0.95 and kl < 0.02, (agreement, kl)


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


@pytest.mark.parametrize("bad", ["out", "output"])
def test_the_dense_only_finish_names_the_buffer_it_cannot_write(bad):
    """Checked before the counters or a launch, so a CPU machine sees it too."""
    from flashloop_backend.kernels.cuda.packed_source import _dense_finish

    rows, heads, dim = 2, 4, 8
    buffers = {name: torch.zeros(rows, heads, dim) for name in ("out", "output")}
    buffers[bad] = torch.zeros(rows, heads, 2 * dim)[..., ::2]
    with pytest.raises(ValueError, match=f"needs {bad} with a contiguous last dim"):
        _dense_finish(buffers["out"], buffers["output"], 3)


@pytest.mark.parametrize("bad", ["indices", "logits", "contribution"])
def test_the_gather_names_the_buffer_it_cannot_read_or_write(bad):
    """Checked before the source forks, so nothing runs on the side stream."""
    from flashloop_backend.kernels.cuda.packed_contribution import check_contribution_inputs

    rows, heads = 2, 4
    buffers = {
        "indices": torch.zeros(rows, heads, 16, dtype=torch.int32),
        "logits": torch.zeros(rows, heads, 64),
        "contribution": torch.zeros(rows, heads, 8),
    }
    buffers[bad] = torch.cat([buffers[bad], buffers[bad]], dim=-1)[..., ::2]
    with pytest.raises(ValueError, match=f"needs {bad} with a contiguous last dim"):
        check_contribution_inputs(buffers["indices"], buffers["logits"], buffers["contribution"])
