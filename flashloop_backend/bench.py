"""Benchmarks: attention per layer call (kernel level) and end to end through the host.

Candidates run interleaved in one process (round robin per repetition) so every ratio is
measured side by side. Times come from CUDA events after warm-up; each sample times
``calls_per_sample`` back-to-back launches. Caches rotate among copies that together
exceed the L2 cache, so the numbers are HBM numbers.
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import time
from importlib.metadata import PackageNotFoundError, version

import torch

from . import __version__
from .capabilities import Capability, SupportRequest
from .config import ConfigError, FlashLoopConfig
from .registry import Registry, resolve

HBM_BYTES_PER_S = 4.3e12  # H200 copy bandwidth measured on the test machine (DESIGN §6)
BF16_FLOPS = 790e12
ROTATION_BYTES = 512 * 2**20  # > 4x the H200's 50 MB L2


def environment_record() -> dict:
    versions = {"flashloop_backend": __version__, "torch": torch.__version__}
    for name, dist in (("triton", "triton"), ("flashinfer", "flashinfer-python")):
        try:
            versions[name] = version(dist)
        except PackageNotFoundError:
            versions[name] = None
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"gpu": gpu, "versions": versions, "date": time.strftime("%Y-%m-%d")}


def _require_cuda() -> torch.device:
    if not torch.cuda.is_available():
        raise ConfigError(
            "benchmarks time GPU kernels with CUDA events; no CUDA GPU is available here"
        )
    return torch.device("cuda")


def _stats(samples_ms: list[float]) -> dict:
    ordered = sorted(samples_ms)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {
        "median_ms": statistics.median(ordered),
        "p10_ms": pick(0.1),
        "p90_ms": pick(0.9),
        "samples": len(ordered),
    }


def bench_decode_kernels(
    backends: list[str],
    contexts: list[int],
    concurrency: list[int],
    heads: int = 16,
    kv_heads: int = 16,
    head_dim: int = 128,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    repeats: int = 30,
    calls_per_sample: int = 10,
    log=print,
) -> dict:
    """Dense paged decode attention, one query per row: the per-layer cost of a decode step."""
    device = _require_cuda()
    registry = Registry.discover()
    request = SupportRequest("cuda", dtype, head_dim, block_size, heads, kv_heads)
    backends_by_name = {
        name: registry.create(name, request, FlashLoopConfig()) for name in backends
    }
    digest = resolve(FlashLoopConfig(), backends[0], request, registry).digest()
    gen = torch.Generator(device=device).manual_seed(0)
    cases = []
    for ctx in contexts:
        for conc in concurrency:
            fns = dict(backends_by_name)
            pages = math.ceil(ctx / block_size)
            cache_bytes = (
                2 * conc * pages * block_size * kv_heads * head_dim * torch.finfo(dtype).bits // 8
            )
            copies = max(1, math.ceil(ROTATION_BYTES / cache_bytes))
            caches = [
                tuple(
                    torch.randn(
                        conc * pages,
                        block_size,
                        kv_heads,
                        head_dim,
                        device=device,
                        dtype=dtype,
                        generator=gen,
                    )
                    for _ in range(2)
                )
                for _ in range(copies)
            ]
            tables = (
                torch.randperm(conc * pages, device=device, generator=gen)
                .int()
                .reshape(conc, pages)
            )
            lengths = torch.full((conc,), ctx, dtype=torch.int32, device=device)
            q = torch.randn(conc, heads, head_dim, device=device, dtype=dtype, generator=gen)
            reference = None
            for name in list(fns):  # warm-up (JIT, FlashInfer plan) and agreement
                out = fns[name](q, *caches[0], tables, lengths)
                reference = out if reference is None else reference
                if name == "flashinfer":
                    # FlashInfer plans once per batch on the host and runs per layer: time the run.
                    from .kernels.flashinfer import _INSTANCES

                    wrapper = _INSTANCES[q.device].decode
                    fns[name] = lambda q, k, v, t, n, w=wrapper: w.run(q, (k, v))
                err = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
                if err > 2e-2:
                    raise RuntimeError(
                        f"{name} disagrees with {backends[0]} at ctx {ctx}: rel err {err:.3g}"
                    )
            graphs = {
                name: _capture(fn, q, caches, tables, lengths, calls_per_sample)
                for name, fn in fns.items()
            }
            samples: dict[str, list[float]] = {name: [] for name in fns}
            graph_samples: dict[str, list[float]] = {name: [] for name in fns}
            for rep in range(repeats):
                for name, fn in fns.items():
                    start, end = (
                        torch.cuda.Event(enable_timing=True),
                        torch.cuda.Event(enable_timing=True),
                    )
                    start.record()
                    for i in range(calls_per_sample):
                        fn(q, *caches[(rep * calls_per_sample + i) % copies], tables, lengths)
                    end.record()
                    end.synchronize()
                    samples[name].append(start.elapsed_time(end) / calls_per_sample)
                    graph = graphs[name]
                    if isinstance(graph, torch.cuda.CUDAGraph):
                        start.record()
                        graph.replay()
                        end.record()
                        end.synchronize()
                        graph_samples[name].append(start.elapsed_time(end) / calls_per_sample)
            bytes_read = cache_bytes + 2 * q.numel() * q.element_size()
            row = {"context": ctx, "concurrency": conc, "bytes_per_call": bytes_read, "results": {}}
            for name, ms in samples.items():
                st = _stats(ms)
                bw = bytes_read / (st["median_ms"] / 1e3)
                st.update(bandwidth_tb_s=bw / 1e12, fraction_of_hbm=bw / HBM_BYTES_PER_S)
                if graph_samples[name]:
                    gst = _stats(graph_samples[name])
                    gbw = bytes_read / (gst["median_ms"] / 1e3)
                    st["graph"] = {
                        **gst,
                        "bandwidth_tb_s": gbw / 1e12,
                        "fraction_of_hbm": gbw / HBM_BYTES_PER_S,
                    }
                else:
                    st["graph"] = {"unavailable": str(graphs[name])}
                row["results"][name] = st
            base = row["results"][backends[0]]["median_ms"]
            base_graph = row["results"][backends[0]]["graph"].get("median_ms")
            for name in fns:
                result = row["results"][name]
                result["time_vs_" + backends[0]] = result["median_ms"] / base
                if base_graph and "median_ms" in result["graph"]:
                    result["graph"]["time_vs_" + backends[0]] = (
                        result["graph"]["median_ms"] / base_graph
                    )
            cases.append(row)
            summary = ", ".join(
                f"{n} {r['median_ms'] * 1e3:.1f} us {r['bandwidth_tb_s']:.2f} TB/s"
                f" (graph {r['graph'].get('median_ms', float('nan')) * 1e3:.1f} us)"
                for n, r in row["results"].items()
            )
            log(f"  decode ctx={ctx} conc={conc}: {summary}")
            del caches
            torch.cuda.empty_cache()
    return {
        "kind": "decode_attention_per_layer",
        "environment": environment_record(),
        "shapes": {
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "block_size": block_size,
            "dtype": str(dtype),
        },
        "limits": {"hbm_bytes_per_s": HBM_BYTES_PER_S, "bf16_flops": BF16_FLOPS},
        "config_digest": digest,
        "method": (
            f"CUDA events, {repeats} samples x {calls_per_sample} calls, interleaved, rotating "
            f"{ROTATION_BYTES >> 20} MiB of caches; flashinfer timed as run() after one plan per batch "
            "(how a runtime uses it across layers); triton timed through its full wrapper"
        ),
        "cases": cases,
    }


def _capture(fn, q, caches, tables, lengths, calls: int):
    """A CUDA graph of ``calls`` launches over the rotating caches, or why none could be made
    (graph timing removes host launch overhead, which dominates small shapes)."""
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls):
                fn(q, *caches[i % len(caches)], tables, lengths)
        return graph
    except Exception as exc:  # a kernel that cannot be captured is reported, not fatal
        torch.cuda.synchronize()
        return f"{type(exc).__name__}: {exc}"[:200]


def ouro_1p4b_shapes(layers: int | None = None):
    from .host.config import OuroConfig

    return OuroConfig(
        hidden_size=2048, num_hidden_layers=layers or 24, num_attention_heads=16, num_key_value_heads=16,
        head_dim=128, intermediate_size=5632, vocab_size=49152, rope_theta=1e6, total_ut_steps=4,
        max_position_embeddings=65536,
    )  # fmt: skip


def _timed_workload(engine, prompts, new_tokens, kv_probe: list | None = None):
    """Submit every prompt at once; (ids, first-token times, finish times, total seconds).
    ``kv_probe`` receives (tokens, KV bytes held) once, at the step where every request has
    its first token (``Engine.kv_held``: one host call inside the timed window)."""
    from .host.engine import SamplingParams

    ids = [
        engine.add_request(p, SamplingParams(max_new_tokens=new_tokens, ignore_eos=True))
        for p in prompts
    ]
    first: dict[int, float] = {}
    done: dict[int, float] = {}
    start = time.perf_counter()
    while engine.has_unfinished():
        finished = engine.step()
        torch.cuda.synchronize()
        now = time.perf_counter() - start
        for rid in ids:
            r = engine._requests.get(rid)
            if rid not in first and (r is None or r.output):
                first[rid] = now
        for f in finished:
            done[f.request_id] = now
        if kv_probe is not None and not kv_probe and len(first) == len(ids):
            kv_probe.append(engine.kv_held())
    return ids, first, done, time.perf_counter() - start


def random_ouro(layers: int | None, block_size: int):
    """Ouro-1.4B shapes with random bf16 weights on the GPU (no download), and the
    matching support request."""
    from .host.model import OuroModel

    device = _require_cuda()
    cfg = ouro_1p4b_shapes(layers)
    torch.manual_seed(0)
    with torch.device(device):
        model = OuroModel(cfg).to(torch.bfloat16).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    request = SupportRequest("cuda", torch.bfloat16, cfg.head_dim, block_size,
                             cfg.num_attention_heads, cfg.num_key_value_heads)  # fmt: skip
    return model, request


def graph_variant(name: str, concurrency: int, max_context: int):
    """(backend name, GraphSettings or None) of a benchmark entry: ``name+graphs`` captures
    buckets of powers of two up to ``concurrency`` for contexts up to ``max_context``."""
    from .host.graphs import GraphSettings

    base, _, suffix = name.partition("+")
    if suffix not in ("", "graphs"):
        raise ConfigError(f"benchmark entry {name!r}: the only suffix is '+graphs'")
    if not suffix:
        return base, None
    buckets = tuple(2**i for i in range(math.ceil(math.log2(max(1, concurrency))) + 1))
    return base, GraphSettings(buckets=buckets, max_context=max_context)


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
    it compiles kernels and captures graphs, whose shapes do not depend on prompt length."""
    from .host.engine import Engine

    for name, value in (("max_batch_tokens", max_batch_tokens), ("warmup_context", warmup_context)):
        if value is not None and value < 1:
            raise ConfigError(f"{name}={value} must be >= 1 (or left unset for the default)")
    max_batch_tokens = max_batch_tokens or concurrency * prefill_chunk

    model, request = random_ouro(layers, block_size)
    cfg = model.config
    registry = Registry.discover()
    tokens_per_request = context + new_tokens
    num_blocks = concurrency * math.ceil(tokens_per_request / block_size) * cfg.total_ut_steps + 8
    prompts = [torch.randint(0, cfg.vocab_size, (context,)).tolist() for _ in range(concurrency)]
    warm_prompts = [p[: warmup_context or context] for p in prompts]
    results = {}
    for name in backends:
        base, graphs = graph_variant(name, concurrency, tokens_per_request)
        effective = (config or FlashLoopConfig()) if base == "flashloop" else FlashLoopConfig()
        wanted = request.with_required({Capability.CUDA_GRAPHS}) if graphs else request
        backend = registry.create(base, wanted, effective)
        engine = Engine(model, backend, num_blocks=num_blocks, block_size=block_size,
                        max_batch_tokens=max_batch_tokens, prefill_chunk=prefill_chunk,
                        cuda_graphs=graphs, max_context=tokens_per_request)  # fmt: skip
        # an untimed pass of the same workload first: Triton and FlashInfer compile on first
        # use, and a compile inside TTFT would say nothing about serving
        *_, warm_s = _timed_workload(engine, warm_prompts, new_tokens)
        log(f"  e2e {name} ctx={context} conc={concurrency}: warm-up pass {warm_s:.1f} s")
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        warm_steps = engine.steps
        if engine.graphs is not None:
            engine.graphs.time_replays()
        probe: list[tuple[int, int]] = []
        ids, first, done, total = _timed_workload(engine, prompts, new_tokens, probe)
        ttft = [first[i] for i in ids]
        tpot = [(done[i] - first[i]) / max(1, new_tokens - 1) for i in ids]
        results[name] = {
            "prefill_latency_s": max(ttft), "ttft_s": {"median": statistics.median(ttft), "max": max(ttft)},
            "tpot_ms": {"median": 1e3 * statistics.median(tpot), "max": 1e3 * max(tpot)},
            "throughput_tokens_s": concurrency * new_tokens / total, "total_s": total, "host_steps": engine.steps - warm_steps,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            "kv_bytes_per_token": engine.kv.bytes_per_token(), "failed_requests": concurrency - len(done),
            # once every prompt is in: BF16 blocks in use + packed steady bytes (KV quantization)
            "kv_held_bytes_per_token": probe[0][1] / probe[0][0] if probe else None,
            "config_digest": resolve(effective, base, wanted, registry).digest(),
            "graphs": engine.graphs.stats() if engine.graphs else None,
            "replay_ms_by_key": engine.graphs.replay_ms() if engine.graphs else None,
            "prefill_speedup_vs_first": results[backends[0]]["prefill_latency_s"] / max(ttft)
            if backends[0] in results else 1.0,
        }  # fmt: skip
        log(f"  e2e {name} ctx={context} conc={concurrency}: TTFT {statistics.median(ttft):.3f} s, "
            f"TPOT {results[name]['tpot_ms']['median']:.1f} ms, {results[name]['throughput_tokens_s']:.1f} tok/s")  # fmt: skip
        del engine, backend
        gc.collect()  # the engine and its graph runner reference each other: free the caches now
        torch.cuda.empty_cache()
    return {
        "kind": "end_to_end_host", "environment": environment_record(),
        "model": "Ouro-1.4B shapes, random bf16 weights" + (f", {layers} layers" if layers else ""),
        "context": context, "concurrency": concurrency, "new_tokens": new_tokens, "prefill_chunk": prefill_chunk,
        "max_batch_tokens": max_batch_tokens, "warmup_context": warmup_context or context, "method": "timed pass after an untimed warm-up pass (prompts cut to warmup_context) per backend, same process",
        "config": (config or FlashLoopConfig()).model_dump(mode="json"), "results": results,
    }  # fmt: skip


