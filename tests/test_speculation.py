"""Self-speculative decoding with the loop-2 draft (issue 25): greedy block speculation
outputs exactly the non-speculative greedy tokens for every feature combination the
backend declares it verifies, alone and in mixed batches, through the graph runner's
buffers, across a block cut short by max_new_tokens or EOS, a preemption mid-block and a
cancellation; acceptance is counted right at every rejection position; what it does not
support is refused at configuration time, naming it."""

import dataclasses

import pytest
import torch

from flashloop_backend import FlashLoopConfig
from flashloop_backend.dispatch import RowMode
from flashloop_backend.host import Engine, SamplingParams
from flashloop_backend.host.graphs import GraphSettings
from flashloop_backend.host.speculation import Block, Speculation, SpeculationSettings
from flashloop_backend.registry import Registry

from .host_helpers import tiny_model
from .test_feature_combinations import (
    COMBINATION_IDS,
    COMBINATIONS,
    FEATURES,
    PROMPTS,
    REQUEST,
    _config,
)

SPEC = SpeculationSettings(block_size=4)
# the features the flashloop backend declares (KV quantization under fixed_prompt)
VERIFIED = {"token_sparse_prefill", "sparse_decode_attention", "kv_residual_quantization"}
SUPPORTED = [
    (flags, name)
    for flags, name in zip(COMBINATIONS, COMBINATION_IDS, strict=True)
    if {f for f, on in flags.items() if on} <= VERIFIED
]
GREEDY = SamplingParams(max_new_tokens=14, ignore_eos=True)


def _engine(model, config, num_blocks=240, **kwargs):
    backend = Registry.discover().create("flashloop", REQUEST, config)
    return Engine(model, backend, num_blocks=num_blocks, block_size=4, prefill_chunk=16, **kwargs)


@pytest.mark.parametrize("draft_depth", [1, 2])
@pytest.mark.parametrize("flags", [f for f, _ in SUPPORTED], ids=[n for _, n in SUPPORTED])
def test_speculation_outputs_the_greedy_tokens(flags, draft_depth):
    model, config = tiny_model(seed=7), _config(flags)
    plain = _engine(model, config).generate(PROMPTS, GREEDY)
    settings = SpeculationSettings(block_size=4, draft_depth=draft_depth)
    engine = _engine(model, config, speculation=settings, max_batch_tokens=24)
    speculative = engine.generate(PROMPTS, GREEDY)
    assert [r.output_token_ids for r in speculative] == [r.output_token_ids for r in plain]
    assert [r.exit_depths for r in speculative] == [r.exit_depths for r in plain]
    counts = engine.counters()
    states = engine.backend.states
    if states is not None:  # sparse decode: every verified row read its own row's reference
        assert int(states.missing_reference) == 0 and int(states.sources_written) > 0
    assert counts["speculation_blocks"] > len(PROMPTS)
    assert 0 < counts["speculation_accepted"] < counts["speculation_drafted"]
    assert (
        counts["acceptance_rate"] == counts["speculation_accepted"] / counts["speculation_drafted"]
    )
    assert engine.pools()["free_blocks"] == engine.pools()["num_blocks"]


