"""Request lifecycle in the host: cancelling a waiting or running request gives back every
BF16 block, packed page, reservation and token-state slot it held; a preempted request
gives them back too and, readmitted, recomputes and produces the same tokens; the others
run unchanged, and random admit / cancel / preempt / finish sequences keep the pools'
accounting consistent after every step, for every feature combination."""

import random

import pytest
import torch

from flashloop_backend import FlashLoopConfig
from flashloop_backend.capabilities import SupportRequest
from flashloop_backend.host import Engine, SamplingParams
from flashloop_backend.registry import Registry
from flashloop_backend.tools.grid import feature_combinations

from .host_helpers import tiny_model

REQUEST = SupportRequest(head_dim=16, block_size=4, num_q_heads=4, num_kv_heads=2)
ALL_ON = FlashLoopConfig(
    token_sparse_prefill={"enabled": True, "window_size": 16, "retention": [1, 1, 0.5, 0.25]},
    sparse_decode_attention={"enabled": True, "key_retention": 0.3},
    kv_residual_quantization={"enabled": True, "group_size": 16, "tail_size": 16},
)
ROLLING = ALL_ON.model_copy(
    update={
        "kv_residual_quantization": ALL_ON.kv_residual_quantization.model_copy(
            update={"policy": "rolling"}
        )
    }
)
# every combination (KV quantization packing completed prompts), and all on with the
# rolling policy (generated rows flushed group by group from the BF16 tail)
COMBINATIONS = [*feature_combinations(ALL_ON), (("all", "rolling"), ROLLING)]
NUM_BLOCKS = 160


def _engine(model, config, prefix_cache=False, num_blocks=NUM_BLOCKS):
    backend = Registry.discover().create("flashloop", REQUEST, config)
    return Engine(
        model,
        backend,
        num_blocks=num_blocks,
        block_size=4,
        prefill_chunk=16,
        max_slots=8,
        prefix_cache=prefix_cache,
    )


def _baseline(engine) -> dict[str, int]:
    """The pools of an engine no request holds anything of."""
    pools = engine.pools()
    return {k: (pools[k] if k in ("num_blocks", "max_slots") else 0) for k in pools} | {
        "free_blocks": pools["num_blocks"],
        "free_slots": pools["max_slots"],
    }


def _check(engine) -> None:
    """Invariants after any step or cancellation: blocks, slots and packed pages are held
    by live requests only, and nothing waits for a hand-over that left."""
    pools = engine.pools()
    live = engine._requests.values()
    assert pools["free_slots"] + sum(r.slot >= 0 for r in live) == pools["max_slots"]
    slots = [r.slot for r in live if r.slot >= 0]
    assert len(set(slots)) == len(slots)
    held = {  # a block shared by requests and the prefix cache counts once
        b
        for r in live
        if engine.kv.has(r.id)
        for plane in engine.kv._tables[r.id].planes
        for b in plane
        if b >= 0
    }
    if engine.prefix_cache is not None:
        held |= {b for e in engine.prefix_cache._entries for plane in e.blocks for b in plane}
    free = pools["free_blocks"] + pools["promised_blocks"]
    assert free + len(held) == pools["num_blocks"]
    assert not held & set(engine.kv._free)
    # blocks are promised only to prompts still to carry a plane forward
    assert set(engine.kv._promised) <= {r.id for r in live if r.phase == "prefill"}
    assert all(not engine.kv.has(r.id) for r in live if r.phase == "waiting")
    if "packed_sequences" in pools:
        store = engine.backend.packed.store
        assert set(store.sequences) <= {r.id for r in live}
        assert set(store._reserved) <= {r.id for r in live}
    assert all(r.id in engine._requests for r in engine._prompts_to_hand_over)


def test_a_preempted_request_recomputes_to_the_same_tokens_and_exit_depths():
    """With Ouro's exit rule (tokens leave at different depths) and every feature on:
    preempted mid-decode, twice, it ends with the tokens, exit depths and log-probs of an
    uninterrupted run; preempting a waiting request is refused by name."""
    model = tiny_model(seed=3, early_exit_threshold=0.5)
    prompt, params = [4, 8, 15, 16, 23, 42] * 6, SamplingParams(max_new_tokens=8)
    whole = _engine(model, ALL_ON).generate([prompt], params, keep_logprobs=True)[0]
    engine = _engine(model, ALL_ON)
    rid = engine.add_request(prompt, params, keep_logprobs=True)
    with pytest.raises(ValueError, match=f"request {rid} is waiting: it holds nothing"):
        engine.preempt(rid)
    for stop_after in (3, 5):
        while engine.output_count(rid) < stop_after:
            engine.step()
        engine.preempt(rid)
        assert engine.output_count(rid) == 0 and engine.pools()["free_slots"] == 8
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    (done,) = finished
    assert done.output_token_ids == whole.output_token_ids
    assert done.exit_depths == whole.exit_depths and len(set(whole.exit_depths)) > 1
    torch.testing.assert_close(done.logprobs, whole.logprobs, rtol=0, atol=0)


