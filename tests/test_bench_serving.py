"""The serving benchmark's workload driver and summaries on the embedded model (CPU)."""

import json

import pytest
import torch

from flashloop_backend import FlashLoopConfig, embedded_model_path
from flashloop_backend.capabilities import SupportRequest
from flashloop_backend.host import Engine, load_model
from flashloop_backend.registry import Registry
from flashloop_backend.tools.bench.serving import pick_variants, serve_variants, variants_for
from flashloop_backend.tools.bench.workload import (
    Arrival,
    RequestTimes,
    fixed_arrival_schedule,
    run_workload,
    summarize,
)


@pytest.fixture(scope="module")
def model():
    return load_model(embedded_model_path())


def _request(model):
    cfg = model.config
    return SupportRequest("cpu", torch.float32, cfg.head_dim, 16, cfg.num_attention_heads,
                          cfg.num_key_value_heads)  # fmt: skip


def test_fixed_arrival_schedule_is_seeded_and_evenly_spaced():
    a = fixed_arrival_schedule(5, 2.0, [8, 16], [4], seed=3)
    assert [x.at_s for x in a] == [0.0, 0.5, 1.0, 1.5, 2.0]
    assert a == fixed_arrival_schedule(5, 2.0, [8, 16], [4], seed=3)
    assert {x.prompt_len for x in a} <= {8, 16} and {x.output_len for x in a} == {4}
    with pytest.raises(ValueError, match="rate_per_s=0"):
        fixed_arrival_schedule(5, 0.0, [8], [4])
    with pytest.raises(ValueError, match="positive lengths"):
        fixed_arrival_schedule(5, 1.0, [0], [4])


def test_summary_percentiles_from_hand_made_times():
    times = [
        RequestTimes(0.0, 8, [1.0, 1.5, 2.0], finished_s=2.0),
        RequestTimes(1.0, 8, [4.0, 4.2], finished_s=4.2),
        RequestTimes(2.0, 8, error="MemoryError: no room"),
    ]
    s = summarize(times, wall_s=5.0)
    assert (
        s["completed"] == 2
        and s["failed_requests"] == 1
        and s["errors"] == ["MemoryError: no room"]
    )
    assert s["ttft_s"]["p50"] == pytest.approx(2.0)  # TTFTs 1.0 and 3.0
    assert s["tpot_ms"]["p50"] == pytest.approx(350.0)  # 500 and 200 ms
    assert s["itl_ms"]["p99"] == pytest.approx(500.0)
    assert s["output_tokens"] == 5 and s["throughput_tokens_s"] == pytest.approx(1.0)


@pytest.mark.parametrize("concurrency", [None, 2])
def test_workloads_complete_every_request_with_one_time_per_token(model, concurrency):
    backend = Registry.discover().create("torch", _request(model), FlashLoopConfig())
    engine = Engine(model, backend, num_blocks=256, block_size=16)
    arrivals = fixed_arrival_schedule(4, 50.0, [12, 30], [3, 5], seed=1)
    s = run_workload(engine, arrivals, model.config.vocab_size, concurrency=concurrency)
    assert s["completed"] == 4 and s["failed_requests"] == 0
    assert s["output_tokens"] == sum(a.output_len for a in arrivals)
    assert s["ttft_s"]["p50"] > 0 and s["latency_s"]["p99"] >= s["ttft_s"]["p99"]
    held = s["kv_held"]  # the largest KV the live requests held after a step
    per_token = engine.kv.bytes_per_token()
    assert 0 < held["tokens_at_peak"] <= sum(a.prompt_len + a.output_len for a in arrivals)
    assert held["peak_bytes"] >= held["tokens_at_peak"] * per_token  # whole blocks held
    assert held["bytes_per_token_at_peak"] == held["peak_bytes"] / held["tokens_at_peak"]
    steps = s["step_ms"]  # every step counted once, by whether it computed prompt rows
    assert steps["with_prompt_rows"]["steps"] >= 1 and steps["decode_only"]["steps"] >= 1
    assert steps["with_prompt_rows"]["steps"] + steps["decode_only"]["steps"] == engine.steps
    assert 0 < steps["decode_only"]["p50"] <= steps["decode_only"]["p99"]
    by_loop = {k: v["steps"] for k, v in steps.items() if k.startswith("prompt_loop")}
    assert set(by_loop) == {f"prompt_loop{d}" for d in range(1, model.config.total_ut_steps + 1)}
    assert sum(by_loop.values()) == steps["with_prompt_rows"]["steps"]  # one deepest loop each
    traced = s["prompt_steps"]  # each prompt step: its rows per loop, host time, no device
    rows = [dict(zip(traced["columns"], row, strict=True)) for row in traced["rows"]]
    assert len(rows) == steps["with_prompt_rows"]["steps"]
    assert sum(sum(r["rows_by_loop"]) for r in rows) == s["prompt_rows"]
    assert [r["step"] for r in rows] == sorted({r["step"] for r in rows})
    assert all(r["host_ms"] > 0 and r["device_ms"] is None for r in rows)
    assert all(len(r["rows_by_loop"]) == model.config.total_ut_steps for r in rows)


