"""A decode step whose every loop 3-4 row the host vouches for leaves out the fallback
read (the dense or packed read for rows without their loop-2 reference) and its merge:
the host's record of planned sources, the ops and graph keys such a step launches, the
same tokens with and without it, and what the device does if the host were wrong."""

import pytest
import torch

from flashloop_backend import FlashLoopConfig
from flashloop_backend.backends.flashloop_steps import FlashLoopSteps
from flashloop_backend.backends.sparse_state import EMPTY, ReferenceStates
from flashloop_backend.capabilities import SupportRequest
from flashloop_backend.dispatch import BatchView, RowMode
from flashloop_backend.host import Engine, SamplingParams
from flashloop_backend.host.graphs import GraphSettings
from flashloop_backend.kernels.op_protocols import OpName
from flashloop_backend.registry import Registry

from .graph_recorder import RecordingCapture
from .host_helpers import tiny_model

REQUEST = SupportRequest(head_dim=16, block_size=16, num_q_heads=4, num_kv_heads=2)
SPARSE = {"sparse_decode_attention": {"enabled": True, "key_retention": 0.25}}
PACKED = {"kv_residual_quantization": {"enabled": True, "policy": "fixed_prompt", "group_size": 16}}


def _backend(**features):
    return Registry.discover().create("flashloop", REQUEST, FlashLoopConfig(**features))


def test_the_host_record_vouches_only_for_the_token_whose_source_it_planned():
    states = ReferenceStates(4, 2, 4, 16, 16, "cpu")
    assert not states.host_ready([(1, 7)])
    states.host_sources([(1, 7), (4, 8), (-1, 9)])  # slot 4 and -1 are not usable slots
    assert states.host_ready([(1, 7)])
    assert not states.host_ready([(1, 8)])  # another token in the same slot
    assert not states.host_ready([(1, 7), (2, 7)])  # every row, not some
    assert not states.host_ready([(4, 8)]) and not states.host_ready([(-1, 9)])
    states.host_sources([(2, EMPTY)])
    assert not states.host_ready([(2, EMPTY)])  # the device never finds EMPTY ready
    states.retire(1)
    assert not states.host_ready([(1, 7)])


def test_a_step_checks_its_readers_before_recording_its_sources():
    backend = _backend(**SPARSE)
    backend.reserve_state(4, 1, 4, 16, 64, "cpu")
    view = object()  # plan() keeps the view it vouches for; any object stands in

    def plan(depths, tokens):
        backend.plan(view, [1] * len(depths), depths, tokens)
        return backend._ready_view is view

    # a reader and a source of one token in one step never happens; if it did, the
    # reader's reference is the one written before the step, and there is none
    assert not plan([2, 1], [(0, 5), (0, 5)])
    assert plan([2], [(0, 5)])
    assert not plan([1, 1], [(1, 6), (2, 6)])  # no reader: nothing to skip
    assert not plan([2, 3], [(0, 5), (3, 6)])  # slot 3 was never a source's
    assert not plan([2], None)  # tokens not given
    with pytest.raises(ValueError, match="2 row tokens for 1 decode rows"):
        plan([2], [(0, 5), (1, 5)])


@pytest.mark.parametrize("packed", [False, True])
def test_a_vouched_step_launches_the_correction_alone(packed):
    backend = _backend(**SPARSE, **(PACKED if packed else {}))
    fallback = "packed_decode:few_rows" if packed else "dense_attention"
    correction = "packed_sparse_correction" if packed else "sparse_correction"
    assert backend.decode_ops(frozenset({2, 3})) == tuple(sorted((fallback, correction)))
    assert backend.decode_ops(frozenset({2, 3}), references_ready=True) == (correction,)
    assert backend.reference_variants(frozenset({3})) == (False, True)
    # a loop-1 or loop-2 row reads its own KV: nothing to skip, one graph per key
    assert backend.decode_ops(frozenset({1, 2}), True) == backend.decode_ops(frozenset({1, 2}))
    assert backend.reference_variants(frozenset({0, 3})) == (False,)
    assert _backend(**PACKED).reference_variants(frozenset({3})) == (False,)


