"""``bench capacity``: one KV memory budget for every variant (dense, KV quantization
alone, the config), engines whose pools are planned from it (``Engine(kv_memory_bytes=...)``),
and a closed loop of more clients than dense can hold: the most requests each variant
held at once, output tokens/s, TTFT and inter-token latency percentiles, refusals and
peak memory, one process; beside each run, how late an idle witness process woke
(``host_noise``), which tells a machine's stalls from the process's own.

The functions take any model, so the same code runs a tiny model on CPU (tests) and
Ouro-1.4B shapes on the GPU."""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable

from flashloop_backend.config import ConfigError, FlashLoopConfig, load_config
from flashloop_backend.tools.bench.host_noise import HostNoise
from flashloop_backend.tools.bench.serving import Variant, memory_breakdown, warm_up
from flashloop_backend.tools.bench.workload import (
    fixed_arrival_schedule,
    run_workload,
    step_timing,
    step_wait,
)

# Prompt rows a step runs, as bench e2e's: a 32K prompt in 16 steps a loop.
PREFILL_CHUNK = 2048


# The variants bench capacity can run (``--variants``), in the order it runs them.
CAPACITY_VARIANTS = ("dense", "kv_residual_quantization", "config")


def capacity_variants(
    config: FlashLoopConfig, baseline: str, keys: list[str] | None = None
) -> list[Variant]:
    """Dense on ``baseline``, KV quantization alone (when ``config`` quantizes and has
    other features on too), and ``config``; ``keys`` (names of ``CAPACITY_VARIANTS``,
    None: all) picks among them."""
    if not config.kv_residual_quantization.enabled:
        raise ConfigError(
            "bench capacity compares what KV quantization frees: --config must enable "
            "kv_residual_quantization"
        )
    unknown = [key for key in keys or () if key not in CAPACITY_VARIANTS]
    if unknown or keys == []:
        named = ", ".join(repr(key) for key in unknown) if unknown else "none"
        raise ConfigError(
            f"--variants names {named}: bench capacity runs one or more of "
            f"{', '.join(CAPACITY_VARIANTS)}"
        )
    out = {"dense": Variant("dense", baseline, FlashLoopConfig())}
    alone = FlashLoopConfig(kv_residual_quantization=config.kv_residual_quantization)
    if alone != config:
        out["kv_residual_quantization"] = Variant(
            "kv_residual_quantization alone", "flashloop", alone
        )
    elif keys is not None and "kv_residual_quantization" in keys:
        raise ConfigError(
            "--variants kv_residual_quantization: this --config is KV quantization alone; "
            "name config instead"
        )
    out["config"] = Variant("config", "flashloop", config)
    return [out[key] for key in CAPACITY_VARIANTS if key in out and (keys is None or key in keys)]


