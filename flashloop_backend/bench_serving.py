"""Serving benchmark through the host: a fixed-arrival mixed workload (requests arrive at a
fixed rate with mixed prompt and output lengths) and a closed loop (a fixed number of
requests in flight). Per request: TTFT, TPOT, inter-token latencies, end-to-end latency;
per run: throughput, percentiles, failed requests and a memory breakdown.

The workload functions take any engine, so the same code runs the embedded model on CPU
(tests) and Ouro-1.4B shapes on the GPU (``flashloop-backend bench serving``)."""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .config import ConfigError


@dataclass(frozen=True)
class Arrival:
    at_s: float  # seconds after the run starts
    prompt_len: int
    output_len: int


def fixed_arrival_schedule(requests: int, rate_per_s: float, prompt_lens: list[int],
                           output_lens: list[int], seed: int = 0) -> list[Arrival]:  # fmt: skip
    """``requests`` arrivals 1/rate apart, lengths drawn (seeded) from the given lists."""
    if requests <= 0 or rate_per_s <= 0:
        raise ValueError(f"requests={requests} and rate_per_s={rate_per_s} must be positive")
    if not prompt_lens or not output_lens or min(prompt_lens + output_lens) <= 0:
        raise ValueError(
            f"prompt_lens={prompt_lens} and output_lens={output_lens} need positive lengths"
        )
    rng = random.Random(seed)
    return [Arrival(i / rate_per_s, rng.choice(prompt_lens), rng.choice(output_lens)) for i in range(requests)]  # fmt: skip


@dataclass
class RequestTimes:
    arrival_s: float
    prompt_len: int
    token_s: list[float] = field(default_factory=list)  # time of each output token
    finished_s: float | None = None
    error: str | None = None


def _percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": statistics.median(ordered), "p99": at(0.99), "mean": statistics.fmean(ordered)}


def summarize(times: list[RequestTimes], wall_s: float) -> dict:
    """Latency percentiles (seconds; TPOT and ITL in ms), throughput and failures."""
    ok = [t for t in times if t.error is None and t.finished_s is not None]
    ttft = [t.token_s[0] - t.arrival_s for t in ok if t.token_s]
    tpot = [
        1e3 * (t.token_s[-1] - t.token_s[0]) / (len(t.token_s) - 1)
        for t in ok
        if len(t.token_s) > 1
    ]
    itl = [1e3 * (b - a) for t in ok for a, b in zip(t.token_s, t.token_s[1:], strict=False)]
    tokens = sum(len(t.token_s) for t in ok)
    return {
        "requests": len(times), "completed": len(ok), "failed_requests": len(times) - len(ok),
        "errors": sorted({t.error for t in times if t.error}),
        "ttft_s": _percentiles(ttft), "tpot_ms": _percentiles(tpot), "itl_ms": _percentiles(itl),
        "latency_s": _percentiles([t.finished_s - t.arrival_s for t in ok]),
        "output_tokens": tokens, "throughput_tokens_s": tokens / wall_s if wall_s > 0 else 0.0,
        "wall_s": wall_s,
    }  # fmt: skip