def progress_log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _graph_ms(fn, reps: int = 30, calls: int = 10) -> float:
    """Median ms per call of ``fn`` replayed from a CUDA graph of ``calls`` launches."""
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def _eager_ms(fn, reps: int = 30, calls: int = 10) -> float:
    fn()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / calls)
    return statistics.median(samples)


def _dense_source_designs(q, kc, vc, tables, lengths, ratio, bucket) -> dict:
    """Side-by-side timings of the dense-source designs and of plain Triton decode."""
    from .kernels.triton import dense_source as designs
    from .kernels.triton.paged_decode import paged_attention_triton

    split = designs.SelectTuning(split_min_span=0)  # the split design at every span

    timed = {
        "triton_dense_no_statistics": lambda: paged_attention_triton(q, kc, vc, tables, lengths),
        "radix_select": lambda: designs.dense_source_triton(
            q, kc, vc, tables, lengths, ratio, bucket
        ),
        "split_select": lambda: designs.dense_source_triton(
            q, kc, vc, tables, lengths, ratio, bucket, tuning=split
        ),
        "torch_topk": lambda: designs.dense_source_torch_topk(
            q, kc, vc, tables, lengths, ratio, bucket
        ),
    }
    result = {}
    for name, fn in timed.items():
        try:
            result[name] = _graph_ms(fn)
        except Exception as exc:  # recorded, not fatal: one design failing keeps the others
            torch.cuda.synchronize()
            result[name] = f"{type(exc).__name__}: {exc}"[:200]
    return result