def serve_at_budget(
    model,
    request,
    variants: list[Variant],
    budget_bytes: int,
    prompt: int,
    new_tokens: int,
    clients: int,
    block_size: int = 16,
    sync: Callable[[], None] = lambda: None,
    log=print,
    graphs=None,
    warm: bool = True,
    prefill_chunk: int = PREFILL_CHUNK,
    max_batch_tokens: int | None = None,
    step_sync: Callable[[], None] = lambda: None,
    device_marker: Callable[[], object] | None = None,
    wrap_step: Callable[[object, Callable], Callable] | None = None,
) -> list[dict]:
    """Per variant: an engine planned from ``budget_bytes`` for requests of ``prompt`` +
    ``new_tokens`` (one prefilling at a time), an untimed warm-up (``Engine.warm_up``,
    then closed loops of the workload's batch sizes; their seconds are the record's
    ``start_up_s``), then ``clients`` requests of that shape submitted at once (the engine
    admits what its pools hold; the rest wait): the workload's summary with the plan and
    the memory breakdown. ``warm`` False skips the warm-up (its prompts need a context of
    132 tokens). A step holds one prompt chunk of ``prefill_chunk`` rows beside every
    client's decode row unless ``max_batch_tokens`` says otherwise (``bench e2e``'s chunk:
    a 32K prompt in 16 steps a loop, not 128). ``sync`` runs after the warm-up,
    ``step_sync`` after every timed step (default none: see ``bench_capacity``);
    ``device_marker`` as :func:`run_workload`'s (each step's span on the device);
    ``wrap_step(engine, step)`` returns what the timed workload calls in place of each
    ``engine.step()`` (diagnostics: ``scripts/sync_census.py``, ``scripts/slow_step_profile.py``)."""
    from flashloop_backend.capabilities import Capability
    from flashloop_backend.host.engine import Engine
    from flashloop_backend.registry import Registry, resolve

    registry = Registry.discover()
    vocab = model.config.vocab_size
    arrivals = fixed_arrival_schedule(clients, 1.0, [prompt], [new_tokens])
    workload = {"name": f"closed_{clients}_clients", "concurrency": clients, "arrivals": arrivals}
    records = []
    for variant in variants:
        wanted = request.with_required({Capability.CUDA_GRAPHS}) if graphs else request
        backend = registry.create(variant.backend, wanted, variant.config)
        try:
            engine = Engine(
                model,
                backend,
                block_size=block_size,
                prefill_chunk=prefill_chunk,
                max_batch_tokens=max_batch_tokens or prefill_chunk + clients,
                max_context=prompt + new_tokens,
                cuda_graphs=graphs,
                kv_memory_bytes=budget_bytes,
                planned_request=(prompt, new_tokens),
            )
        except ValueError as exc:  # the budget holds not even one request of the variant
            records.append({"variant": variant.name, "backend": variant.backend, "error": str(exc)})
            log(f"  capacity {variant.name}: {exc}")
            continue
        effective = resolve(variant.config, variant.backend, wanted, registry)
        planned = engine.capacity_plan.requests
        start_up_s = None
        if warm:  # the engine's start (every kernel and graph key), then the workload's sizes
            started = time.perf_counter()
            engine.warm_up()
            warm_up(engine, [{"concurrency": min(clients, planned)}], vocab, sync)
            sync()
            start_up_s = time.perf_counter() - started
        steps = engine.steps
        if wrap_step is not None:
            engine.step = wrap_step(engine, engine.step)
        try:
            with HostNoise() as witness:
                summary = run_workload(
                    engine, arrivals, vocab, clients, step_sync, device_marker=device_marker
                )
        finally:
            if wrap_step is not None:
                del engine.step
        summary.update(
            start_up_s=start_up_s,
            # fewer held than planned: requests finished before the pools filled (one
            # prompt prefills at a time), so the run measured the prefill pipeline
            pools_filled=summary["most_requests_held"] >= min(planned, clients),
            variant=variant.name,
            backend=variant.backend,
            workload=workload["name"],
            config_digest=effective.digest(),
            plan=dataclasses.asdict(engine.capacity_plan),
            memory=memory_breakdown(engine),
            align_decode_depths=engine.align_decode_depths,
            steps=engine.steps - steps,  # the workload's, not the warm-up's
            graphs=_graph_counts(engine),
            host_noise=witness.summary,
        )
        records.append(summary)
        step_ms = {k: v if v["steps"] else None for k, v in summary["step_ms"].items()}
        log(
            f"  capacity {variant.name:<32} held {summary['most_requests_held']:3d} at once "
            f"(plan {planned}), {summary['throughput_tokens_s']:8.1f} tok/s, "
            f"failed {summary['failed_requests']}, ITL p50 / p99 "
            f"{_ms(summary['itl_ms'], 'p50')} / {_ms(summary['itl_ms'], 'p99')} ms, "
            f"TTFT p50 {_ms(summary['ttft_s'], 'p50')} s, step p99 with prompt rows / "
            f"decode only {_ms(step_ms['with_prompt_rows'], 'p99')} / "
            f"{_ms(step_ms['decode_only'], 'p99')} ms"
            + ("" if start_up_s is None else f", start-up {start_up_s:.1f} s")
            + _by_loop(summary)
            + _witness(witness.summary)
            + ("" if summary["pools_filled"] else "; requests ended before the pools filled")
        )
        del engine, backend
        gc.collect()
    return records


def _by_loop(summary: dict) -> str:
    """Prompt steps' p99 by their deepest loop, host and device (where timed), for a log
    line."""
    device = summary.get("step_device_ms", {})
    parts = [
        f"{kind.removeprefix('prompt_')} {_ms(ms, 'p99')}"
        + (f" / {_ms(device[kind], 'p99')}" if kind in device else "")
        for kind, ms in summary["step_ms"].items()
        if kind.startswith("prompt_loop")
    ]
    what = "host / device" if device else "host"
    return f"; prompt step p99 ms ({what}) " + ", ".join(parts) if parts else ""


def _witness(noise: dict | None) -> str:
    """The idle witness process's late wake-ups, for a log line."""
    if noise is None or not noise["wakeups"]:
        return ""
    late = noise["late_ms"]
    return (
        f"; a witness process woke late p99 / max {late['p99']:.2f} / {late['max']:.2f} ms "
        f"({noise['stalls']} over {noise['stalls_over_ms']:g} ms)"
    )


def _ms(percentiles: dict | None, which: str) -> str:
    """One percentile for a log line ("-" where no request gave any)."""
    return "-" if percentiles is None else f"{percentiles[which]:.2f}"


