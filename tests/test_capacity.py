"""Pools sized to a KV memory budget (``host/capacity.py``, ``Engine(kv_memory_bytes=...)``):
what one request costs dense and packed, the most requests a budget holds, and an engine
under one budget that runs more requests at once when it packs, holds no more than the
budget, and returns every block, page and slot after a random admit / cancel / finish load."""

import random

import pytest
import torch

from flashloop_backend import FlashLoopConfig
from flashloop_backend.backends.base import EngineCapacity
from flashloop_backend.capabilities import SupportRequest
from flashloop_backend.host import Engine, SamplingParams
from flashloop_backend.host.capacity import Footprint, footprint, plan_pools
from flashloop_backend.registry import Registry

from .host_helpers import tiny_model
from .test_feature_combinations import COMBINATION_IDS, COMBINATIONS

REQUEST = SupportRequest(head_dim=16, block_size=4, num_q_heads=4, num_kv_heads=2)
QUANT = {"enabled": True, "group_size": 16}
CONFIGS = {
    "dense": FlashLoopConfig(),
    "kv_quant": FlashLoopConfig(kv_residual_quantization=QUANT),
    "all_on": FlashLoopConfig(
        kv_residual_quantization=QUANT,
        sparse_decode_attention={"enabled": True, "key_retention": 0.25},
        token_sparse_prefill={"enabled": True, "window_size": 16, "retention": [1, 1, 1, 0.5]},
    ),
}
SHAPE = EngineCapacity(
    max_slots=1,
    max_context=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=16,
    loops=4,
    num_blocks=0,
    block_size=4,
    device=torch.device("cpu"),
)


def _backend(name: str):
    return Registry.discover().create("flashloop", REQUEST, CONFIGS[name])


def test_a_dense_request_holds_its_bf16_blocks_from_admission_to_the_end():
    cost = footprint(_backend("dense"), SHAPE, 70, 10, dtype_bytes=4)
    block = 4 * 2 * 2 * 16 * 2 * 4  # tokens x layers x KV heads x dims x (K, V) x bytes
    assert (cost.prefill_blocks, cost.decode_blocks, cost.block_bytes) == (80, 80, block)
    assert cost.prefill_bytes == cost.decode_bytes == 80 * block
    assert (cost.packed_pages, cost.slot_bytes) == (0, 0)


def test_a_packed_request_keeps_its_pages_and_the_rows_past_its_last_group():
    cost = footprint(_backend("kv_quant"), SHAPE, 70, 10, dtype_bytes=4)
    # 64 prompt rows pack (4 groups of 16): 16 of each plane's 20 blocks leave; carried
    # from plane to plane, they are held once while the prompt runs its loops
    assert (cost.prefill_blocks, cost.decode_blocks) == (20 + 3 * (20 - 16), 4 * (20 - 16))
    kept = footprint(_backend("kv_quant"), SHAPE, 70, 10, dtype_bytes=4, carry_planes=False)
    assert (kept.prefill_blocks, kept.decode_blocks) == (80, 4 * (20 - 16))
    assert cost.packed_pages == 4 * 4  # 4 levels x 4 groups
    assert cost.page_bytes == 2 * 2 * 16 * (16 + 8)  # layers x KV heads x v3 block bytes
    assert cost.decode_bytes < cost.prefill_bytes


def test_sparse_decode_counts_its_reference_slot():
    cost = footprint(_backend("all_on"), SHAPE, 70, 10, dtype_bytes=4)
    backend = _backend("all_on")
    backend.reserve_state(1, 2, 4, 16, backend.reader_span(128, 4), "cpu")
    per_slot = backend.states.nbytes() // 2  # one slot and the scratch slot
    assert cost.slot_bytes == per_slot


@pytest.mark.parametrize("prefill_requests", [1, 3])
def test_a_plan_fills_the_budget_with_requests_at_their_decode_cost(prefill_requests):
    request = Footprint(100, 10, 40, 8, 1000, 12, 300, 50)
    budget = 1_000_000
    plan = plan_pools(budget, request, prefill_requests)
    held = prefill_requests * request.prefill_bytes + request.slot_bytes  # and the scratch
    held += (plan.requests - prefill_requests) * request.decode_bytes
    assert plan.used_bytes == held <= budget < held + request.decode_bytes
    assert plan.num_blocks == prefill_requests * 40 + (plan.requests - prefill_requests) * 8
    assert (plan.packed_pages, plan.max_slots) == (12 * plan.requests, plan.requests)