def test_cancel_names_the_live_requests_and_reports_what_was_produced():
    engine = _engine(tiny_model(seed=4), ALL_ON)
    first = engine.add_request([1, 2, 3] * 12, SamplingParams(max_new_tokens=4))
    with pytest.raises(
        KeyError, match=rf"request 7 is not waiting or running \(live: \[{first}\]\)"
    ):
        engine.cancel(7)
    while not engine.has_first_token(first):
        engine.step()
    result = engine.cancel(first)
    assert result.finish_reason == "cancelled" and len(result.output_token_ids) == 1
    assert engine.pools() == _baseline(engine)
    with pytest.raises(KeyError, match="request 0 is not waiting or running"):
        engine.cancel(first)  # it left: cancelling again names it


IDS = ["+".join(features) or "dense" for features, _ in COMBINATIONS]


@pytest.mark.parametrize(("features", "config"), COMBINATIONS, ids=IDS)
def test_random_admit_cancel_preempt_finish_keeps_the_pools_consistent(features, config):
    """Random arrivals, cancellations and preemptions (waiting, mid-prefill, mid-decode,
    just handed over, mid-recompute), steps in between: the invariants hold after each; the
    survivors' tokens (greedy and seeded sampling, some stopping at EOS, some long enough
    for the rolling policy to flush generated groups) equal those of running them alone;
    when all have left the pools are back at the baseline."""
    _fuzz(features, config, prefix_cache=False)


@pytest.mark.parametrize(
    ("features", "config"), [COMBINATIONS[0], *COMBINATIONS[-2:]], ids=["dense", "all", "rolling"]
)
def test_the_fuzz_with_shared_prompt_prefixes_and_the_prefix_cache_on(features, config):
    """The same with prompts grown from two stems, so later prompts share published
    prefixes (and cancelled or preempted sharers leave them to the cache): blocks held by
    requests and the cache together, each once; the cache cleared, the baseline."""
    _fuzz(features, config, prefix_cache=True)


def _fuzz(features, config, prefix_cache: bool) -> None:
    model = tiny_model(seed=5, eos_token_id=7)  # requests that heed EOS stop anywhere
    rng = random.Random(sum(map(ord, "+".join(features))) + 3 * prefix_cache)
    stem_rng = random.Random(len(features))  # the plain fuzz draws what it always drew
    stems = [[stem_rng.randrange(1, 61) for _ in range(48)] for _ in range(2)]
    engine = _engine(model, config, prefix_cache)
    baseline = _baseline(engine)
    prompts, survivors, preempted = {}, {}, set()
    for _ in range(60):
        action = rng.random()
        running = sorted(r.id for r in engine._requests.values() if r.phase != "waiting")
        if action < 0.25 and len(prompts) < 10:
            prompt = [rng.randrange(1, 61) for _ in range(rng.randrange(1, 45))]
            if prefix_cache:
                prompt = rng.choice(stems)[: rng.randrange(20, 49)] + prompt[:12]
            sampled = rng.random() < 0.5
            params = SamplingParams(
                max_new_tokens=rng.randrange(1, 7) + 18 * (rng.random() < 0.2),
                ignore_eos=rng.random() < 0.5,
                temperature=0.8 if sampled else 0.0,
                seed=rng.randrange(1000) if sampled else None,
            )
            prompts[engine.add_request(prompt, params)] = (prompt, params)
        elif action < 0.3 and engine._requests:
            engine.cancel(rng.choice(sorted(engine._requests)))
        elif action < 0.42 and running:
            preempted.add(rid := rng.choice(running))
            engine.preempt(rid)
        else:
            for result in engine.step() if engine.has_unfinished() else []:
                survivors[result.request_id] = result.output_token_ids
        _check(engine)
    while engine.has_unfinished():
        for result in engine.step():
            survivors[result.request_id] = result.output_token_ids
        _check(engine)
    if prefix_cache:
        assert engine.prefix_counters()["prefix_hits"] > 0
        engine.prefix_cache.clear()
    assert engine.pools() == baseline
    assert survivors and len(survivors) < len(prompts)  # some finished, some were cancelled
    assert preempted  # (the recompute itself is checked against a lone run below when one
    # of them finished, and always in the test above)
    checked = sorted(preempted & set(survivors)) + sorted(set(survivors) - preempted)
    for rid in checked[:4]:
        prompt, params = prompts[rid]
        alone = _engine(model, config).generate([prompt], params)[0]
        assert survivors[rid] == alone.output_token_ids, rid