def bench_capacity(
    config: FlashLoopConfig,
    baseline: str,
    contexts: list[int],
    new_tokens: int,
    kv_memory_gib: list[float],
    layers: int | None,
    clients: int | None = None,
    log=print,
    max_batch_tokens: int | None = None,
    split_mixed_steps: bool = True,
    sync_every_step: bool = False,
    variant_keys: list[str] | None = None,
    wrap_step: Callable[[object, Callable], Callable] | None = None,
) -> dict:
    """The GPU record: for each budget of ``kv_memory_gib`` and each context, every variant
    of :func:`capacity_variants` (those ``variant_keys`` names) under that budget, ``clients`` requests of (context -
    new_tokens) + new_tokens (default: three times what the config's plan holds there);
    ``max_batch_tokens`` as :func:`serve_at_budget`'s; ``split_mixed_steps`` as
    ``GraphSettings``' (refused without a graphed baseline); ``sync_every_step``: wait for
    the device after every timed step (the records before it existed all did; by default
    a token's time is taken when the step that sampled it returns); ``wrap_step`` as
    :func:`serve_at_budget`'s."""
    import torch

    from flashloop_backend.tools.bench.bench_models import graph_variant, random_ouro
    from flashloop_backend.tools.bench.timing import environment_record

    variants_named = capacity_variants(config, baseline, variant_keys)
    for context in contexts:  # refused before any GPU work
        if not 0 < new_tokens < context:
            raise ConfigError(f"--new-tokens {new_tokens} must lie in [1, context {context})")
    if not split_mixed_steps and graph_variant(baseline, 1, 1)[1] is None:
        raise ConfigError(
            f"--one-traversal-mixed-steps needs CUDA graphs: name the baseline {baseline}+graphs"
        )
    block_size = 16
    model, request = random_ouro(layers, block_size)
    runs = []
    for gib in kv_memory_gib:
        budget = int(gib * 2**30)
        for context in contexts:
            n = clients or 3 * _planned_requests(
                model, request, config, budget, context, new_tokens
            )
            base, graphs = graph_variant(baseline, n, context)
            if graphs is not None:
                graphs = graphs.model_copy(update={"split_mixed_steps": split_mixed_steps})
            variants = [
                dataclasses.replace(v, backend=base) if v.name == "dense" else v
                for v in variants_named
            ]
            log(f"  capacity ctx={context}: {n} clients, {gib:g} GiB of KV memory")
            tokens = max_batch_tokens or PREFILL_CHUNK + n
            records = serve_at_budget(
                model,
                request,
                variants,
                budget,
                context - new_tokens,
                new_tokens,
                n,
                block_size,
                sync=torch.cuda.synchronize,
                log=log,
                graphs=graphs,
                max_batch_tokens=tokens,
                step_sync=step_wait(sync_every_step),
                device_marker=_recorded_event,
                wrap_step=wrap_step,
            )
            run = {"kv_memory_bytes": budget, "context": context, "clients": n}
            run |= {"prefill_chunk": PREFILL_CHUNK, "max_batch_tokens": tokens}
            run["split_mixed_steps"] = None if graphs is None else split_mixed_steps
            runs.append(run | {"records": records})
    return {
        "kind": "capacity",
        "environment": environment_record(),
        "model": "Ouro-1.4B shapes, random bf16 weights" + (f", {layers} layers" if layers else ""),
        "new_tokens": new_tokens,
        "config": config.model_dump(mode="json"),
        "method": "one engine per variant planned from the same KV budget, an untimed warm-up, "
        "then every client's request submitted at once; " + step_timing(sync_every_step),
        "sync_every_step": sync_every_step,
        "runs": runs,
    }


def add_workload_arguments(parser, new_tokens: int, clients: int) -> None:
    """The arguments of one variant's capacity workload, for diagnostic scripts that run it
    (:func:`bench_variant`): variant, config, baseline, context, budget, layers, new tokens
    and clients."""
    from pathlib import Path

    parser.add_argument("--variant", default="config", choices=CAPACITY_VARIANTS)
    parser.add_argument("--config", type=Path, default=Path("configs/all_on.json"))
    parser.add_argument("--baseline", default="triton+graphs")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--gib", type=float, default=16)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=new_tokens)
    parser.add_argument("--clients", type=int, default=clients)


def bench_variant(args, wrap_step: Callable[[object, Callable], Callable]) -> dict:
    """:func:`bench_capacity` for the one variant and workload of ``args``
    (:func:`add_workload_arguments`), each timed step through ``wrap_step``."""
    return bench_capacity(
        load_config(args.config),
        args.baseline,
        contexts=[args.context],
        new_tokens=args.new_tokens,
        kv_memory_gib=[args.gib],
        layers=args.layers,
        clients=args.clients,
        variant_keys=[args.variant],
        wrap_step=wrap_step,
    )


def _recorded_event():
    """A timing event recorded on the current stream now (``run_workload``'s marker)."""
    import torch

    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _graph_counts(engine) -> dict | None:
    """Replays, eager decode steps and fallbacks of the workload (warm-up included), and
    how many graph keys were captured; None without graphs."""
    if engine.graphs is None:
        return None
    stats = engine.graphs.stats()
    return {k: v for k, v in stats.items() if k != "graphs"} | {"keys": len(stats["graphs"])}


def _planned_requests(model, request, config, budget: int, context: int, new: int) -> int:
    """The requests the config's plan holds (its engine's ``capacity_plan``)."""
    from flashloop_backend.host.capacity import requests_that_fit
    from flashloop_backend.registry import Registry

    backend = Registry.discover().create("flashloop", request, config)
    return requests_that_fit(backend, model.config, context, new, budget)[0]