def test_a_speculating_request_plans_a_slot_per_block_row():
    request = Footprint(100, 10, 40, 8, 1000, 12, 300, 50)
    one, four = plan_pools(1_000_000, request), plan_pools(1_000_000, request, 1, 4)
    assert four.max_slots == 4 * four.requests and four.requests <= one.requests
    held = request.prefill_bytes + (four.requests - 1) * request.decode_bytes
    assert four.used_bytes == held + 3 * 50 * four.requests + 50 <= 1_000_000


def test_a_budget_below_one_request_is_refused_by_name():
    request = Footprint(100, 10, 40, 8, 1000, 12, 300, 50)
    with pytest.raises(ValueError, match="budget of 1000 bytes cannot hold one request of 100"):
        plan_pools(1000, request)
    with pytest.raises(ValueError, match="prefill_requests=0 and slots_per_request=1 must be"):
        plan_pools(10**6, request, 0)


def _engine(name: str, budget: int, **extra) -> Engine:
    model = tiny_model(max_position_embeddings=128)
    return Engine(
        model,
        _backend(name),
        block_size=4,
        prefill_chunk=128,
        max_context=128,
        kv_memory_bytes=budget,
        planned_request=(80, 16),
        **extra,
    )


def test_the_engine_refuses_a_budget_beside_explicit_pools():
    with pytest.raises(ValueError, match="give it or num_blocks, max_slots, not both"):
        _engine("dense", 10**6, num_blocks=64, max_slots=4)
    with pytest.raises(ValueError, match=r"planned_request=\(120, 16\) needs a prompt"):
        Engine(tiny_model(max_position_embeddings=128), _backend("dense"), block_size=4,
               max_context=128, kv_memory_bytes=10**6, planned_request=(120, 16))  # fmt: skip


def _run(engine: Engine, prompts: int) -> int:
    """The most requests held at once (admitted, not done) while ``prompts`` requests of
    80 + 16 run; the engine's pools never hold more than its plan's bytes."""
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    for i in range(prompts):
        engine.add_request([(7 * i + 3 * t) % 61 for t in range(80)], params)
    most = 0
    while engine.has_unfinished():
        engine.step()
        held = [r for r in engine._requests.values() if r.phase in ("prefill", "decode")]
        most = max(most, len(held))
    return most


def _pool_bytes(engine: Engine) -> int:
    block = engine.kv.bytes_per_token() * engine.kv.block_size // engine.cfg.total_ut_steps
    return engine.kv.num_blocks * block + sum(engine.backend.memory().values())


def test_one_budget_decodes_more_requests_at_once_when_the_backend_packs():
    dense = _engine("dense", 1_200_000)
    packed = _engine("all_on", 1_200_000)
    for engine in (dense, packed):
        assert _pool_bytes(engine) == engine.capacity_plan.used_bytes <= 1_200_000
    assert packed.capacity_plan.requests >= 2 * dense.capacity_plan.requests
    assert _run(dense, 18) <= dense.capacity_plan.requests
    assert _run(packed, 18) >= 2 * dense.capacity_plan.requests


@pytest.mark.parametrize("flags", COMBINATIONS, ids=COMBINATION_IDS)
def test_every_combination_under_a_budget_keeps_its_accounting_under_a_random_load(flags):
    """Each feature combination on pools planned from one budget, under random arrivals,
    cancellations, preemptions and steps: the plan fits the budget and the KV held never
    exceeds it; packed pages in use and reserved never exceed the pool; requests beyond
    what the pools hold wait; when all have left, every block, slot and page is back."""
    from .test_feature_combinations import FEATURES

    config = FlashLoopConfig(**{name: FEATURES[name] for name, on in flags.items() if on})
    model = tiny_model(max_position_embeddings=128)
    backend = Registry.discover().create("flashloop", REQUEST, config)
    budget = 500_000
    engine = Engine(model, backend, block_size=4, prefill_chunk=32, max_context=128,
                    kv_memory_bytes=budget, planned_request=(80, 16))  # fmt: skip
    assert _pool_bytes(engine) == engine.capacity_plan.used_bytes <= budget
    rng = random.Random(sum(flags.values()) * 7 + 1)
    free_blocks, free_slots = engine.kv.free_blocks, len(engine._free_slots)
    packed = engine.backend.packed
    waited = False
    for _ in range(80):
        action = rng.random()
        running = sorted(r.id for r in engine._requests.values() if r.phase != "waiting")
        if action < 0.35:
            length = rng.randint(8, 100)
            params = SamplingParams(max_new_tokens=rng.randint(1, 16), ignore_eos=True)
            engine.add_request([rng.randrange(61) for _ in range(length)], params)
        elif action < 0.42 and engine._requests:
            engine.cancel(rng.choice(sorted(engine._requests)))
        elif action < 0.5 and running:
            engine.preempt(rng.choice(running))
        elif engine.has_unfinished():
            engine.step()
        waited |= any(r.phase == "waiting" for r in engine._requests.values()) and bool(running)
        if packed is not None:
            report = packed.store.accounting()
            assert report["pages_used"] + report["pages_reserved"] <= report["pages_total"]
        assert engine.kv_held()[1] <= engine.capacity_plan.used_bytes
    while engine.has_unfinished():
        engine.step()
    assert waited  # the load asked for more than the budget holds at once
    assert (engine.kv.free_blocks, len(engine._free_slots)) == (free_blocks, free_slots)
    if packed is not None:
        report = packed.store.accounting()
        assert report["pages_used"] == report["pages_reserved"] == 0