def _generate(features, graphs, vouch: bool, monkeypatch):
    """(tokens, vouched steps, missing references, engine) of three requests decoding
    together; ``graphs``: None (eager), False (the graph runner's buffers, no capture) or
    True (captured and replayed by the CPU recorder); without ``vouch`` no step is
    vouched for."""
    from flashloop_backend.kernels.torch_ref import packed as torch_packed

    from .test_decode_graphs import _every_row

    monkeypatch.setattr(torch_packed, "_only_rows", _every_row)  # no host read in a capture
    backend = _backend(**features)
    vouched = []
    skips = FlashLoopSteps._skips_fallback

    def spy(self, view, plan):
        skipped = vouch and skips(self, view, plan)
        vouched.append(skipped)
        return skipped

    monkeypatch.setattr(FlashLoopSteps, "_skips_fallback", spy)
    settings = None
    if graphs is not None:
        settings = GraphSettings(buckets=(1, 2, 4), max_context=128, capture=graphs)
    engine = Engine(
        tiny_model(seed=5),
        backend,
        num_blocks=64,
        block_size=16,
        max_context=120,
        cuda_graphs=settings,
        graph_capture=RecordingCapture() if graphs else None,
    )
    prompts = [[(7 * i + 3 + j) % 61 for i in range(40 + 9 * j)] for j in range(3)]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
    tokens = [r.output_token_ids for r in results]
    return tokens, sum(vouched), int(backend.states.missing_reference), engine


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("graphs", [None, False, True])
def test_vouched_steps_give_the_same_tokens(packed, graphs, monkeypatch):
    features = {**SPARSE, **(PACKED if packed else {})}
    tokens, vouched, missing, engine = _generate(features, graphs, True, monkeypatch)
    plain, none, plain_missing, _ = _generate(features, graphs, False, monkeypatch)
    assert tokens == plain
    assert vouched > 0 and none == 0  # steady loop 3-4 steps are vouched for
    assert missing == plain_missing == 0
    if graphs:  # replays of the graph that launches the correction alone
        assert engine.graphs.stats()["replays"] > 0
        correction = "packed_sparse_correction" if packed else "sparse_correction"
        assert any(ops == (correction,) for (_, _, ops) in engine.graphs.graphs)


def test_a_vouched_row_the_device_finds_without_its_reference_is_caught_when_a_request_leaves():
    """The device routes by its own record: were the host to vouch for a row whose slot
    holds no reference, that row reads no stale state (its output is the zeroed base)
    and is counted; the next request to leave raises with the count."""
    backend = _backend(**SPARSE)
    backend.reserve_state(4, 1, 4, 16, 64, "cpu")
    rng = torch.Generator().manual_seed(0)
    kc, vc = torch.randn(8, 16, 2, 16, generator=rng), torch.randn(8, 16, 2, 16, generator=rng)
    one = torch.ones(2, dtype=torch.int64)
    view = BatchView(
        positions=torch.tensor([9, 5]),
        depths=torch.tensor([2, 3]),
        row_modes=torch.tensor([RowMode.DECODE, RowMode.DECODE], dtype=torch.int8),
        slots=torch.tensor([0, 1]),
        incarnations=torch.tensor([3, 4]),
        request_ids=one,
        window_ids=-one,
        context_lengths=torch.tensor([10, 6], dtype=torch.int32),
        block_tables=torch.tensor([[[1, 2, 3], [4, 5, 6]]] * 4, dtype=torch.int32),
        decode_only=True,
        decode_depths=frozenset({2, 3}),
    )
    backend.states.host_sources([(0, 3), (1, 4)])  # a record the device does not share
    backend.plan(view, [1, 1], [2, 3], [(0, 3), (1, 4)])
    dense = backend.kernels[OpName.DENSE_ATTENTION].impl
    ran = []
    original = dense.fn
    object.__setattr__(
        dense, "fn", lambda *args, **kwargs: ran.append(1) or original(*args, **kwargs)
    )
    try:
        out = backend.forward(torch.randn(2, 4, 16, generator=rng), kc, vc, view, layer=0)
    finally:
        object.__setattr__(dense, "fn", original)
    assert backend._skips and not ran  # no fallback read
    assert torch.equal(out, torch.zeros_like(out))
    assert int(backend.states.missing_reference) == int(backend.states.vouched_missing) == 2
    with pytest.raises(RuntimeError, match="2 loop 3-4 rows of steps the host vouched for"):
        backend.release(1, 0)


def test_warm_up_captures_both_graphs_of_a_loop_3_4_step(monkeypatch):
    """A loop 3-4 step's graph with its fallback read (a row the host cannot vouch for)
    and without: both are captured at warm-up, so serving either captures nothing."""
    _, _, _, engine = _generate({**SPARSE, **PACKED}, True, True, monkeypatch)
    engine.warm_up()
    loop4 = [ops for (_, _, ops) in engine.graphs.graphs if "packed_sparse_correction" in ops]
    assert ("packed_sparse_correction",) in loop4
    assert ("packed_decode:few_rows", "packed_sparse_correction") in loop4
    assert OpName.PACKED_DECODE.value not in {op for ops in loop4 for op in ops}
