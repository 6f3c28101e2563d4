"""``bench kernel``: decode attention per layer call of each backend's kernel, side by side."""

from __future__ import annotations

import math

import torch

from flashloop_backend.capabilities import SupportRequest
from flashloop_backend.config import FlashLoopConfig
from flashloop_backend.registry import Registry, resolve
from flashloop_backend.tools.bench.timing import (
    BF16_FLOPS,
    HBM_BYTES_PER_S,
    ROTATION_BYTES,
    capture_calls,
    environment_record,
    require_cuda,
    sample_stats,
)


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
    device = require_cuda()
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
                    from flashloop_backend.kernels.flashinfer import planned_wrapper

                    wrapper = planned_wrapper(q.device)
                    fns[name] = lambda q, k, v, t, n, w=wrapper: w.run(q, (k, v))
                err = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
                if err > 2e-2:
                    raise RuntimeError(
                        f"{name} disagrees with {backends[0]} at ctx {ctx}: rel err {err:.3g}"
                    )
            graphs = {
                name: capture_calls(fn, q, caches, tables, lengths, calls_per_sample)
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
                st = sample_stats(ms)
                bw = bytes_read / (st["median_ms"] / 1e3)
                st.update(bandwidth_tb_s=bw / 1e12, fraction_of_hbm=bw / HBM_BYTES_PER_S)
                if graph_samples[name]:
                    gst = sample_stats(graph_samples[name])
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
            f"{ROTATION_BYTES >> 20} MiB of caches; flashinfer timed as run() after one plan "
            "per batch (how a runtime uses it across layers); triton timed through its full "
            "wrapper"
        ),
        "cases": cases,
    }