def run_workload(engine, arrivals: list[Arrival], vocab_size: int,
                 concurrency: int | None = None, sync: Callable[[], None] = lambda: None,
                 seed: int = 0, clock: Callable[[], float] = time.perf_counter) -> dict:  # fmt: skip
    """Drive ``engine`` with ``arrivals``. ``concurrency`` None: open loop (each request
    enters at its arrival time); an int: closed loop (arrival times ignored, at most that
    many in flight, the next one entering when one finishes). A request the engine
    refuses counts as failed with its reason; the run goes on. ``kv_held``: the most KV
    bytes the live requests held after any step (``Engine.kv_held``: BF16 blocks in use
    plus the packed store's steady bytes), with their tokens; the probe's host time is
    kept off the latency clock."""
    from .host.engine import SamplingParams

    rng = random.Random(seed)
    times: list[RequestTimes] = []
    live: dict[int, RequestTimes] = {}
    pending = list(arrivals)
    held = (0, 0)  # (tokens, bytes) at the largest bytes seen
    start = clock()
    while pending or engine.has_unfinished():
        now = clock() - start
        while pending and (
            len(live) < concurrency if concurrency is not None else pending[0].at_s <= now
        ):
            arrival = pending.pop(0)
            entry = RequestTimes(
                now if concurrency is not None else arrival.at_s, arrival.prompt_len
            )
            times.append(entry)
            prompt = [rng.randrange(vocab_size) for _ in range(arrival.prompt_len)]
            try:
                params = SamplingParams(max_new_tokens=arrival.output_len, ignore_eos=True)
                live[engine.add_request(prompt, params)] = entry
            except (ValueError, MemoryError) as exc:
                entry.error = f"{type(exc).__name__}: {exc}"
        if not engine.has_unfinished():
            if pending and concurrency is None:  # idle until the next arrival
                time.sleep(max(0.0, pending[0].at_s - (clock() - start)))
            continue
        finished = engine.step()
        sync()
        now = clock() - start
        probe = clock()
        tokens, held_bytes = engine.kv_held()
        held = max(held, (tokens, held_bytes), key=lambda h: h[1])
        start += clock() - probe
        for rid, entry in live.items():
            request = engine._requests.get(rid)
            produced = len(request.output) if request is not None else None
            if produced is not None and produced > len(entry.token_s):
                entry.token_s.extend([now] * (produced - len(entry.token_s)))
        for result in finished:
            entry = live.pop(result.request_id, None)
            if entry is not None:
                missing = len(result.output_token_ids) - len(entry.token_s)
                entry.token_s.extend([now] * missing)
                entry.finished_s = now
    summary = summarize(times, clock() - start)
    summary["kv_held"] = {"peak_bytes": held[1], "tokens_at_peak": held[0],
                          "bytes_per_token_at_peak": held[1] / held[0] if held[0] else None}  # fmt: skip
    return summary