@pytest.mark.parametrize("draft_depth", [1, 2])
@pytest.mark.parametrize("flags", [{}, dict.fromkeys(VERIFIED, True)], ids=["dense", "all_on"])
def test_draft_and_verification_rows_run_on_the_graph_buffers(flags, draft_depth):
    model, config = tiny_model(seed=7), _config(flags)
    plain = _engine(model, config).generate(PROMPTS[:2], GREEDY)
    graphs = GraphSettings(buckets=(1, 2, 4, 8), max_context=128, capture=False)
    settings = SpeculationSettings(block_size=4, draft_depth=draft_depth)
    engine = _engine(model, config, speculation=settings, cuda_graphs=graphs)
    served = []
    run = engine.graphs.run

    def recording(groups, hidden):
        out = run(groups, hidden)
        served.append((tuple(g.mode for g in groups), out is not None))
        return out

    engine.graphs.run = recording
    speculative = engine.generate(PROMPTS[:2], GREEDY)
    assert [r.output_token_ids for r in speculative] == [r.output_token_ids for r in plain]
    # every step of generated rows ran on the graph buffers, verification steps included
    assert all(ok for _, ok in served) and not engine.graphs.fallbacks
    assert any(RowMode.VERIFY in modes for modes, _ in served)
    assert any(RowMode.DECODE in modes for modes, _ in served)
    # a graph's view allows the block's verification group where the bucket holds it
    assert [engine.graphs._view(b, frozenset({1})).verify_rows for b in (1, 2, 4, 8)] == [
        1,
        2,
        4,
        4,
    ]
    if engine.backend.states is not None:
        assert int(engine.backend.states.missing_reference) == 0


def test_a_verification_block_wider_than_the_largest_bucket_runs_eagerly_and_says_why():
    model, config = tiny_model(seed=7), _config({})
    plain = _engine(model, config).generate(PROMPTS[:1], GREEDY)
    graphs = GraphSettings(buckets=(1, 2), max_context=128, capture=False)
    engine = _engine(model, config, speculation=SPEC, cuda_graphs=graphs)
    speculative = engine.generate(PROMPTS[:1], GREEDY)
    assert [r.output_token_ids for r in speculative] == [r.output_token_ids for r in plain]
    assert engine.graphs.fallbacks["4 decode rows exceed the largest bucket 2"] > 0


def test_a_feature_declared_not_to_verify_is_refused_by_name(monkeypatch):
    """The declaration is data: a feature marked as not verifying speculative rows makes
    the engine refuse at configuration time, naming it and the features that do."""
    from flashloop_backend.backends import flashloop_support as flashloop

    declared = dict(flashloop.SPECULATION_SUPPORT, sparse_decode_attention=False)
    monkeypatch.setattr(flashloop, "SPECULATION_SUPPORT", declared)
    flags = dict.fromkeys(VERIFIED, True)
    with pytest.raises(ValueError, match="speculative decoding is not supported") as info:
        _engine(tiny_model(), _config(flags), speculation=SPEC)
    message = str(info.value)
    assert "feature 'sparse_decode_attention' does not verify speculative rows" in message
    assert "(features that do: ['kv_residual_quantization', 'token_sparse_prefill'])" in message


ROLLING = {"enabled": True, "policy": "rolling", "group_size": 16, "tail_size": 16}


@pytest.mark.parametrize("draft_depth", [1, 2])
@pytest.mark.parametrize("others", [(), ("token_sparse_prefill", "sparse_decode_attention")])
def test_rolling_kv_quantization_speculates_serial_aligned(others, draft_depth):
    """``rolling`` packs a group of generated rows once enough are final, and packing is
    lossy. Serial-aligned blocks end before the next flush, so every row reads what serial
    decoding shows it: the greedy tokens across many flushes. ``block_boundary`` runs
    blocks across flushes (execution-dependent) and completes."""
    model = tiny_model(seed=7)
    flags = dict.fromkeys(others, True)
    config = FlashLoopConfig(**{n: FEATURES[n] for n in flags}, kv_residual_quantization=ROLLING)
    long = SamplingParams(max_new_tokens=60, ignore_eos=True)
    plain = _engine(model, config, num_blocks=400).generate(PROMPTS, long)
    aligned = SpeculationSettings(block_size=4, draft_depth=draft_depth)
    engine = _engine(model, config, num_blocks=400, speculation=aligned)
    ids = [engine.add_request(prompt, long) for prompt in PROMPTS]
    done, cut = {}, 0
    while engine.has_unfinished():
        done.update({r.request_id: r for r in engine.step()})
        for r in engine._requests.values():  # blocks fitted this step: none spans a flush
            block = r.block
            if block is not None and len(block.tokens) == 1 and r.depth == 1:
                final = engine._request_kv(r).final_rows
                limit = engine.backend.speculation_rows(r.id, final)
                assert 1 <= block.rows <= limit
                cut += block.rows < min(4, long.max_new_tokens - len(r.output))
    assert [done[i].output_token_ids for i in ids] == [r.output_token_ids for r in plain]
    assert cut > 0  # some blocks ended early at a flush
    across = SpeculationSettings(block_size=4, draft_depth=draft_depth, rolling="block_boundary")
    engine = _engine(model, config, num_blocks=400, speculation=across)
    assert all(len(r.output_token_ids) == 60 for r in engine.generate(PROMPTS, long))
    assert engine.pools()["free_blocks"] == engine.pools()["num_blocks"]


