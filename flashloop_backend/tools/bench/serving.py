"""Serving benchmark through the host: dense and each FlashLoop variant in one process,
one engine per variant after an untimed warm-up, every workload of
:mod:`~flashloop_backend.tools.bench.workload` (fixed-arrival mixed and closed-loop) per variant, with a memory
breakdown; the record carries each variant's effective-config digest and kernels."""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from dataclasses import dataclass

from flashloop_backend.config import ConfigError
from flashloop_backend.tools.bench.workload import (
    fixed_arrival_schedule,
    run_workload,
    step_timing,
    step_wait,
)

# a shared prefix served to this many requests: one computes it, the rest reuse it
SHARED_PREFIX_REQUESTS = 16


def memory_breakdown(engine) -> dict:
    """Bytes the engine and backend hold, from their tensors: the weights, the BF16 KV
    pools, the packed store (pools, and what its pages hold now), the loop-2 reference
    states; the memory CUDA-graph captures added to the reserved pool; on a GPU the CUDA
    peaks and the transient peak above the standing tensors (activations, conversion
    scratch). The steady KV the requests held is the workload's ``kv_held``."""
    import torch

    pools = engine.backend.memory()
    kv_pools = (engine.kv.key_pool, engine.kv.value_pool)
    record = {
        "model_bytes": sum(p.numel() * p.element_size() for p in engine.model.parameters()),
        "kv_pool_bytes": sum(t.numel() * t.element_size() for t in kv_pools),
        "packed_pool_bytes": pools.get("packed_pool", 0),
        "packed_steady_bytes": engine.backend.kv_bytes_held(),
        "reference_state_bytes": pools.get("reference_states", 0),
        "graph_bytes": engine.graphs.graph_bytes if engine.graphs else 0,
    }
    if engine.device.type == "cuda":
        record["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        record["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        # above what stays allocated (weights, pools, reference state): activations and
        # the prompt conversion's scratch (graph_bytes is reported apart, not subtracted)
        standing_keys = (
            "model_bytes",
            "kv_pool_bytes",
            "packed_pool_bytes",
            "reference_state_bytes",
        )
        standing = sum(record[k] for k in standing_keys)
        record["transient_peak_bytes"] = record["peak_allocated_bytes"] - standing
    return record


@dataclass(frozen=True)
class Variant:
    name: str
    backend: str
    config: object  # FlashLoopConfig

    @property
    def key(self) -> str:
        """The name without spaces, as ``bench serving --variants`` takes it ("dense",
        a feature name, or feature names joined by "+")."""
        return self.name.removesuffix(" alone").replace(" + ", "+")


def pick_variants(variants: list[Variant], keys: list[str] | None) -> list[Variant]:
    """The variants whose :attr:`Variant.key` is in ``keys`` (None: all), in run order."""
    if keys is None:
        return variants
    known = [v.key for v in variants]
    unknown = [k for k in keys if k not in known]
    if unknown or not keys:
        raise ConfigError(f"unknown serving variants {unknown or keys}; this config has {known}")
    return [v for v in variants if v.key in keys]


def variants_for(config, baseline: str = "flashinfer") -> list[Variant]:
    """Dense on ``baseline``; the ``flashloop`` backend with no feature on (its dispatch
    and kernels without any FlashLoop feature: what the features' figures sit on); then
    each feature of ``config`` alone and cumulatively (in the config's feature order)."""
    from flashloop_backend.config import FlashLoopConfig
    from flashloop_backend.tools.grid import feature_combinations

    combos = dict(feature_combinations(config))
    enabled = config.enabled_features()
    out = [
        Variant("dense", baseline, FlashLoopConfig()),
        Variant("flashloop_dense", "flashloop", FlashLoopConfig()),
    ]
    out += [Variant(f"{name} alone", "flashloop", combos[(name,)]) for name in enabled]
    for size in range(2, len(enabled) + 1):
        chosen = enabled[:size]
        out.append(Variant(" + ".join(chosen), "flashloop", combos[chosen]))
    return out


WARM_PROMPT, WARM_OUTPUT = 128, 4


def warm_up_sizes(workloads: list[dict], buckets: tuple[int, ...] = ()) -> list[int]:
    """Closed-loop sizes of the warm-up: every concurrency the workloads use (at least 2)
    and every graph bucket up to the largest of them. A closed loop's decode batches shrink
    through the smaller buckets as its requests finish; a graph first met inside a timed
    window would put its capture step into that window's latencies."""
    sizes = {2, *(w["concurrency"] for w in workloads if w["concurrency"])}
    return sorted(sizes | {b for b in buckets if b <= max(sizes)})


def warm_up(engine, workloads: list[dict], vocab: int, sync=lambda: None) -> None:
    """Untimed: a closed loop of ``c`` short requests for every size of
    :func:`warm_up_sizes`, so kernels compile and CUDA graphs of those batch sizes (at
    every packed depth: the prompts span two 64-row groups) are captured before any
    timing."""
    buckets = tuple(engine.graphs.settings.buckets) if engine.graphs else ()
    for size in warm_up_sizes(workloads, buckets):
        arrivals = fixed_arrival_schedule(size, 1.0, [WARM_PROMPT], [WARM_OUTPUT])
        run_workload(engine, arrivals, vocab, concurrency=size, sync=sync)


def serve_variants(
    model,
    request,
    variants: list[Variant],
    workloads: list[dict],
    num_blocks: int,
    block_size: int,
    sync=lambda: None,
    log=print,
    graphs=None,
    max_context=None,
    on_record: Callable[[list[dict]], None] = lambda records: None,
    prefix_cache: bool = False,
    step_sync=lambda: None,
) -> list[dict]:
    """Every workload on every variant, one engine per variant after an untimed
    :func:`warm_up` (kernels compile and graphs are captured on first use). ``workloads``:
    dicts with ``name``, ``arrivals`` and ``concurrency`` (None = open loop). ``on_record``
    receives the records so far after each workload (a run cut mid-variant keeps what it
    measured). ``graphs`` (GraphSettings): every variant replays decode steps from CUDA
    graphs, its kernels chosen with the ``cuda_graphs`` capability. ``prefix_cache``: every
    engine shares published prompt prefixes (a workload's ``shared_prefix`` tokens start
    each of its prompts)."""
    import torch

    from flashloop_backend.capabilities import Capability
    from flashloop_backend.host.engine import Engine
    from flashloop_backend.registry import Registry, resolve

    registry = Registry.discover()
    vocab = model.config.vocab_size
    records = []
    for variant in variants:
        wanted = request.with_required({Capability.CUDA_GRAPHS}) if graphs else request
        backend = registry.create(variant.backend, wanted, variant.config)
        try:
            engine = Engine(
                model,
                backend,
                num_blocks=num_blocks,
                block_size=block_size,
                cuda_graphs=graphs,
                max_context=max_context,
                prefix_cache=prefix_cache,
            )
        except (MemoryError, torch.OutOfMemoryError) as exc:  # this variant's pool does not fit
            records.append(
                {
                    "variant": variant.name,
                    "backend": variant.backend,
                    "error": f"{type(exc).__name__}: {exc}",
                }
            )
            log(f"  serving {variant.name}: KV pool of {num_blocks} blocks does not fit: {exc}")
            on_record(records)
            continue
        effective = resolve(variant.config, variant.backend, wanted, registry)
        digest, kernels = effective.digest(), dict(effective.kernels)
        warm_up(engine, workloads, vocab, sync)
        for workload in workloads:
            if engine.device.type == "cuda":
                import torch

                torch.cuda.reset_peak_memory_stats()
            if engine.prefix_cache is not None:  # each workload starts with nothing cached
                engine.prefix_cache.clear()
            capturing = engine.graphs is not None and engine.graphs.settings.capture
            captured = engine.graphs.eager_steps if capturing else 0
            sync()  # each workload starts on an idle device
            summary = run_workload(
                engine,
                workload["arrivals"],
                vocab,
                workload["concurrency"],
                step_sync,
                shared_prefix=workload.get("shared_prefix", 0),
            )
            if capturing:  # capture steps inside the timed window (0 when warm-up met all)
                summary["graph_captures_in_window"] = engine.graphs.eager_steps - captured
            summary.update(
                variant=variant.name,
                backend=variant.backend,
                workload=workload["name"],
                config_digest=digest,
                kernels=kernels,
                memory=memory_breakdown(engine),
                graphs=engine.graphs.stats() if engine.graphs else None,
                align_decode_depths=engine.align_decode_depths,
            )
            records.append(summary)
            on_record(records)
            throughput, failed = summary["throughput_tokens_s"], summary["failed_requests"]
            log(
                f"  serving {variant.name:<40} {workload['name']:<28} "
                f"{throughput:8.1f} tok/s, failed {failed}"
            )
        del engine, backend
        gc.collect()  # the engine and its graph runner reference each other: free the pools
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return records


def pool_blocks(
    concurrency: int, tokens: int, block_size: int, depths: int, cached_prefix: int = 0
) -> int:
    """KV blocks for ``concurrency`` requests of ``tokens`` positions on ``depths`` planes,
    plus a published prefix of ``cached_prefix`` positions held by the prefix cache (so
    that admitting a request never evicts the prefix it is about to reuse)."""
    per_request = math.ceil(tokens / block_size) * depths
    return concurrency * per_request + math.ceil(cached_prefix / block_size) * depths + 8


def bench_serving(
    config,
    baseline: str,
    contexts: list[int],
    concurrency: list[int],
    new_tokens: int,
    layers: int | None,
    rate_per_s: float,
    log=print,
    on_partial: Callable[[dict], None] = lambda record: None,
    variant_keys: list[str] | None = None,
    prefix_cache: bool = False,
    shared_prefix: int = 0,
    sync_every_step: bool = False,
) -> dict:
    """The GPU record: a fixed-arrival mixed workload (prompts drawn from ``contexts``,
    outputs from new_tokens / 2 and new_tokens, 2 x max(concurrency) requests) and the
    closed-loop matrix contexts x concurrency (2 x concurrency requests each), on dense
    ``baseline`` and each feature of ``config`` alone and cumulatively, one process.
    ``on_partial`` receives the record after each workload; ``variant_keys`` runs only
    those variants (:func:`pick_variants`). ``prefix_cache``: engines share published
    prompt prefixes; ``shared_prefix`` > 0 adds, per context and concurrency, a closed loop
    whose prompts all start with the same that many tokens (SHARED_PREFIX_REQUESTS
    requests, or 2 x concurrency where more)."""

    import torch

    from flashloop_backend.tools.bench.bench_models import graph_variant, random_ouro
    from flashloop_backend.tools.bench.timing import environment_record

    if not config.enabled_features():
        raise ConfigError(
            "bench serving compares features with dense: --config must enable at least one"
        )
    if shared_prefix and shared_prefix >= min(contexts):  # refused before any GPU work
        raise ConfigError(f"shared_prefix={shared_prefix} must be below every context {contexts}")
    most = max(concurrency)
    tokens = max(contexts) + new_tokens
    baseline, graphs = graph_variant(baseline, most, tokens)
    variants = pick_variants(variants_for(config, baseline), variant_keys)  # before GPU work
    block_size = 16
    model, request = random_ouro(layers, block_size)
    num_blocks = pool_blocks(
        most, tokens, block_size, model.config.total_ut_steps, shared_prefix if prefix_cache else 0
    )
    outputs = sorted({max(1, new_tokens // 2), new_tokens})
    mixed = fixed_arrival_schedule(2 * most, rate_per_s, contexts, outputs)
    workloads = [{"name": f"fixed_arrival_{rate_per_s}/s", "concurrency": None, "arrivals": mixed}]
    workloads += [
        {
            "name": f"closed_ctx{ctx}_conc{conc}",
            "concurrency": conc,
            "arrivals": fixed_arrival_schedule(2 * conc, 1.0, [ctx], [new_tokens]),
        }
        for ctx in contexts
        for conc in concurrency
    ]
    if shared_prefix:
        workloads += [
            {
                "name": f"closed_shared{shared_prefix}_ctx{ctx}_conc{conc}",
                "concurrency": conc,
                "shared_prefix": shared_prefix,
                "arrivals": fixed_arrival_schedule(
                    max(SHARED_PREFIX_REQUESTS, 2 * conc), 1.0, [ctx], [new_tokens]
                ),
            }
            for ctx in contexts
            for conc in concurrency
        ]
    environment = environment_record()
    model_name = "Ouro-1.4B shapes, random bf16 weights" + (f", {layers} layers" if layers else "")
    host = "decode-only steps from CUDA graphs" if graphs else "eager host (no CUDA graphs)"
    method = (
        host + ", one engine per variant after an untimed warm-up; " + step_timing(sync_every_step)
    )

    def record(runs: list[dict]) -> dict:
        return {
            "kind": "serving",
            "environment": environment,
            "model": model_name,
            "kv_pool_blocks": num_blocks,
            "block_size": block_size,
            "new_tokens": new_tokens,
            "prefix_cache": prefix_cache,
            "method": method,
            "sync_every_step": sync_every_step,
            "config": config.model_dump(mode="json"),
            "runs": runs,
        }

    runs = serve_variants(
        model,
        request,
        variants,
        workloads,
        num_blocks=num_blocks,
        block_size=block_size,
        sync=torch.cuda.synchronize,
        log=log,
        graphs=graphs,
        max_context=tokens,
        on_record=lambda runs: on_partial(record(list(runs))),
        prefix_cache=prefix_cache,
        step_sync=step_wait(sync_every_step),
    )
    return record(runs)
