"""Prefill attention per layer call: FlashInfer causal prefill of a whole prompt (the
dense baseline) against the Triton tiled kernel on the same rows and on token-sparse
subsets (queries at nonconsecutive positions attending to the whole logical KV), where
FlashInfer also runs each run of consecutive subset rows as one causal request.

TFLOP/s count the work each call actually does: 4 * H * D * sum of visible keys per row.
"""

from __future__ import annotations

import math

import torch

from flashloop_backend.tools.bench.timing import (
    BF16_FLOPS,
    eager_ms,
    environment_record,
    require_cuda,
)

HEADS, HEAD_DIM, BLOCK_SIZE, WINDOW = 16, 128, 16, 64


def windowed_subset(length: int, retention: float, gen: torch.Generator) -> torch.Tensor:
    """Sorted positions keeping ceil(retention * window) random positions of each 64-window."""
    chosen = []
    for start in range(0, length, WINDOW):
        size = min(WINDOW, length - start)
        keep = max(1, math.ceil(retention * size))
        pick = torch.randperm(size, generator=gen, device=gen.device)[:keep] + start
        chosen.append(pick)
    return torch.cat(chosen).sort().values


def _case(context: int, retention: list[float], gen: torch.Generator, log) -> dict:
    from flashloop_backend.kernels.flashinfer import paged_attention_flashinfer
    from flashloop_backend.kernels.triton.sparse_prefill import sparse_prefill_triton

    pages = math.ceil(context / BLOCK_SIZE)
    shape = (pages, BLOCK_SIZE, HEADS, HEAD_DIM)
    kc = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    vc = torch.randn(shape, device="cuda", dtype=torch.bfloat16, generator=gen)
    table = torch.randperm(pages, device="cuda", generator=gen).int()
    positions = torch.arange(context, device="cuda")
    q_all = torch.randn(
        context, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=gen
    )

    def rows(subset):
        return q_all[subset], table[None, :].expand(len(subset), -1), (subset + 1).int()

    def flops(subset) -> float:
        return 4.0 * HEADS * HEAD_DIM * float((subset + 1).sum())

    q, tables, lengths = rows(positions)
    dense_fi_ms = eager_ms(lambda: paged_attention_flashinfer(q, kc, vc, tables, lengths), 10, 3)
    dense_triton_ms = eager_ms(lambda: sparse_prefill_triton(q, kc, vc, tables, lengths), 10, 3)
    reference = paged_attention_flashinfer(q, kc, vc, tables, lengths).float()
    mine = sparse_prefill_triton(q, kc, vc, tables, lengths).float()
    dense_tflops = flops(positions) / (dense_fi_ms / 1e3) / 1e12
    record = {
        "context": context,
        "dense_flashinfer_ms": dense_fi_ms,
        "dense_flashinfer_tflops": dense_tflops,
        "dense_triton_tiled_ms": dense_triton_ms,
        "dense_triton_tiled_tflops": flops(positions) / (dense_triton_ms / 1e3) / 1e12,
        "triton_vs_flashinfer_max_abs_error": (mine - reference).abs().max().item(),
        "sparse": [],
    }
    log(
        f"  prefill ctx={context}: FlashInfer {dense_fi_ms:.2f} ms ({dense_tflops:.0f} TFLOP/s), "
        f"Triton tiled {dense_triton_ms:.2f} ms"
    )
    for value in retention:
        subset = windowed_subset(context, value, gen)
        q, tables, lengths = rows(subset)
        ms = eager_ms(
            lambda q=q, t=tables, n=lengths: sparse_prefill_triton(q, kc, vc, t, n), 10, 3
        )
        tflops = flops(subset) / (ms / 1e3) / 1e12
        # the second design: FlashInfer's paged prefill with each run of consecutive rows
        # as one causal request (kv_len = the run's last position + 1; its planner forms
        # the runs from consecutive lengths over one table)
        runs = int((subset[1:] != subset[:-1] + 1).sum()) + 1
        runs_ms = eager_ms(
            lambda q=q, t=tables, n=lengths: paged_attention_flashinfer(q, kc, vc, t, n), 10, 3
        )
        runs_error = (
            (
                paged_attention_flashinfer(q, kc, vc, tables, lengths).float()
                - sparse_prefill_triton(q, kc, vc, tables, lengths).float()
            )
            .abs()
            .max()
            .item()
        )
        subset_record = {
            "retention": value,
            "rows": len(subset),
            "runs": runs,
            "flashinfer_runs_ms": runs_ms,
            "flashinfer_runs_tflops": flops(subset) / (runs_ms / 1e3) / 1e12,
            "flashinfer_runs_vs_triton_max_abs_error": runs_error,
            "ms": ms,
            "tflops": tflops,
            "tflops_vs_dense_flashinfer": tflops / dense_tflops,
            "fraction_of_bf16_peak": tflops * 1e12 / BF16_FLOPS,
            "time_vs_dense_flashinfer": ms / dense_fi_ms,
        }
        record["sparse"].append(subset_record)
        log(
            f"    retention {value}: {ms:.2f} ms, {tflops:.0f} TFLOP/s "
            f"({tflops / dense_tflops:.2f} of FlashInfer's); FlashInfer over {runs} runs "
            f"{runs_ms:.2f} ms"
        )
    return record


def bench_prefill_attention(contexts: list[int], retention: list[float], log=print) -> dict:
    """One record per context; every candidate timed in the same process on the same KV."""
    require_cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for context in contexts:
        cases.append(_case(context, retention, gen, log))
        torch.cuda.empty_cache()
    return {
        "kind": "prefill_attention_per_layer",
        "environment": environment_record(),
        "shapes": {
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "block_size": BLOCK_SIZE,
            "dtype": "bfloat16",
            "selection_window": WINDOW,
        },
        "method": "CUDA-event medians of 10 samples x 3 calls (eager; FlashInfer planned once)",
        "cases": cases,
    }