def test_a_model_that_exits_early_and_unsupported_requests_are_refused():
    early = tiny_model(early_exit_threshold=0.5)
    with pytest.raises(ValueError, match=r"exits early \(early_exit_threshold=0.5\)"):
        _engine(early, _config({}), speculation=SPEC)
    with pytest.raises(
        ValueError, match="max_batch_tokens=3 is below the speculation block_size=4"
    ):
        _engine(tiny_model(), _config({}), speculation=SPEC, max_batch_tokens=3)
    engine = _engine(tiny_model(), _config({}), speculation=SPEC)
    cases = [
        ({"forced": [1, 2]}, "['forced']"),
        ({"keep_logprobs": True}, "['keep_logprobs']"),
    ]
    for kwargs, named in cases:
        with pytest.raises(ValueError, match="outputs tokens by the block") as info:
            engine.add_request(PROMPTS[0], **kwargs)
        assert named in str(info.value)
    with pytest.raises(ValueError, match="greater than or equal to 2"):
        SpeculationSettings(block_size=1)
    with pytest.raises(ValueError, match=r"draft_depth=3 is not built \(supported: \[1, 2\]\)"):
        SpeculationSettings(draft_depth=3)
    for confidence, bound in ((1.0, "less than 1"), (-0.1, "greater than or equal to 0")):
        with pytest.raises(ValueError, match=f"draft_confidence\n.*{bound}"):
            SpeculationSettings(draft_confidence=confidence)


class _Lookup:
    """A model whose coda predicts the token written in a state's first entry, with
    logit 1 + the state's second entry (0: probability e / (e + 49) = 0.053)."""

    def coda(self, hidden):
        return torch.nn.functional.one_hot(hidden[:, 0].long(), 50).float() * (1 + hidden[:, 1:2])

    def prelude(self, ids):
        return torch.zeros(len(ids), 4)


def _state(token: int, sure: bool = False) -> torch.Tensor:
    """A draft state: ``sure`` makes the token's probability 0.998 (logit 11)."""
    return torch.tensor([[float(token), 10.0 if sure else 0.0, 0, 0]])


def _request():
    return dataclasses.make_dataclass("R", ["block", "depth", "hidden", "params", "id"])(
        None, 0, None, SamplingParams(), 0
    )


@pytest.mark.parametrize("rejected_at", [0, 1, 2, 3, None])
def test_acceptance_stops_at_the_first_rejected_draft(rejected_at):
    """Drafts 11, 12, 13, 14; the verifier agrees up to ``rejected_at`` and says 40 there.
    The block outputs the agreed drafts, then the verifier's token (all four when none is
    rejected)."""
    spec = Speculation(SpeculationSettings(block_size=4), _Lookup(), loops=4)
    r = _request()
    r.block = Block(start=10, rows=4, tokens=[5], slots=(0, 1, 2, 3), incarnations=(1, 2, 3, 4))
    for draft in (11, 12, 13, 14):  # each row: loop 1, then loop 2 drafts the next token
        assert spec.advance(r, _state(0)) is None
        assert spec.advance(r, _state(draft)) is None
    assert r.block.tokens == [5, 11, 12, 13] and r.block.last_draft == 14
    verified = [11, 12, 13, 14]
    if rejected_at is not None:
        verified[rejected_at] = 40
    assert spec.advance(r, torch.zeros(4, 4)) is None  # loop 3
    out = spec.advance(r, torch.cat([_state(t) for t in verified]))  # loop 4
    accepted = 4 if rejected_at is None else rejected_at
    assert out == verified[: accepted + (rejected_at is not None)]
    assert (spec.accepted, spec.drafted, spec.blocks) == (accepted, 4, 1)