def test_bench_capacity_holds_more_requests_at_once_on_one_budget():
    """``bench capacity``'s loop on a tiny model: every client's request is submitted at
    once, each variant's engine admits what its plan holds, every request completes."""
    from flashloop_backend.tools.bench.capacity import capacity_variants, serve_at_budget

    variants = capacity_variants(CONFIGS["all_on"], "flashloop")
    assert [v.name for v in variants] == ["dense", "kv_residual_quantization alone", "config"]
    model = tiny_model(max_position_embeddings=128)
    records = serve_at_budget(
        model, REQUEST, variants, 1_200_000, 80, 16, 18, block_size=4, log=lambda _: None,
        warm=False,
    )  # fmt: skip
    held = {r["variant"]: r["most_requests_held"] for r in records}
    assert all(r["completed"] == 18 and r["failed_requests"] == 0 for r in records)
    assert held["dense"] <= records[0]["plan"]["requests"]
    assert held["config"] >= 2 * held["dense"]
    assert held["kv_residual_quantization alone"] >= 2 * held["dense"]
    assert records[0]["pools_filled"]  # dense holds its plan
    aligned = {r["variant"]: r["align_decode_depths"] for r in records}
    assert aligned == {"dense": False, "kv_residual_quantization alone": True, "config": True}
    assert all(r["graphs"] is None and r["steps"] > 0 for r in records)
    # an idle witness process ran beside each run and woke every few ms
    assert all(r["host_noise"]["wakeups"] > 0 for r in records)
    assert all(
        r["host_noise"]["late_ms"]["max"] >= r["host_noise"]["late_ms"]["p50"] for r in records
    )


def test_bench_capacity_runs_the_variants_named_and_refuses_others_by_name():
    """``--variants`` picks among dense, KV quantization alone and the config, in the
    bench's order; an unknown or empty name is refused by name with the allowed ones, and
    KV quantization alone where the config is that variant itself."""
    from flashloop_backend.config import ConfigError
    from flashloop_backend.tools.bench.capacity import capacity_variants

    picked = capacity_variants(CONFIGS["all_on"], "triton", ["config", "dense"])
    assert [(v.name, v.backend) for v in picked] == [("dense", "triton"), ("config", "flashloop")]
    for keys, named in ((["dense", "all_on"], "'all_on'"), (["dense", ""], "''")):
        with pytest.raises(ConfigError, match=f"names {named}: .* dense, kv_residual_q"):
            capacity_variants(CONFIGS["all_on"], "triton", keys)
    alone = FlashLoopConfig(kv_residual_quantization={"enabled": True})
    with pytest.raises(ConfigError, match="is KV quantization alone; name config instead"):
        capacity_variants(alone, "triton", ["kv_residual_quantization"])


def test_bench_capacity_says_when_requests_end_before_the_pools_fill():
    """One new token a request: each finishes in the step after its prompt, so the run
    holds fewer than the plan, and the record and the log say so."""
    from flashloop_backend.tools.bench.capacity import capacity_variants, serve_at_budget

    config = capacity_variants(CONFIGS["all_on"], "flashloop")[-1]
    lines = []
    records = serve_at_budget(
        tiny_model(max_position_embeddings=128), REQUEST, [config], 1_200_000, 80, 1, 12,
        block_size=4, log=lines.append, warm=False,
    )  # fmt: skip
    (record,) = records
    assert record["completed"] == 12
    assert record["most_requests_held"] < record["plan"]["requests"]
    assert not record["pools_filled"]
    assert "requests ended before the pools filled" in lines[-1]


def test_bench_capacity_waits_for_the_device_after_a_step_only_when_asked():
    """The timed loop calls ``step_sync`` once after every step it times and ``sync``
    (the warm-up's barrier) never: by default no device wait sits between two steps, so
    the host plans a step while the device runs the one before."""
    from flashloop_backend.tools.bench.capacity import capacity_variants, serve_at_budget

    config = capacity_variants(CONFIGS["all_on"], "flashloop")[-1]
    calls = {"sync": 0, "step_sync": 0}

    def counter(name):
        return lambda: calls.__setitem__(name, calls[name] + 1)

    (record,) = serve_at_budget(
        tiny_model(max_position_embeddings=128), REQUEST, [config], 1_200_000, 80, 4, 3,
        block_size=4, log=lambda _: None, warm=False, sync=counter("sync"),
        step_sync=counter("step_sync"),
    )  # fmt: skip
    assert record["completed"] == 3
    assert calls == {"sync": 0, "step_sync": record["steps"]}