def _sparse_case(ctx, conc, ratio, backend, gen) -> dict:
    from .kernels.flashinfer import _INSTANCES, paged_attention_flashinfer
    from .kernels.ops import OpName
    from .sparse_state import key_bucket

    heads, dim, bs, dtype = 16, 128, 16, torch.bfloat16
    source_fn = backend.kernels[OpName.DENSE_SOURCE].impl.fn
    correct_fn = backend.kernels[OpName.SPARSE_CORRECTION].impl.fn
    pages = math.ceil(ctx / bs)
    shape = (conc * pages, bs, heads, dim)
    kc = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    vc = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    tables = torch.randperm(conc * pages, device="cuda", generator=gen).int().reshape(conc, pages)
    lengths = torch.full((conc,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(conc, heads, dim, device="cuda", dtype=dtype, generator=gen)
    bucket = key_bucket(ratio, ctx)
    paged_attention_flashinfer(q, kc, vc, tables, lengths)
    wrapper = _INSTANCES[q.device].decode
    dense_ms = _graph_ms(lambda: wrapper.run(q, (kc, vc)))
    _, idx, mass, ref_out, contribution = source_fn(q, kc, vc, tables, lengths, ratio, bucket)
    correct_ms = _graph_ms(lambda: correct_fn(q, kc, vc, tables, idx, mass, ref_out, contribution))

    def source():
        return source_fn(q, kc, vc, tables, lengths, ratio, bucket)

    try:
        source_ms, source_mode = _graph_ms(source), "graph"
    except Exception:  # an implementation that cannot be captured is timed eagerly
        torch.cuda.synchronize()
        source_ms, source_mode = _eager_ms(source, reps=5, calls=1), "eager"
    designs = _dense_source_designs(q, kc, vc, tables, lengths, ratio, bucket)
    # with unchanged K/V the correction must give back the dense output exactly
    dense_out = wrapper.run(q, (kc, vc)).float()
    self_check = correct_fn(q, kc, vc, tables, idx, mass, ref_out, contribution).float()
    self_check_error = (self_check - dense_out).abs().max().item()
    selected_bytes = conc * heads * bucket * dim * 2 * 2 + idx.numel() * 4
    return {
        "context": ctx, "concurrency": conc, "ratio": ratio, "key_bucket": bucket,
        "dense_flashinfer_ms": dense_ms,
        "sparse_correction_ms": correct_ms,
        "sparse_correction_speedup": dense_ms / correct_ms,
        "sparse_correction_tb_s": selected_bytes / (correct_ms / 1e3) / 1e12,
        "dense_source_ms": source_ms, "dense_source_timing": source_mode,
        "dense_source_vs_dense": source_ms / dense_ms,
        "dense_source_impl": backend.kernels[OpName.DENSE_SOURCE].provider.name,
        "dense_source_designs_ms": designs,
        "correction_vs_dense_max_abs_error": self_check_error,
        "sparse_correction_impl": backend.kernels[OpName.SPARSE_CORRECTION].provider.name,
        # loop 1 dense, loop 2 the dense source, loops 3 and 4 the correction
        "four_loop_speedup": 4 * dense_ms / (dense_ms + source_ms + 2 * correct_ms),
    }  # fmt: skip


def bench_sparse_decode(
    contexts: list[int], concurrency: list[int], ratio: float = 0.10, log=print
) -> dict:
    """Sparse decode per layer call vs FlashInfer dense decode of the same rows: the loop-3/4
    sparse correction, the loop-2 dense source with statistics (each as the registry selects
    it), and the 4-loop sum (2 dense + source + 2 corrections)."""
    _require_cuda()
    registry = Registry.discover()
    config = FlashLoopConfig(sparse_decode_attention={"enabled": True, "key_retention": ratio})
    request = SupportRequest("cuda", torch.bfloat16, 128, 16, 16, 16)
    backend = registry.create("flashloop", request, config)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for ctx in contexts:
        for conc in concurrency:
            row = _sparse_case(ctx, conc, ratio, backend, gen)
            cases.append(row)
            log(f"  sparse ctx={ctx} conc={conc}: dense {row['dense_flashinfer_ms'] * 1e3:.1f} us, correction "
                f"{row['sparse_correction_ms'] * 1e3:.1f} us (x{row['sparse_correction_speedup']:.2f}), source "
                f"{row['dense_source_ms'] * 1e3:.1f} us ({row['dense_source_timing']}), 4-loop x{row['four_loop_speedup']:.2f}")  # fmt: skip
            torch.cuda.empty_cache()
    return {"kind": "sparse_decode_per_layer", "environment": environment_record(), "ratio": ratio,
            "shapes": {"heads": 16, "head_dim": 128, "block_size": 16, "dtype": "bfloat16"},
            "method": "CUDA-graph replay medians (30 x 10 calls); states from the selected dense_source",
            "config_digest": resolve(config, "flashloop", request, registry).digest(), "cases": cases}  # fmt: skip
