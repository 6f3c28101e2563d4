"""``bench e2e``: prefill, TTFT and TPOT end to end through the host on Ouro-1.4B shapes
with random weights (or a trained checkpoint on held-out text), every backend in one
process."""

from __future__ import annotations

import dataclasses
import gc
import statistics
import time

import torch

from flashloop_backend.capabilities import Capability
from flashloop_backend.config import ConfigError, FlashLoopConfig
from flashloop_backend.host.capacity import footprint, planning_capacity
from flashloop_backend.host.speculation import SpeculationSettings
from flashloop_backend.registry import Registry, resolve
from flashloop_backend.tools.bench.bench_models import (
    checkpoint_workload,
    graph_variant,
    random_ouro,
)
from flashloop_backend.tools.bench.replay_bytes import ModelShapes, record_bandwidth
from flashloop_backend.tools.bench.timing import environment_record
from flashloop_backend.tools.bench.workload import step_timing, step_wait


def _timed_workload(
    engine,
    prompts,
    new_tokens,
    probe: dict | None = None,
    exits=None,
    second: dict | None = None,
    sync_every_step: bool = False,
):
    """Submit every prompt at once; (ids, first-token times, finish times, total seconds).
    ``second`` (a dict) receives each request's second-token time: the steps after it
    decode only (the step that hands a completed prompt to the backend comes before).
    ``exits`` (a list of zeros, one per loop) counts the tokens that left after each loop.
    ``probe`` (an empty dict) receives, for the step that follows every request's first
    token (the host hands completed prompts to the backend, which packs them, when that
    step starts): ``tokens`` and ``kv_bytes`` held after it (``Engine.kv_held``: one host
    call inside the timed window), the peak allocated bytes before it
    (``peak_before_bytes``: prefill) and during it (``hand_over_step_peak_bytes``: the
    conversion's transient use on top of what is held). The peak counter is reset before
    that step: a caller's overall peak is the larger of ``peak_before_bytes`` and the
    counter afterwards. ``sync_every_step``: wait for the device after every step (the
    host then cannot plan a step while the device runs the one before); by default a token's
    time is taken when the step that sampled it returns, whose host read of the token
    waited for the device."""
    from flashloop_backend.host.engine import SamplingParams

    ids = [
        engine.add_request(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        for p in prompts
    ]
    cuda = engine.device.type == "cuda"  # CPU runs (tests) time without device counters
    sync = torch.cuda.synchronize if cuda else lambda: None
    step_sync = step_wait(sync_every_step and cuda)
    peak = torch.cuda.max_memory_allocated if cuda else lambda: 0
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    sync()  # the pass starts on an idle device: nothing queued before it counts in it
    start = time.perf_counter()
    all_first = False  # every request had its first token before this step
    while engine.has_unfinished():
        hand_over_step = probe is not None and not probe and all_first
        if hand_over_step:
            step_sync()  # the peak counters are the allocator's host-side accounting
            peak_before = peak()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
        finished = engine.step()
        step_sync()
        now = time.perf_counter() - start
        for rid in ids:
            if rid not in first and engine.has_first_token(rid):
                first[rid] = now
            count = engine.output_count(rid)
            if second is not None and rid not in second and (count is None or count >= 2):
                second[rid] = now
        for f in finished:
            done[f.request_id] = now
            for depth in f.exit_depths if exits is not None else ():
                exits[depth] += 1
        if hand_over_step:
            tokens, held = engine.kv_held()
            probe.update(
                tokens=tokens,
                kv_bytes=held,
                peak_before_bytes=peak_before,
                hand_over_step_peak_bytes=peak(),
            )
        all_first = len(first) == len(ids)
    return ids, first, done, time.perf_counter() - start


def gib(value: int | None) -> float | None:
    return None if value is None else value / 2**30


def planned_runs(
    layer_ops: tuple[str, ...],
    backends: list[str],
    points: list[tuple[str, FlashLoopConfig]] | None,
    speculate: bool = False,
) -> list[tuple[str, str, str | None, FlashLoopConfig | None, bool]]:
    """(layer ops, backend entry, grid point name, its config, speculating) per measured
    run, in order: a ``flashloop`` entry runs once per point when ``points`` are given,
    every other entry once (point and config None); with ``speculate`` each run is
    followed by the same run speculating."""
    runs = []
    for variant in layer_ops:
        for entry in backends:
            named = points if points and entry.partition("+")[0] == "flashloop" else [(None, None)]
            for point, cfg in named:
                runs += [(variant, entry, point, cfg, s) for s in (False, True)[: 1 + speculate]]
    return runs


def bench_end_to_end(
    backends: list[str],
    context: int,
    concurrency: int,
    new_tokens: int = 16,
    layers: int | None = None,
    prefill_chunk: int = 2048,
    block_size: int = 16,
    log=print,
    config: FlashLoopConfig | None = None,
    max_batch_tokens: int | None = None,
    warmup_context: int | None = None,
    layer_ops: tuple[str, ...] = ("fused",),
    passes: int = 1,
    points: list[tuple[str, FlashLoopConfig]] | None = None,
    speculation: SpeculationSettings | None = None,
    checkpoint: str | None = None,
    exit_threshold: float | None = None,
    sync_every_step: bool = False,
) -> dict:
    """Prefill latency, TTFT, TPOT and throughput through the host on Ouro-1.4B shapes with
    random weights (no download). Decode rows advance one loop per host step. ``config``
    applies to the ``flashloop`` backend; every other backend runs dense. A name ending in
    ``+graphs`` (``flashloop+graphs``) runs decode-only steps from CUDA graphs, its kernels
    chosen with the ``cuda_graphs`` capability. Prefill speedups are against the first
    backend, measured in the same process. ``max_batch_tokens`` defaults to one prefill chunk
    per request: every prompt prefills in the same steps, so decode starts in lockstep and
    TPOT is the decode of ``concurrency`` rows, not decode interleaved with other prefills.
    The untimed warm-up pass uses ``warmup_context``-token prompts (default: ``context``):
    it compiles kernels and captures graphs, whose shapes do not depend on prompt length.
    ``layer_ops``: the model's per-layer work, ``fused`` (one QKV and one gate-up GEMM, the
    fused norm, RoPE, SiLU and KV-write kernels) and/or ``reference`` (separate projections,
    torch ops), each on its own copy of the same weights; a reference run's results are
    named ``<backend> [reference layers]``. ``passes`` timed passes of the workload run per
    backend after the warm-up: TTFT and TPOT are medians over every request of every pass,
    ``prefill_latency_s`` the median over passes of a pass's slowest first token (each
    pass's figures are kept under ``passes``). ``points``: named configs (the grid's, by
    :func:`~flashloop_backend.tools.grid.point_name`) that the ``flashloop`` entries run one
    after another in place of ``config``, each result named ``<entry> [<point>]``.
    ``speculation``: each run again with greedy block speculation, named
    ``<name> [speculate K]``, with its draft, verify and acceptance counts (with random
    weights the drafts' acceptance says nothing about a trained model's). ``checkpoint``:
    a trained model's directory in place of the random Ouro-1.4B shapes, prompted with
    windows of the held-out text (its own layers: not with ``layers``). ``exit_threshold``:
    the checkpoint's tokens leave by Ouro's exit rule at that threshold, for every backend
    alike (each result counts its exits per loop under ``exit_depths``).
    ``sync_every_step``: the timed loop waits for the device after every step (the records
    before ``sync_every_step`` existed all did); by default it does not, as a server would
    not, and the host plans a step while the device runs the one before."""
    from flashloop_backend.host.engine import Engine

    checked = (
        ("max_batch_tokens", max_batch_tokens),
        ("warmup_context", warmup_context),
        ("passes", passes),
    )
    for name, value in checked:
        if value is not None and value < 1:
            raise ConfigError(f"{name}={value} must be >= 1 (or left unset for the default)")
    max_batch_tokens = max_batch_tokens or concurrency * prefill_chunk

    unknown = [v for v in layer_ops if v not in ("fused", "reference")]
    if not layer_ops or unknown:
        raise ConfigError(f"layer_ops {list(layer_ops)}: each must be 'fused' or 'reference'")
    if checkpoint is not None and layers is not None:
        raise ConfigError(f"layers={layers}: a checkpoint ({checkpoint}) runs its own layers")
    if exit_threshold is not None and checkpoint is None:
        raise ConfigError(
            f"exit_threshold={exit_threshold} needs a trained checkpoint (--model): the exit "
            "gate of random weights decides nothing a served model would"
        )
    if exit_threshold is not None and not 0 < exit_threshold <= 1:
        raise ConfigError(f"exit_threshold={exit_threshold} must be in (0, 1]")
    if checkpoint is None:
        models = {v: random_ouro(layers, block_size, fused=v == "fused") for v in layer_ops}
        cfg = models[layer_ops[0]][0].config
        prompts = [
            torch.randint(0, cfg.vocab_size, (context,)).tolist() for _ in range(concurrency)
        ]
        described = "Ouro-1.4B shapes, random bf16 weights" + (
            f", {layers} layers" if layers else ""
        )
    else:
        models = {}
        for v in layer_ops:
            model, request, prompts, source = checkpoint_workload(
                checkpoint, block_size, context, concurrency, fused=v == "fused"
            )
            if exit_threshold is not None:
                model.config = dataclasses.replace(
                    model.config, early_exit_threshold=exit_threshold
                )
            models[v] = (model, request)
        described = f"{checkpoint} (bf16), prompts from {source}"
    model, request = models[layer_ops[0]]
    cfg = model.config
    registry = Registry.discover()
    tokens_per_request = context + new_tokens
    warm_prompts = [p[: warmup_context or context] for p in prompts]
    results = {}
    runs = planned_runs(layer_ops, backends, points, speculation is not None)
    for variant, entry, point, point_config, speculative in runs:
        model = models[variant][0]
        name = entry if variant == "fused" else f"{entry} [reference layers]"
        name += f" [{point}]" if point else ""
        name += f" [speculate {speculation.block_size}]" if speculative else ""
        rows = concurrency * (speculation.block_size if speculative else 1)  # verify: a row each
        base, graphs = graph_variant(entry, rows, tokens_per_request)
        chosen = point_config or config or FlashLoopConfig()
        effective = chosen if base == "flashloop" else FlashLoopConfig()
        wanted = request.with_required({Capability.CUDA_GRAPHS}) if graphs else request
        backend = registry.create(base, wanted, effective)
        # pools for every request at its most: a prompt running its loops (one BF16 plane
        # of its packed rows when the backend packs them) and every page it can hold
        shape = planning_capacity(cfg, tokens_per_request, block_size, torch.device("cuda"))
        itemsize = next(model.parameters()).dtype.itemsize
        cost = footprint(backend, shape, context, new_tokens, itemsize)
        engine = Engine(
            model,
            backend,
            num_blocks=concurrency * cost.prefill_blocks + 8,
            packed_pages=concurrency * cost.packed_pages or None,
            block_size=block_size,
            max_batch_tokens=max_batch_tokens,
            prefill_chunk=prefill_chunk,
            cuda_graphs=graphs,
            max_context=tokens_per_request,
            # one decode slot per request (per block row when speculating): per-slot state
            # (the sparse-decode references) sized for the workload, not for a batch of 256
            max_slots=concurrency * (speculation.block_size if speculative else 1),
            speculation=speculation if speculative else None,
        )
        # an untimed pass of the same workload first: Triton and FlashInfer compile on first
        # use, and a compile inside TTFT would say nothing about serving
        *_, warm_s = _timed_workload(engine, warm_prompts, new_tokens)
        log(f"  e2e {name} ctx={context} conc={concurrency}: warm-up pass {warm_s:.1f} s")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        warm_steps = engine.steps
        if engine.graphs is not None:
            engine.graphs.time_replays()
        probe: dict = {}
        ttft, tpot, steady, total, per_pass = [], [], [], 0.0, []
        exits = [0] * cfg.total_ut_steps
        for _ in range(passes):
            second: dict = {}
            ids, first, done, seconds = _timed_workload(
                engine, prompts, new_tokens, probe, exits, second, sync_every_step
            )
            firsts = [first[i] for i in ids]
            ttft += firsts
            tpot += [(done[i] - first[i]) / max(1, new_tokens - 1) for i in ids]
            if new_tokens > 2:
                steady += [(done[i] - second[i]) / (new_tokens - 2) for i in ids]
            total += seconds
            per_pass.append({"ttft_max_s": max(firsts), "total_s": seconds})
        latency = statistics.median(p["ttft_max_s"] for p in per_pass)
        overall_peak = max(probe.get("peak_before_bytes", 0), torch.cuda.max_memory_allocated())
        baseline = next(iter(results.values()), None)
        speedup = baseline["prefill_latency_s"] / latency if baseline else 1.0
        effective_config = resolve(effective, base, wanted, registry)
        results[name] = {
            "prefill_latency_s": latency,
            "ttft_s": {"median": statistics.median(ttft), "max": max(ttft)},
            "tpot_ms": {"median": 1e3 * statistics.median(tpot), "max": 1e3 * max(tpot)},
            # from each request's second token on: the step that packs a completed prompt
            # (in the step after its first token) left out, a diagnostic beside TPOT
            "tpot_from_second_token_ms": (
                {"median": 1e3 * statistics.median(steady), "max": 1e3 * max(steady)}
                if steady
                else None
            ),
            "throughput_tokens_s": passes * concurrency * new_tokens / total,
            "total_s": total / passes,
            "host_steps": (engine.steps - warm_steps) // passes,
            "passes": per_pass,
            "peak_allocated_gib": gib(overall_peak),
            # the peak before the step that hands the last prompts over (prefill, and the
            # conversions of prompts that finished earlier) and during it (the conversion's
            # transient use on top of the steady KV); None without that step
            "prefill_peak_allocated_gib": gib(probe.get("peak_before_bytes")),
            "hand_over_step_peak_allocated_gib": gib(probe.get("hand_over_step_peak_bytes")),
            "peak_reserved_gib": gib(torch.cuda.max_memory_reserved()),
            "kv_bytes_per_token": engine.kv.bytes_per_token(),
            "failed_requests": concurrency - len(done),  # of the last pass
            # once every prompt is in: BF16 blocks in use + packed steady bytes (KV quantization)
            "kv_held_bytes_per_token": probe["kv_bytes"] / probe["tokens"] if probe else None,
            "config_digest": effective_config.digest(),
            # the kernel provider of every op, the dense prefill's included (TTFT baselines)
            "kernels": dict(effective_config.kernels),
            "graphs": engine.graphs.stats() if engine.graphs else None,
            "align_decode_depths": engine.align_decode_depths,
            "replay_ms_by_key": engine.graphs.replay_ms() if engine.graphs else None,
            "prefill_speedup_vs_first": speedup,
            "layer_ops": variant,
            "speculation": engine.speculation.counters() if engine.speculation else None,
            "exit_depths": exits,
            "grid_point": point,
            "point_config": point_config.model_dump(mode="json") if point_config else None,
        }
        summary = results[name]
        log(
            f"  e2e {name} ctx={context} conc={concurrency}: TTFT {statistics.median(ttft):.3f} s, "
            f"TPOT {summary['tpot_ms']['median']:.1f} ms, "
            f"{summary['throughput_tokens_s']:.1f} tok/s"
        )
        del engine, backend
        gc.collect()  # the engine and its graph runner reference each other: free the caches now
        torch.cuda.empty_cache()
    record = {
        "kind": "end_to_end_host",
        "environment": environment_record(),
        "model": described,
        "model_shapes": dataclasses.asdict(ModelShapes.of(cfg)),
        "context": context,
        "concurrency": concurrency,
        "new_tokens": new_tokens,
        "prefill_chunk": prefill_chunk,
        "max_batch_tokens": max_batch_tokens,
        "max_slots": concurrency,
        "warmup_context": warmup_context or context,
        "passes": passes,
        "exit_threshold": exit_threshold,
        "speculation": speculation.model_dump() if speculation else None,
        "method": f"{passes} timed pass(es) after an untimed warm-up pass (prompts cut to "
        "warmup_context) per backend, same process; " + step_timing(sync_every_step),
        "sync_every_step": sync_every_step,
        "config": (config or FlashLoopConfig()).model_dump(mode="json"),
        "results": results,
    }
    # per backend and graph key: the bytes a replay moves and the TB/s its median makes
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    record["replay_bandwidth_by_key"] = record_bandwidth(record, gpu)
    return record