class _Marker:
    """A device marker on the host's clock: the step count when it was recorded."""

    made = 0

    def __init__(self):
        _Marker.made += 1
        self.at = _Marker.made

    def elapsed_time(self, other: "_Marker") -> float:
        return float(other.at - self.at)

    def synchronize(self) -> None:
        pass


def test_device_markers_time_every_step_by_kind(model):
    backend = Registry.discover().create("torch", _request(model), FlashLoopConfig())
    engine = Engine(model, backend, num_blocks=256, block_size=16)
    _Marker.made = 0
    arrivals = fixed_arrival_schedule(3, 50.0, [20], [4], seed=2)
    s = run_workload(engine, arrivals, model.config.vocab_size, 2, device_marker=_Marker)
    host, device = s["step_ms"], s["step_device_ms"]
    assert {k: v["steps"] for k, v in device.items()} == {k: v["steps"] for k, v in host.items()}
    assert all(v["p50"] == v["p99"] == 1.0 for v in device.values())  # after - before
    assert [row[2] for row in s["prompt_steps"]["rows"]] == [1.0] * host["with_prompt_rows"][
        "steps"
    ]
    assert _Marker.made == 2 * engine.steps


def test_a_refused_request_fails_alone(model):
    backend = Registry.discover().create("torch", _request(model), FlashLoopConfig())
    engine = Engine(model, backend, num_blocks=4, block_size=16)  # 64 tokens of pool
    arrivals = [Arrival(0.0, 10, 2), Arrival(0.0, 5000, 2), Arrival(0.0, 8, 2)]
    s = run_workload(engine, arrivals, model.config.vocab_size, concurrency=3)
    assert s["completed"] == 2 and s["failed_requests"] == 1
    assert "max_context" in s["errors"][0] or "KV blocks" in s["errors"][0]


def test_variants_are_dense_each_feature_alone_and_cumulative(model):
    config = FlashLoopConfig.from_dict(json.load(open("configs/all_on.json")))
    names = [v.name for v in variants_for(config, baseline="torch")]
    assert names == [
        "dense", "flashloop_dense", "token_sparse_prefill alone", "sparse_decode_attention alone",
        "kv_residual_quantization alone", "token_sparse_prefill + sparse_decode_attention",
        "token_sparse_prefill + sparse_decode_attention + kv_residual_quantization",
    ]  # fmt: skip
    variants = [v for v in variants_for(config, baseline="torch") if v.name in ("dense", names[-1])]
    workloads = [
        {
            "name": "closed_2",
            "arrivals": fixed_arrival_schedule(3, 100.0, [70], [4]),
            "concurrency": 2,
        }
    ]
    records = serve_variants(
        model, _request(model), variants, workloads, 256, 16, log=lambda m: None
    )
    assert [r["variant"] for r in records] == ["dense", names[-1]]
    assert all(r["completed"] == 3 for r in records)
    dense, all_on = records
    # each record names the implementation every op resolved to (op -> provider)
    assert (
        dense["kernels"]["dense_attention"] == "torch_reference"
        and "packed_decode" in all_on["kernels"]
    )
    assert dense["memory"]["packed_pool_bytes"] == 0 and all_on["memory"]["packed_pool_bytes"] > 0
    assert (
        all_on["memory"]["reference_state_bytes"] > 0
        and dense["config_digest"] != all_on["config_digest"]
    )


def test_variants_are_picked_by_key_in_run_order_and_unknown_keys_are_named():
    config = FlashLoopConfig.from_dict(json.load(open("configs/all_on.json")))
    variants = variants_for(config, baseline="torch")
    all_on = "token_sparse_prefill+sparse_decode_attention+kv_residual_quantization"
    picked = pick_variants(variants, [all_on, "dense"])
    assert [v.name for v in picked] == ["dense", variants[-1].name]
    assert [v.key for v in pick_variants(variants, ["kv_residual_quantization"])] == [
        "kv_residual_quantization"
    ]
    assert pick_variants(variants, None) == variants
    control = pick_variants(variants, ["flashloop_dense"])[0]  # the backend, no feature on
    assert control.backend == "flashloop" and not control.config.enabled_features()
    with pytest.raises(ValueError, match=r"unknown serving variants \['all'\].*'dense'"):
        pick_variants(variants, ["dense", "all"])


def test_records_are_handed_on_after_every_workload(model):
    """A run cut inside a variant keeps the workloads that variant finished."""
    variants = variants_for(
        FlashLoopConfig.from_dict(json.load(open("configs/all_on.json"))), "torch"
    )[:1]
    workloads = [
        {"name": name, "arrivals": fixed_arrival_schedule(1, 1.0, [8], [2]), "concurrency": 1}
        for name in ("first", "second")
    ]
    seen = []
    serve_variants(model, _request(model), variants, workloads, 64, 16, log=lambda m: None,
                   on_record=lambda records: seen.append([r["workload"] for r in records]))  # fmt: skip
    assert seen == [["first"], ["first", "second"]]