def test_bench_capacity_calls_a_step_wrapper_for_every_timed_step_and_removes_it():
    """``wrap_step`` (the diagnostic scripts' hook) wraps each timed step, not the
    warm-up's, and the engine's own ``step`` is back afterwards."""
    from flashloop_backend.tools.bench.capacity import capacity_variants, serve_at_budget

    config = capacity_variants(CONFIGS["all_on"], "flashloop")[-1]
    wrapped, engines = [], []

    def wrap(engine, step):
        engines.append(engine)

        def counted():
            wrapped.append(engine.steps)
            return step()

        return counted

    (record,) = serve_at_budget(
        tiny_model(max_position_embeddings=256), REQUEST, [config], 1_200_000, 80, 4, 3,
        block_size=4, log=lambda _: None, warm=True, wrap_step=wrap,
    )  # fmt: skip
    assert record["completed"] == 3 and len(engines) == 1
    assert len(wrapped) == record["steps"]  # every timed step, none of the warm-up's
    assert "step" not in vars(engines[0])  # the class's method again


def test_bench_capacity_records_the_start_up_it_warms():
    """With the warm-up (the engine's, then the workload's batch sizes), the record states
    the seconds it took; without it, None."""
    from flashloop_backend.tools.bench.capacity import capacity_variants, serve_at_budget

    config = capacity_variants(CONFIGS["all_on"], "flashloop")[-1]
    model = tiny_model(max_position_embeddings=256)
    runs = [
        serve_at_budget(model, REQUEST, [config], 2_400_000, 80, 4, 3, block_size=4,
                        log=lambda _: None, warm=warm)[0]
        for warm in (True, False)
    ]  # fmt: skip
    assert runs[0]["start_up_s"] > 0 and runs[1]["start_up_s"] is None
    assert all(r["completed"] == 3 for r in runs)


def test_bench_capacity_needs_kv_quantization():
    from flashloop_backend.config import ConfigError
    from flashloop_backend.tools.bench.capacity import capacity_variants

    with pytest.raises(ConfigError, match="must enable kv_residual_quantization"):
        capacity_variants(CONFIGS["dense"], "flashloop")


def test_warm_up_runs_every_batch_size_and_leaves_the_engine_as_it_found_it():
    engine = _engine("all_on", 1_200_000)
    free = (engine.kv.free_blocks, len(engine._free_slots))
    seconds = engine.warm_up(sizes=[1, 2])
    assert seconds > 0 and not engine.has_unfinished()
    assert (engine.kv.free_blocks, len(engine._free_slots)) == free
    engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=2))
    with pytest.raises(RuntimeError, match="warm_up needs an idle engine"):
        engine.warm_up()


def test_bench_capacity_refuses_new_tokens_beyond_a_context_before_any_gpu_work():
    from flashloop_backend.config import ConfigError
    from flashloop_backend.tools.bench.capacity import bench_capacity

    with pytest.raises(ConfigError, match=r"--new-tokens 2048 must lie in \[1, context 1024\)"):
        bench_capacity(CONFIGS["all_on"], "triton", [4096, 1024], 2048, [64.0], 1)


def test_the_host_noise_witness_counts_late_wake_ups_and_refuses_bad_periods():
    import time

    from flashloop_backend.tools.bench.host_noise import HostNoise

    with HostNoise(period_ms=1.0, stall_ms=1000.0) as witness:
        time.sleep(0.3)
    noise = witness.summary
    assert noise["wakeups"] > 10 and noise["stalls_over_ms"] == 1000.0
    assert 0 <= noise["late_ms"]["p50"] <= noise["late_ms"]["p99"] <= noise["late_ms"]["max"]
    assert len(noise["worst"]) == 5 and noise["worst"][0]["late_ms"] == noise["late_ms"]["max"]
    assert all(0 <= w["at_s"] < 5 for w in noise["worst"]) and noise["started_unix_s"] > 0
    with pytest.raises(ValueError, match=r"period_ms=0 and stall_ms=5\.0 must both be positive"):
        HostNoise(period_ms=0)
    # a run that raises still stops its witness and keeps the witness's record
    with pytest.raises(RuntimeError, match="the run failed"), HostNoise() as failed:
        raise RuntimeError("the run failed")
    assert failed.summary is not None and failed._process.returncode == 0