@pytest.mark.parametrize("features", [(), ("all",)], ids=["dense", "all_on"])
def test_graph_replays_survive_cancel_and_preempt(features, monkeypatch):
    """Decode steps replayed from recorded graphs (the CPU recorder: replays read only the
    fixed buffers) while requests are cancelled, preempted and readmitted, and a newcomer
    takes a freed slot: the survivors' tokens equal eager lone runs, and the pools come
    back to the baseline."""
    from flashloop_backend.host.graphs import GraphSettings
    from flashloop_backend.kernels.torch_ref import packed as torch_packed

    from .graph_recorder import RecordingCapture
    from .test_decode_graphs import _every_row

    monkeypatch.setattr(torch_packed, "_only_rows", _every_row)
    model = tiny_model(seed=7)
    config = ALL_ON if features else FlashLoopConfig()
    backend = Registry.discover().create("flashloop", REQUEST, config)
    engine = Engine(
        model,
        backend,
        num_blocks=NUM_BLOCKS,
        block_size=4,
        prefill_chunk=16,
        max_slots=8,
        cuda_graphs=GraphSettings(buckets=(1, 2, 4), max_context=128),
        graph_capture=RecordingCapture(),
    )
    baseline = _baseline(engine)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompts = [[(7 * i + 3) % 61 for i in range(n)] for n in (9, 40, 33, 20)]
    ids = [engine.add_request(p, params) for p in prompts[:3]]
    finished = {}
    while any(engine.output_count(i) < 2 for i in ids):
        finished |= {r.request_id: r.output_token_ids for r in engine.step()}
    engine.cancel(ids[0])
    engine.preempt(ids[1])
    ids.append(engine.add_request(prompts[3], params))
    while engine.has_unfinished():
        finished |= {r.request_id: r.output_token_ids for r in engine.step()}
        _check(engine)
    assert engine.graphs.stats()["replays"] > 0
    assert engine.pools() == baseline
    for rid, prompt in zip(ids[1:], prompts[1:], strict=True):
        alone = _engine(model, config).generate([prompt], params)[0]
        assert finished[rid] == alone.output_token_ids, rid


def test_a_preempted_request_whose_tail_was_flushed_recomputes_the_same_tokens():
    """Rolling policy: generated rows already flushed from the BF16 tail into packed groups
    when the request is preempted; recomputed, it flushes them again and ends with the
    uninterrupted run's tokens; a request cancelled beside it leaves nothing behind."""
    model = tiny_model(seed=6)
    prompt, params = [(3 * i + 2) % 61 for i in range(37)], SamplingParams(max_new_tokens=30)
    whole = _engine(model, ROLLING).generate([prompt], params)[0]
    engine = _engine(model, ROLLING)
    baseline = _baseline(engine)
    rid = engine.add_request(prompt, params)
    other = engine.add_request(prompt[:20], params)
    store = engine.backend.packed.store
    while engine.output_count(rid) < 24:
        engine.step()
    assert store.sequences[rid].rows > 37 - 16  # generated rows went to packed groups
    engine.cancel(other)
    engine.preempt(rid)
    _check(engine)
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert finished[0].output_token_ids == whole.output_token_ids
    assert engine.pools() == baseline


def test_replayed_tokens_leave_at_their_recorded_depths():
    """The replay forces each earlier token's exit depth instead of asking the exit rule
    again (on a GPU the recomputed hazard could land on the other side of the threshold):
    recorded depths, even ones the rule would not choose, are the ones recomputed."""
    model = tiny_model(seed=3, early_exit_threshold=0.5)
    engine = _engine(model, ALL_ON)
    rid = engine.add_request([4, 8, 15, 16, 23, 42] * 6, SamplingParams(max_new_tokens=7))
    while engine.output_count(rid) < 5:
        engine.step()
    engine.preempt(rid)
    request = engine._requests[rid]
    assert request.replay_exits and set(request.replay_exits) != {3}
    request.replay_exits = [3] * len(request.replay_exits)  # as if each ran every loop
    finished = []
    while engine.has_unfinished():
        finished += engine.step()
    assert finished[0].exit_depths[: len(request.replay_exits)] == request.replay_exits


@pytest.mark.parametrize(("features", "config"), COMBINATIONS[-2:], ids=["all", "rolling"])
def test_a_stop_string_mid_block_ends_the_request_and_returns_everything(features, config):
    """A stop string met at a token that leaves its KV block part-filled (and, rolling,
    with generated rows in the BF16 tail and in packed groups): the request ends with
    the tokens of the uninterrupted run up to the stop, and the pools are back."""
    model = tiny_model(seed=3)
    prompt, long = [4, 8, 15, 16, 23, 42] * 7, SamplingParams(max_new_tokens=30)
    whole = _engine(model, config).generate([prompt], long)[0].output_token_ids
    at = next(i for i in range(21, 30) if (i + len(prompt)) % 4 != 3)  # not a block's last row
    stop = "|".join(map(str, whole[at - 1 : at + 1]))
    engine = _engine(model, config)
    engine.detokenize = lambda ids: "|".join(map(str, ids))
    baseline = _baseline(engine)
    params = SamplingParams(max_new_tokens=30, stop=(stop,))
    (done,) = engine.generate([prompt], params)
    assert done.finish_reason == "stop"
    met = next(i for i in range(len(whole)) if stop in engine.detokenize(whole[: i + 1]))
    assert done.output_token_ids == whole[: met + 1] and met <= at
    assert engine.pools() == baseline
