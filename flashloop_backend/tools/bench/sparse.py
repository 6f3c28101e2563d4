"""``bench sparse``: the sparse-decode ops (loop-2 source with statistics, loop 3-4
correction) against a dense decode of the same rows."""

from __future__ import annotations

import dataclasses
import math

import torch

from flashloop_backend.capabilities import SupportRequest
from flashloop_backend.config import FlashLoopConfig
from flashloop_backend.registry import Registry, resolve
from flashloop_backend.tools.bench.timing import (
    eager_ms,
    environment_record,
    graph_ms,
    require_cuda,
)


def _dense_source_designs(q, kc, vc, tables, lengths, key_retention, bucket) -> dict:
    """Side-by-side timings of the registered dense source (keys-only attention, selection,
    value pass) at two value-pass steps, plain Triton decode, and the attention pass with
    logits alone, over keys and values and over keys only (as the registered source does).
    The designs it replaced (sorted bracket, split radix select, torch topk) left the
    package; results/README.md keeps their figures."""
    from flashloop_backend.kernels.triton.dense_source import (
        DEFAULT_SELECT,
        dense_source_triton,
        logits_and_output,
    )
    from flashloop_backend.kernels.triton.paged_decode import paged_attention_triton

    span = tables.shape[1] * kc.shape[1]
    narrow = dataclasses.replace(DEFAULT_SELECT, value_block=64)
    timed = {
        "triton_dense_no_statistics": lambda: paged_attention_triton(q, kc, vc, tables, lengths),
        # the attention passes of the two source designs alone
        "attention_with_logits": lambda: logits_and_output(q, kc, vc, tables, lengths, None, span),
        "keys_only_with_logits": lambda: logits_and_output(
            q, kc, vc, tables, lengths, None, span, read_values=False
        ),
        "threshold_split": lambda: dense_source_triton(
            q, kc, vc, tables, lengths, key_retention, bucket
        ),
        "threshold_split_value_block64": lambda: dense_source_triton(
            q, kc, vc, tables, lengths, key_retention, bucket, tuning=narrow
        ),
    }
    result = {}
    for name, fn in timed.items():
        try:
            result[name] = graph_ms(fn)
        except Exception as exc:  # recorded, not fatal: one design failing keeps the others
            torch.cuda.synchronize()
            result[name] = f"{type(exc).__name__}: {exc}"[:200]
    return result


def _sparse_case(ctx, conc, key_retention, backend, gen) -> dict:
    from flashloop_backend.backends.sparse_state import key_bucket
    from flashloop_backend.kernels.flashinfer import paged_attention_flashinfer, planned_wrapper
    from flashloop_backend.kernels.op_inputs import CorrectionInputs, SourceInputs
    from flashloop_backend.kernels.op_protocols import OpName

    heads, dim, bs, dtype = 16, 128, 16, torch.bfloat16
    source_impl = backend.kernels[OpName.DENSE_SOURCE].impl
    correct_impl = backend.kernels[OpName.SPARSE_CORRECTION].impl
    pages = math.ceil(ctx / bs)
    shape = (conc * pages, bs, heads, dim)
    kc = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    vc = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    tables = torch.randperm(conc * pages, device="cuda", generator=gen).int().reshape(conc, pages)
    lengths = torch.full((conc,), ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(conc, heads, dim, device="cuda", dtype=dtype, generator=gen)
    bucket = key_bucket(key_retention, ctx)
    paged_attention_flashinfer(q, kc, vc, tables, lengths)
    wrapper = planned_wrapper(q.device)
    dense_ms = graph_ms(lambda: wrapper.run(q, (kc, vc)))
    source_inputs = SourceInputs(q, kc, vc, tables, lengths, key_retention, bucket)
    _, idx, mass, ref_out, contribution = source_impl(source_inputs)
    correction = CorrectionInputs(q, kc, vc, tables, idx, mass, ref_out, contribution)
    correct_ms = graph_ms(lambda: correct_impl(correction))

    def source():
        return source_impl(source_inputs)

    try:
        source_ms, source_mode = graph_ms(source), "graph"
    except Exception:  # an implementation that cannot be captured is timed eagerly
        torch.cuda.synchronize()
        source_ms, source_mode = eager_ms(source, reps=5, calls=1), "eager"
    designs = _dense_source_designs(q, kc, vc, tables, lengths, key_retention, bucket)
    # with unchanged K/V the correction must give back the dense output exactly
    dense_out = wrapper.run(q, (kc, vc)).float()
    self_check = correct_impl(correction).float()
    self_check_error = (self_check - dense_out).abs().max().item()
    selected_bytes = conc * heads * bucket * dim * 2 * 2 + idx.numel() * 4
    return {
        "context": ctx,
        "concurrency": conc,
        "ratio": key_retention,
        "key_bucket": bucket,
        "dense_flashinfer_ms": dense_ms,
        "sparse_correction_ms": correct_ms,
        "sparse_correction_speedup": dense_ms / correct_ms,
        "sparse_correction_tb_s": selected_bytes / (correct_ms / 1e3) / 1e12,
        "dense_source_ms": source_ms,
        "dense_source_timing": source_mode,
        "dense_source_vs_dense": source_ms / dense_ms,
        "dense_source_impl": backend.kernels[OpName.DENSE_SOURCE].provider.name,
        "dense_source_designs_ms": designs,
        "correction_vs_dense_max_abs_error": self_check_error,
        "sparse_correction_impl": backend.kernels[OpName.SPARSE_CORRECTION].provider.name,
        # loop 1 dense, loop 2 the dense source, loops 3 and 4 the correction
        "four_loop_speedup": 4 * dense_ms / (dense_ms + source_ms + 2 * correct_ms),
    }


def bench_sparse_decode(
    contexts: list[int], concurrency: list[int], key_retention: float = 0.10, log=print
) -> dict:
    """Sparse decode per layer call vs FlashInfer dense decode of the same rows: the loop-3/4
    sparse correction, the loop-2 dense source with statistics (each as the registry selects
    it), and the 4-loop sum (2 dense + source + 2 corrections). The records keep the key
    ``ratio`` for ``key_retention`` (the report and earlier records read it)."""
    require_cuda()
    registry = Registry.discover()
    config = FlashLoopConfig(
        sparse_decode_attention={"enabled": True, "key_retention": key_retention}
    )
    request = SupportRequest("cuda", torch.bfloat16, 128, 16, 16, 16)
    backend = registry.create("flashloop", request, config)
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = []
    for ctx in contexts:
        for conc in concurrency:
            row = _sparse_case(ctx, conc, key_retention, backend, gen)
            cases.append(row)
            dense_us = row["dense_flashinfer_ms"] * 1e3
            correction_us = row["sparse_correction_ms"] * 1e3
            source_us = row["dense_source_ms"] * 1e3
            log(
                f"  sparse ctx={ctx} conc={conc}: dense {dense_us:.1f} us, correction "
                f"{correction_us:.1f} us (x{row['sparse_correction_speedup']:.2f}), source "
                f"{source_us:.1f} us ({row['dense_source_timing']}), "
                f"4-loop x{row['four_loop_speedup']:.2f}"
            )
            torch.cuda.empty_cache()
    return {
        "kind": "sparse_decode_per_layer",
        "environment": environment_record(),
        "ratio": key_retention,
        "shapes": {"heads": 16, "head_dim": 128, "block_size": 16, "dtype": "bfloat16"},
        "method": "CUDA-graph replay medians (30 x 10 calls); states from the selected "
        "dense_source",
        "config_digest": resolve(config, "flashloop", request, registry).digest(),
        "cases": cases,
    }