def memory_breakdown(engine) -> dict:
    """Bytes the engine and backend hold, from their tensors: the weights, the BF16 KV
    pools, the packed store (pools, and what its pages hold now), the loop-2 reference
    states; the memory CUDA-graph captures added to the reserved pool; on a GPU the CUDA
    peaks and the transient peak above the standing tensors (activations, conversion
    scratch). The steady KV the requests held is the workload's ``kv_held``."""
    import torch

    backend = engine.backend
    packed = getattr(backend, "packed", None)
    states = getattr(backend, "states", None)
    record = {
        "model_bytes": sum(p.numel() * p.element_size() for p in engine.model.parameters()),
        "kv_pool_bytes": sum(t.numel() * t.element_size() for t in (engine.kv.key_pool, engine.kv.value_pool)),
        "packed_pool_bytes": sum(t.numel() * t.element_size() for t in packed.store.pools) if packed else 0,
        "packed_steady_bytes": packed.store.accounting()["steady_bytes"] if packed else 0,
        "reference_state_bytes": states.nbytes() if states is not None else 0,
        "graph_bytes": engine.graphs.graph_bytes if engine.graphs else 0,
    }  # fmt: skip
    if engine.device.type == "cuda":
        record["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        record["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        # above what stays allocated (weights, pools, reference state): activations and
        # the prompt conversion's scratch (graph_bytes is reported apart, not subtracted)
        standing = sum(record[k] for k in ("model_bytes", "kv_pool_bytes", "packed_pool_bytes",
                                           "reference_state_bytes"))  # fmt: skip
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
    from .config import FlashLoopConfig
    from .evaluation import feature_combinations

    combos = dict(feature_combinations(config))
    enabled = config.enabled_features()
    out = [Variant("dense", baseline, FlashLoopConfig()),
           Variant("flashloop_dense", "flashloop", FlashLoopConfig())]  # fmt: skip
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


def serve_variants(model, request, variants: list[Variant], workloads: list[dict], num_blocks: int,
                   block_size: int, sync=lambda: None, log=print, graphs=None, max_context=None,
                   on_record: Callable[[list[dict]], None] = lambda records: None) -> list[dict]:  # fmt: skip
    """Every workload on every variant, one engine per variant after an untimed
    :func:`warm_up` (kernels compile and graphs are captured on first use). ``workloads``: dicts with ``name``,
    ``arrivals`` and ``concurrency`` (None = open loop). ``on_record`` receives the
    records so far after each workload (a run cut mid-variant keeps what it measured). ``graphs``
    (GraphSettings): every variant replays decode steps from CUDA graphs, its kernels
    chosen with the ``cuda_graphs`` capability."""
    import torch

    from .capabilities import Capability
    from .host.engine import Engine
    from .registry import Registry, resolve

    registry = Registry.discover()
    vocab = model.config.vocab_size
    records = []
    for variant in variants:
        wanted = request.with_required({Capability.CUDA_GRAPHS}) if graphs else request
        backend = registry.create(variant.backend, wanted, variant.config)
        try:
            engine = Engine(model, backend, num_blocks=num_blocks, block_size=block_size,
                            cuda_graphs=graphs, max_context=max_context)  # fmt: skip
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
            capturing = engine.graphs is not None and engine.graphs.settings.capture
            captured = engine.graphs.stats()["eager_steps"] if capturing else 0
            summary = run_workload(
                engine, workload["arrivals"], vocab, workload["concurrency"], sync
            )
            if capturing:  # capture steps inside the timed window (0 when warm-up met all)
                summary["graph_captures_in_window"] = (
                    engine.graphs.stats()["eager_steps"] - captured
                )
            summary.update(variant=variant.name, backend=variant.backend, workload=workload["name"],
                           config_digest=digest, kernels=kernels, memory=memory_breakdown(engine),
                           graphs=engine.graphs.stats() if engine.graphs else None)  # fmt: skip
            records.append(summary)
            on_record(records)
            log(f"  serving {variant.name:<40} {workload['name']:<28} "
                f"{summary['throughput_tokens_s']:8.1f} tok/s, failed {summary['failed_requests']}")  # fmt: skip
        del engine, backend
        gc.collect()  # the engine and its graph runner reference each other: free the pools
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return records


def bench_serving(config, baseline: str, contexts: list[int], concurrency: list[int],
                  new_tokens: int, layers: int | None, rate_per_s: float, log=print,
                  on_partial: Callable[[dict], None] = lambda record: None,
                  variant_keys: list[str] | None = None) -> dict:  # fmt: skip
    """The GPU record: a fixed-arrival mixed workload (prompts drawn from ``contexts``,
    outputs from new_tokens / 2 and new_tokens, 2 x max(concurrency) requests) and the
    closed-loop matrix contexts x concurrency (2 x concurrency requests each), on dense
    ``baseline`` and each feature of ``config`` alone and cumulatively, one process.
    ``on_partial`` receives the record after each workload; ``variant_keys`` runs only
    those variants (:func:`pick_variants`)."""
    import math

    import torch

    from .bench import environment_record, graph_variant, random_ouro

    if not config.enabled_features():
        raise ConfigError("bench serving compares features with dense: --config must enable at least one")  # fmt: skip
    most = max(concurrency)
    tokens = max(contexts) + new_tokens
    baseline, graphs = graph_variant(baseline, most, tokens)
    variants = pick_variants(variants_for(config, baseline), variant_keys)  # before GPU work
    block_size = 16
    model, request = random_ouro(layers, block_size)
    num_blocks = most * math.ceil(tokens / block_size) * model.config.total_ut_steps + 8
    outputs = sorted({max(1, new_tokens // 2), new_tokens})
    workloads = [{"name": f"fixed_arrival_{rate_per_s}/s", "concurrency": None,
                  "arrivals": fixed_arrival_schedule(2 * most, rate_per_s, contexts, outputs)}]  # fmt: skip
    workloads += [
        {"name": f"closed_ctx{ctx}_conc{conc}", "concurrency": conc,
         "arrivals": fixed_arrival_schedule(2 * conc, 1.0, [ctx], [new_tokens])}
        for ctx in contexts for conc in concurrency
    ]  # fmt: skip
    environment = environment_record()

    def record(runs: list[dict]) -> dict:
        return {
            "kind": "serving", "environment": environment,
            "model": "Ouro-1.4B shapes, random bf16 weights" + (f", {layers} layers" if layers else ""),
            "kv_pool_blocks": num_blocks, "block_size": block_size, "new_tokens": new_tokens,
            "method": ("decode-only steps from CUDA graphs" if graphs else "eager host (no CUDA graphs)")
            + ", one engine per variant after an untimed warm-up",
            "config": config.model_dump(mode="json"), "runs": runs,
        }  # fmt: skip

    runs = serve_variants(model, request, variants, workloads, num_blocks,
                          block_size, sync=torch.cuda.synchronize, log=log, graphs=graphs,
                          max_context=tokens,
                          on_record=lambda runs: on_partial(record(list(runs))))  # fmt: skip
    return record(runs)