def test_a_pool_that_does_not_fit_is_recorded_not_raised(model, monkeypatch):
    import flashloop_backend.host.engine as engine_module

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    monkeypatch.setattr(engine_module, "Engine", no_room)
    variants = variants_for(
        FlashLoopConfig.from_dict(json.load(open("configs/all_on.json"))), "torch"
    )[:1]
    workloads = [
        {"name": "w", "arrivals": fixed_arrival_schedule(1, 1.0, [8], [2]), "concurrency": 1}
    ]
    records = serve_variants(model, _request(model), variants, workloads, 8, 16, log=lambda m: None)
    assert records == [
        {
            "variant": "dense",
            "backend": "torch",
            "error": "OutOfMemoryError: CUDA out of memory (simulated)",
        }
    ]


def test_warm_up_meets_every_graph_bucket_up_to_the_largest_concurrency():
    from flashloop_backend.tools.bench.serving import warm_up_sizes

    workloads = [{"concurrency": None}, {"concurrency": 1}, {"concurrency": 16}]
    assert warm_up_sizes(workloads, (1, 2, 4, 8, 16, 32)) == [1, 2, 4, 8, 16]
    assert warm_up_sizes([{"concurrency": None}]) == [2]  # eager host: no buckets


def _serve_shared_prefix(model, prompt_len: int, num_blocks: int) -> dict:
    """Dense through the prefix cache: a closed loop of 4 prompts of ``prompt_len`` tokens
    (2 new each) whose first 64 are shared, one in flight at a time."""
    config = FlashLoopConfig.from_dict(json.load(open("configs/all_on.json")))
    variants = [v for v in variants_for(config, "torch") if v.name == "dense"]
    workloads = [
        {
            "name": "shared",
            "arrivals": fixed_arrival_schedule(4, 1.0, [prompt_len], [2]),
            "concurrency": 1,
            "shared_prefix": 64,
        }
    ]
    quiet = lambda m: None  # noqa: E731
    (record,) = serve_variants(
        model, _request(model), variants, workloads, num_blocks, 16, log=quiet, prefix_cache=True
    )
    return record


def test_a_shared_prefix_workload_counts_hits_misses_and_computed_rows(model):
    """Closed loop of 4 prompts that share their first 64 tokens, one in flight at a
    time: the first misses and publishes, the other three reuse the 64 positions and
    compute only their own rows (4 loops each)."""
    record = _serve_shared_prefix(model, prompt_len=80, num_blocks=256)
    assert record["completed"] == 4
    assert record["prefix"] == {"lookups": 4, "hits": 3, "misses": 1, "reused_tokens": 3 * 64}
    assert record["prompt_rows"] == (80 + 3 * 16) * 4
    ttft = record["ttft_first_and_later"]
    assert ttft["first_s"] > 0 and ttft["later_s"]["mean"] > 0
    assert ttft["later_mean_over_first"] == ttft["later_s"]["mean"] / ttft["first_s"]


@pytest.mark.parametrize(("cached", "hits"), [(64, 3), (0, 0)])
def test_the_bench_pool_keeps_the_cached_prefix_beside_the_requests(model, cached, hits):
    """A pool for one request in flight plus the published prefix: every later prompt
    reuses it. Sized for the request alone, admitting the next request evicts the prefix
    it was about to reuse, and every lookup misses."""
    from flashloop_backend.tools.bench.serving import pool_blocks

    blocks = pool_blocks(1, 132, 16, model.config.total_ut_steps, cached) - 8
    record = _serve_shared_prefix(model, prompt_len=130, num_blocks=blocks)
    assert record["completed"] == 4 and record["prefix"]["hits"] == hits


def test_each_workload_starts_with_an_empty_prefix_cache(model):
    """Two closed loops of the same seeded prompts: the second reuses nothing the first
    published (its counters and TTFT are its own)."""
    config = FlashLoopConfig.from_dict(json.load(open("configs/all_on.json")))
    variants = [v for v in variants_for(config, "torch") if v.name == "dense"]
    workloads = [
        {"name": name, "arrivals": fixed_arrival_schedule(2, 1.0, [40], [2]), "concurrency": 1}
        for name in ("first", "second")
    ]
    records = serve_variants(
        model, _request(model), variants, workloads, 256, 16, log=lambda m: None, prefix_cache=True
    )
    assert [r["prefix"]["hits"] for r in records] == [0, 0]


def test_a_shared_prefix_as_long_as_a_context_is_refused_before_any_work():
    from flashloop_backend import ConfigError
    from flashloop_backend.tools.bench.serving import bench_serving

    config = FlashLoopConfig.from_dict(json.load(open("configs/all_on.json")))
    with pytest.raises(ConfigError, match=r"shared_prefix=1024 must be below every context"):
        bench_serving(config, "torch", [1024, 4096], [1], 4, 1, 1.0, shared_prefix=1024)