@pytest.mark.parametrize("unsure_at", [0, 1, 2, 3, None])
def test_an_unsure_draft_ends_its_blocks_drafting(unsure_at):
    """Drafts 11, 12, 13, 14 at depth 1 with draft confidence 0.5: the first draft below
    it (probability 0.053 against 0.998) is the block's last, so the block verifies the
    rows drafted so far, in their own slots; an unsure last draft changes nothing."""
    spec = Speculation(
        SpeculationSettings(block_size=4, draft_depth=1, draft_confidence=0.5), _Lookup(), loops=4
    )
    r = _request()
    r.block = Block(start=10, rows=4, tokens=[5], slots=(0, 1, 2, 3), incarnations=(1, 2, 3, 4))
    drafts = iter((11, 12, 13, 14))
    while not r.block.verifying:
        draft = next(drafts)
        assert spec.advance(r, _state(draft, sure=draft - 11 != unsure_at)) is None
    rows = 4 if unsure_at is None else unsure_at + 1
    assert r.block.tokens == [5, 11, 12, 13][:rows] and r.block.last_draft == 11 + rows - 1
    assert (r.block.rows, r.block.slots, r.block.incarnations) == (
        rows,
        (0, 1, 2, 3)[:rows],
        (1, 2, 3, 4)[:rows],
    )
    assert r.depth == 1 and r.hidden.shape == (rows, 4)
    group = spec.group(r)
    assert group.mode == RowMode.VERIFY and (group.count, group.row_slots) == (
        rows,
        (0, 1, 2, 3)[:rows],
    )
    verified = [11, 12, 13, 14][:rows]
    for _ in (2, 3):
        assert spec.advance(r, torch.zeros(rows, 4)) is None  # loops 2 and 3
    out = spec.advance(r, torch.cat([_state(t) for t in verified]))  # loop 4
    assert out == verified
    stopped = int(unsure_at is not None and unsure_at < 3)
    assert spec.counters()["speculation_stopped"] == stopped
    assert (spec.accepted, spec.drafted, spec.blocks) == (rows, rows, 1)


@pytest.mark.parametrize("flags", [{}, dict.fromkeys(VERIFIED, True)], ids=["dense", "all_on"])
def test_draft_confidence_keeps_the_greedy_tokens_and_stops_blocks(flags):
    """Blocks of every length 1 .. K (so verification groups of each size) and the greedy
    tokens of plain decoding, on the graph buffers; more blocks, fewer rows drafted."""
    model, config = tiny_model(seed=7), _config(flags)
    plain = _engine(model, config).generate(PROMPTS[:2], GREEDY)
    graphs = GraphSettings(buckets=(1, 2, 4, 8), max_context=128, capture=False)
    counts = {}
    for confidence in (0.0, 0.3):
        settings = SpeculationSettings(block_size=4, draft_depth=1, draft_confidence=confidence)
        engine = _engine(model, config, speculation=settings, cuda_graphs=graphs)
        sizes = []

        def group(r, sizes=sizes, group=engine.speculation.group):
            if r.block.verifying:
                sizes.append(r.block.rows)
            return group(r)

        engine.speculation.group = group
        out = engine.generate(PROMPTS[:2], GREEDY)
        assert [r.output_token_ids for r in out] == [r.output_token_ids for r in plain]
        assert not engine.graphs.fallbacks
        counts[confidence] = engine.counters()
    assert set(sizes) == {1, 2, 3, 4}
    assert counts[0.0]["speculation_stopped"] == 0 < counts[0.3]["speculation_stopped"]
    assert counts[0.3]["speculation_rows"] < counts[0.0]["speculation_rows"]


def test_a_block_never_outputs_past_max_new_tokens_or_eos():
    model, config = tiny_model(seed=3), _config({})
    short = SamplingParams(max_new_tokens=6, ignore_eos=True)
    plain = _engine(model, config).generate(PROMPTS, short)
    speculative = _engine(model, config, speculation=SPEC).generate(PROMPTS, short)
    assert [r.output_token_ids for r in speculative] == [r.output_token_ids for r in plain]
    tokens = plain[1].output_token_ids
    eos = next(t for i, t in enumerate(tokens) if i >= 2 and t not in tokens[:i])
    model.config = dataclasses.replace(model.config, eos_token_id=eos)
    until_eos = SamplingParams(max_new_tokens=6)
    plain = _engine(model, config).generate([PROMPTS[1]], until_eos)[0]
    spec = _engine(model, config, speculation=SPEC).generate([PROMPTS[1]], until_eos)[0]
    assert spec.output_token_ids == plain.output_token_ids and spec.output_token_ids[-1] == eos
    assert spec.finish_reason == plain.finish_reason == "eos"


@pytest.mark.parametrize("features", [(), tuple(sorted(VERIFIED))], ids=["dense", "all_on"])
def test_preemption_and_cancellation_mid_block(features):
    model, config = tiny_model(seed=7), _config(dict.fromkeys(features, True))
    whole = _engine(model, config).generate([PROMPTS[1]], GREEDY)[0]
    engine = _engine(model, config, speculation=SPEC)
    baseline = engine.pools()
    rid = engine.add_request(PROMPTS[1], GREEDY)
    while engine.output_count(rid) < 3 or not engine._requests[rid].block.verifying:
        engine.step()
    assert not engine.at_token_boundary(rid)
    engine.preempt(rid)
    done = {}
    while engine.has_unfinished():
        done.update({r.request_id: r for r in engine.step()})
    assert done[rid].output_token_ids == whole.output_token_ids
    cancelled = engine.add_request(PROMPTS[0], GREEDY)
    while engine.output_count(cancelled) < 2:
        engine.step()
    engine.cancel(cancelled)
    assert engine.pools() == baseline


def test_a_request_saved_at_a_block_start_continues_speculating_after_restore(tmp_path):
    from flashloop_backend.host.snapshot import load_snapshot, save_snapshot

    model, config = tiny_model(seed=7), _config({})
    whole = _engine(model, config).generate([PROMPTS[1]], GREEDY)[0]
    engine = _engine(model, config, speculation=SPEC)
    rid = engine.add_request(PROMPTS[1], GREEDY)
    while engine.output_count(rid) < 4 or not engine.at_token_boundary(rid):
        engine.step()
    save_snapshot(engine.snapshot(rid), tmp_path / "r.safetensors")
    fresh = _engine(model, config, speculation=SPEC)
    restored = fresh.restore(load_snapshot(tmp_path / "r.safetensors"))
    done = {}
    while fresh.has_unfinished():
        done.update({r.request_id: r for r in fresh.step()})
    assert done[restored].output_token_ids == whole.output_token_ids
    assert fresh.counters()["speculation_blocks"] > 0


def _generate(capsys, *extra):
    import json

    from flashloop_backend.cli.main import main

    argv = ["generate", "--prompt", "def merge(a, b):", "--max-new-tokens", "24", "--json"]
    try:
        code = main([*argv, *extra])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else None), err


def test_generate_speculate_outputs_the_tokens_of_plain_greedy(capsys):
    _, plain, _ = _generate(capsys)
    code, speculative, _ = _generate(capsys, "--speculate", "4")
    assert code == 0 and speculative["output_token_ids"] == plain["output_token_ids"]
    counts = speculative["speculation"]
    assert counts["blocks"] >= 24 // 4 and counts["drafted"] >= counts["accepted"] > 0
    assert speculative["acceptance_rate"] == counts["accepted"] / counts["drafted"]
    assert "acceptance_rate" not in plain


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--speculate", "1"], "1 must be an integer >= 2"),
        (
            ["--speculate", "3", "--draft-depth", "3"],
            "draft_depth=3 is not built (supported: [1, 2])",
        ),
        (["--draft-confidence", "1.5"], "draft_confidence=1.5: Input should be less than 1"),
    ],
)
def test_generate_speculate_refuses_what_it_does_not_support(capsys, extra, fragment):
    args = extra if "--speculate" in extra else ["--speculate", "4", *extra]
    code, _, err = _generate(capsys, *args)
    assert code == 2 and fragment in err and "Traceback" not in err


def test_draft_confidence_without_speculation_is_refused(capsys):
    code, _, err = _generate(capsys, "--draft-confidence", "0.5")
    assert code == 2 and "--draft-confidence applies with --speculate K" in err


def test_the_rejection_rule_outputs_the_target_distribution():
    """One-draft blocks with draft distribution q and target p: whatever q is, the output
    token follows p (20,000 blocks; each frequency within 0.015 of p)."""
    from flashloop_backend.host.speculation import accept_sampled

    p = torch.tensor([0.5, 0.3, 0.2, 0.0])
    q = torch.tensor([0.1, 0.6, 0.1, 0.2])
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(4)
    for _ in range(20_000):
        draft = int(torch.multinomial(q, 1, generator=generator))
        (token,) = accept_sampled([draft], q[None], p[None], generator)
        counts[token] += 1
    assert torch.allclose(counts / counts.sum(), p, atol=0.015)
    # a draft the target agrees with completely is always kept, and the block goes on
    assert accept_sampled([2, 1], torch.eye(4)[[2, 1]], torch.eye(4)[[2, 1]], generator) == [2, 1]


def test_seeded_sampling_speculates_reproducibly_and_near_zero_temperature_is_greedy():
    model, config = tiny_model(seed=7), _config({})
    seeded = SamplingParams(max_new_tokens=14, ignore_eos=True, temperature=0.9, seed=5)
    runs = [
        _engine(model, config, speculation=SPEC).generate([PROMPTS[1]], seeded)[0] for _ in range(2)
    ]
    assert runs[0].output_token_ids == runs[1].output_token_ids
    assert len(runs[0].output_token_ids) == 14
    cold = SamplingParams(max_new_tokens=14, ignore_eos=True, temperature=1e-4, seed=5)
    greedy = _engine(model, config).generate(PROMPTS, GREEDY)
    sampled = _engine(model, config, speculation=SPEC).generate(PROMPTS, cold)
    assert [r.output_token_ids for r in sampled] == [r.output_token_ids for r in greedy]


def test_slot_shortages_are_refused_by_count(tmp_path):
    """A speculating request holds one token-state slot per block row: an engine with
    fewer slots than a block's rows is refused, and a restore that finds too few free
    slots is refused naming how many it needs, holding nothing."""
    from flashloop_backend.host.kvcache import OutOfBlocksError
    from flashloop_backend.host.snapshot import load_snapshot, save_snapshot

    model, config = tiny_model(seed=7), _config({})
    with pytest.raises(ValueError, match="max_slots=3 is below the 4 token-state slots"):
        _engine(model, config, speculation=SPEC, max_slots=3)
    saving = _engine(model, config, speculation=SPEC)
    rid = saving.add_request(PROMPTS[1], GREEDY)
    while saving.output_count(rid) < 2 or not saving.at_token_boundary(rid):
        saving.step()
    save_snapshot(saving.snapshot(rid), tmp_path / "r.safetensors")
    busy = _engine(model, config, speculation=SPEC, max_slots=6)
    busy.add_request(PROMPTS[0], GREEDY)
    busy.step()  # admitted: 4 of its 6 slots are taken
    before = busy.pools()
    with pytest.raises(OutOfBlocksError, match="4 token-state slots are needed and 2 are free"):
        busy.restore(load_snapshot(tmp_path / "r.safetensors"))
    assert busy.pools() == before
