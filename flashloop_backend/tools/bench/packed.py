"""Packed INT4 KV: decode attention per layer call against FlashInfer BF16 paged decode of
the same rows (CUDA-graph medians, side by side), and the steady bytes per prompt token
the store really holds (from its tensors) against BF16 copy-on-exit planes."""

from __future__ import annotations

import math
from dataclasses import asdict, replace

import torch

from flashloop_backend.config import ConfigError
from flashloop_backend.tools.bench.timing import (
    HBM_BYTES_PER_S,
    environment_record,
    graph_ms,
    require_cuda,
)

HEADS, HEAD_DIM, BLOCK_SIZE, GROUP = 16, 128, 16, 64
# (positions per step, warps, programs in all) of the selected-key kernel: the registered
# launch (kernels/triton/packed_sparse.py) beside fewer and more programs and 32 x 4.
# ptxas (scripts/kernel_registers.py --kernel selected) rules out 1 warp and 32 x 2 at 3-4
# levels: they spill far more per thread (spill table in results/README.md, "Packed INT4 KV").
SELECTED_LAUNCHES = [(16, 2, 512), (16, 2, 128), (16, 2, 2048), (16, 4, 512), (32, 4, 512)]
SPARSITY = [1.0, 1.0, 0.25, 0.10]


def _versions(rows: int, layers: int, gen: torch.Generator, depths: int = 4) -> list[torch.Tensor]:
    """Per-depth K or V [rows, layers, H, D] on ``gen``'s device whose loop-to-loop change
    shrinks like Ouro's."""
    shape = (rows, layers, HEADS, HEAD_DIM)
    out = [torch.randn(shape, device=gen.device, generator=gen)]
    for step in range(1, depths):
        out.append(out[-1] + (0.5 / step) * torch.randn(shape, device=gen.device, generator=gen))
    return out


def _active(rows: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Nested active sets with SPARSITY's retention (windows of 64, like the host)."""
    masks = [torch.ones(rows, dtype=torch.bool, device=gen.device)]
    for ratio in SPARSITY[1:]:
        keep = masks[-1].clone()
        if ratio < 1.0:
            scores = torch.rand(rows, device=gen.device, generator=gen).masked_fill(
                ~masks[-1], -1.0
            )
            windows = scores.reshape(-1, GROUP)
            budget = max(1, math.ceil(ratio * GROUP))
            top = windows.topk(budget, dim=1).indices
            keep = torch.zeros_like(windows, dtype=torch.bool).scatter_(1, top, True).flatten()
        masks.append(keep)
    return masks


def _store(sequences: int, rows: int, layers: int, sparse: bool, gen: torch.Generator):
    """A store holding ``sequences`` encoded prompts of ``rows`` rows, written as the
    backend writes them (the Triton level writer on a GPU, the torch chain elsewhere), and
    the largest allocation one encoding added on top of its inputs and the pools."""
    from flashloop_backend.kv.store import PackedKVStore

    pages = sequences * 4 * math.ceil(rows / GROUP) + 8
    store = PackedKVStore(pages, layers, HEADS, HEAD_DIM, GROUP, device=gen.device)
    cuda = gen.device.type == "cuda"
    write = None
    if cuda:
        from flashloop_backend.kernels.triton.encode import encode_levels_triton as write
    transient = 0
    for s in range(sequences):
        keys, values = _versions(rows, layers, gen), _versions(rows, layers, gen)
        active = _active(rows, gen) if sparse else None
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()  # inputs and pools exist: conversion only
            torch.cuda.reset_peak_memory_stats()
        store.encode(s, keys, values, active, write)
        if cuda:
            torch.cuda.synchronize()
            transient = max(transient, torch.cuda.max_memory_allocated() - before)
        del keys, values
    return store, transient


def _accounting(rows: int, layers: int, gen: torch.Generator) -> dict:
    """Steady bytes per prompt token over 4 depths, dense and with token sparsity."""
    bf16_per_token = 4 * layers * HEADS * HEAD_DIM * 2 * 2  # 4 copy-on-exit planes, K and V
    record = {"bf16_bytes_per_token_4_depths": bf16_per_token, "layers": layers, "rows": rows}
    for name, sparse in (("dense_levels", False), ("token_sparse_1_1_0.25_0.10", True)):
        store, transient = _store(1, rows, layers, sparse, gen)
        report = store.accounting()
        report["ratio_vs_bf16"] = bf16_per_token / report["steady_bytes_per_token"]
        report["conversion_peak_bytes_per_token"] = transient / rows
        record[name] = report
        del store
        torch.cuda.empty_cache()
    return record


def _tunings(levels: int, sweep: bool) -> list:
    """The registered launch, then the reader without half products (FP32 1 + c/16
    units) and (``sweep``) at 64 programs per SM and, from two levels, 16 / 32 rows per
    step at 1 / 2 warps, each once."""
    from flashloop_backend.kernels.triton.packed_decode import DEFAULT_TUNING

    out = [DEFAULT_TUNING, replace(DEFAULT_TUNING, half_products=False)]
    if not sweep:
        return out
    out.append(replace(DEFAULT_TUNING, programs_per_sm=64))
    if levels >= 2:
        grid = [
            replace(DEFAULT_TUNING, deep_from_levels=2, deep_rows_per_step=r, deep_num_warps=w)
            for r in (16, 32)
            for w in (1, 2)
        ]
        seen = {tuning_label(t, levels) for t in out}
        out += [t for t in grid if tuning_label(t, levels) not in seen]
    return out


def tuning_label(tuning, levels: int) -> str:
    """``_w{warps}_p{programs per SM}``, ``_r{rows per step}`` when a 64-row group is not
    read whole, ``_fp32`` without half products."""
    from flashloop_backend.kernels.triton.packed_decode import rows_per_step, warps_for

    label = f"_w{warps_for(tuning, levels)}_p{tuning.programs_per_sm}"
    rows = rows_per_step(tuning, GROUP, levels)
    label += f"_r{rows}" if rows != GROUP else ""
    return label + ("" if tuning.half_products else "_fp32")


def _bf16_rows(context: int, batch: int, gen: torch.Generator):
    """(q [B, H, D], key/value caches [pages, 16, H, D], block tables [B, pages], lengths
    [B]) of ``batch`` rows at ``context`` in BF16 on ``gen``'s device, pages shuffled."""
    device = gen.device
    pages = math.ceil(context / BLOCK_SIZE)
    kc = torch.randn((batch * pages, BLOCK_SIZE, HEADS, HEAD_DIM), device=device, generator=gen)
    kc, vc = kc.bfloat16(), torch.randn_like(kc).bfloat16()
    tables = torch.randperm(batch * pages, device=device, generator=gen).int().reshape(batch, pages)
    lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, generator=gen).bfloat16()
    return q, kc, vc, tables, lengths


def _flashinfer_ms(q, kc, vc, tables, lengths) -> float:
    """FlashInfer's BF16 paged decode of these rows, CUDA-graph median ms."""
    from flashloop_backend.kernels.flashinfer import paged_attention_flashinfer, planned_wrapper

    paged_attention_flashinfer(q, kc, vc, tables, lengths)
    wrapper = planned_wrapper(q.device)
    return graph_ms(lambda: wrapper.run(q, (kc, vc)))


def _decode_case(context: int, batch: int, gen: torch.Generator, log) -> dict:
    from flashloop_backend.kernels.triton.packed_decode import DEFAULT_TUNING, packed_decode_triton
    from flashloop_backend.kv.levels import level_metadata

    rows = context  # the whole prompt packed (fixed_prompt); the BF16 tail is empty
    results = {"context": context, "concurrency": batch, "depths": {}}
    q, kc, vc, tables, lengths = _bf16_rows(context, batch, gen)
    dense_ms = _flashinfer_ms(q, kc, vc, tables, lengths)
    results["dense_flashinfer_ms"] = dense_ms
    for sparse in (False, True):
        store, _ = _store(batch, rows, 1, sparse, gen)
        for depth in range(4):
            meta = level_metadata(store, list(range(batch)), [depth] * batch, "cuda")
            levels = store.sequences[0].pages[: depth + 1]
            read = sum(len(p) for p in levels) * store.page_bytes() * batch
            read += (
                sum(m.numel() * 4 for m in store.sequences[0].maps[: depth + 1] if m is not None)
                * batch
            )
            exact = packed_decode_triton(
                q,
                store,
                0,
                meta,
                kc,
                vc,
                tables,
                lengths,
                tuning=replace(DEFAULT_TUNING, half_products=False),
            ).float()
            for tuning in _tunings(depth + 1, sweep=not sparse):
                got = packed_decode_triton(
                    q, store, 0, meta, kc, vc, tables, lengths, tuning=tuning
                )
                gap = (got.float() - exact).abs().max().item()
                ms = graph_ms(
                    lambda m=meta, s=store, t=tuning: packed_decode_triton(
                        q, s, 0, m, kc, vc, tables, lengths, tuning=t
                    )
                )
                key = f"{'token_sparse' if sparse else 'dense_levels'}_depth{depth + 1}"
                if tuning != DEFAULT_TUNING:
                    key += tuning_label(tuning, depth + 1)
                tb_s = read / (ms / 1e3) / 1e12
                results["depths"][key] = {
                    "ms": ms,
                    "speedup_vs_flashinfer_bf16": dense_ms / ms,
                    "bytes_read": read,
                    "tb_s": tb_s,
                    "hbm_fraction": read / (ms / 1e3) / HBM_BYTES_PER_S,
                    "tuning": asdict(tuning),
                    "max_abs_vs_fp32_products": gap,
                }
                log(
                    f"  packed ctx={context} conc={batch} {key}: {ms * 1e3:.1f} us vs dense "
                    f"{dense_ms * 1e3:.1f} us (x{dense_ms / ms:.2f}), {tb_s:.2f} TB/s, "
                    f"max |diff| vs FP32 products {gap:.1e}"
                )
        del store
        torch.cuda.empty_cache()
    return results


def sparse_ops_case(
    context: int,
    batch: int,
    gen: torch.Generator,
    log,
    dense_ms: float | None,
    key_retention: float = 0.25,
    timer=graph_ms,
    select=None,
    launches=SELECTED_LAUNCHES,
) -> dict:
    """The packed sparse-decode ops per layer call on ``gen``'s device: the loop-2 source
    (two-level read, selection, contribution) beside the plain two-level read, the loop 3-4
    correction over the
    selected keys at three and four levels, dense and compact levels, each selected-key
    launch of ``launches`` (positions per step, warps, programs in all), and the streamed
    correction
    design (the packed reader, unselected positions masked); ``dense_ms``: FlashInfer BF16
    decode of the same rows (same run; None: timed here on a GPU);
    ``select``: the selection's ``SelectTuning`` (None: the registered one)."""
    from flashloop_backend.backends.sparse_state import key_bucket
    from flashloop_backend.kernels.triton.dense_source import DEFAULT_SELECT
    from flashloop_backend.kernels.triton.packed_decode import packed_decode_triton
    from flashloop_backend.kernels.triton.packed_sparse import (
        packed_dense_source_triton,
        packed_sparse_correction_triton,
        packed_streamed_correction_triton,
    )
    from flashloop_backend.kv.levels import level_metadata

    device = gen.device
    q, kc, vc, tables, lengths = _bf16_rows(context, batch, gen)  # BF16 pages: never read (packed)
    if dense_ms is None and device.type == "cuda":
        dense_ms = _flashinfer_ms(q, kc, vc, tables, lengths)
    bucket = key_bucket(key_retention, context)
    results: dict = {
        "context": context,
        "concurrency": batch,
        "key_retention": key_retention,
        "key_bucket": bucket,
        "dense_flashinfer_ms": dense_ms,
        "ops": {},
    }

    def record(key: str, ms: float) -> None:
        entry = {"ms": ms}
        if dense_ms:
            entry["vs_dense_decode"] = ms / dense_ms
        results["ops"][key] = entry
        log(
            f"  packed sparse ctx={context} conc={batch} {key}: {ms * 1e3:.1f} us"
            + (f" ({ms / dense_ms:.2f}x a dense decode)" if dense_ms else "")
        )

    for sparse in (False, True):
        name = "token_sparse" if sparse else "dense_levels"
        store, _ = _store(batch, context, 1, sparse, gen)
        meta = [level_metadata(store, list(range(batch)), [d] * batch, device) for d in range(4)]
        reads = (q, store, 0, meta[1], kc, vc, tables, lengths)  # layer 0 at loop 2
        source = (*reads, key_retention, bucket, None, select or DEFAULT_SELECT)  # default scale
        _, indices, mass, output, contribution = packed_dense_source_triton(*source)
        corrections = {
            depth: (q, store, 0, meta[depth], kc, vc, tables, indices, mass, output, contribution)
            for depth in (2, 3)
        }
        record(f"{name}_plain_read_depth2", timer(lambda r=reads: packed_decode_triton(*r)))
        # the streamed design: the packed reader with unselected positions masked
        for depth, args in corrections.items():
            key = f"{name}_correction_depth{depth + 1}_streamed"
            record(key, timer(lambda a=args: packed_streamed_correction_triton(*a)))
            streamed = packed_streamed_correction_triton(*args).float()
            gathered = packed_sparse_correction_triton(*args).float()
            gap = (streamed - gathered).abs().max().item()
            results["ops"][key]["max_abs_vs_gather"] = gap  # the same result by both designs
        # each launch of the sweep, then the registered one with V read either way
        variants = [
            (f"_block{n}_w{w}_p{p}", {"block_n": n, "num_warps": w, "programs": p})
            for n, w, p in launches
        ]
        variants += [
            ("_v_by_channel", {"v_by_channel": True}),
            ("_v_rows", {"v_by_channel": False}),
        ]
        for suffix, launch in variants:
            record(
                f"{name}_source_depth2{suffix}",
                timer(lambda s=source, k=launch: packed_dense_source_triton(*s, **k)),
            )
            for depth, args in corrections.items():
                record(
                    f"{name}_correction_depth{depth + 1}{suffix}",
                    timer(lambda a=args, k=launch: packed_sparse_correction_triton(*a, **k)),
                )
        del store
    return results


PACKED_PARTS = ("decode", "sparse_ops")


def bench_packed_kv(
    contexts: list[int], concurrency: list[int], log=print, parts: tuple[str, ...] = PACKED_PARTS
) -> dict:
    """``parts``: the reader per depth with its launch sweep (``decode``) and the packed
    sparse-decode ops (``sparse_ops``); each names FlashInfer's BF16 decode of its rows."""
    unknown = sorted(set(parts) - set(PACKED_PARTS))
    if unknown or not parts:
        named = unknown or list(parts)
        raise ConfigError(f"bench packed parts {named} are not among {list(PACKED_PARTS)}")
    require_cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(c, b) for c in contexts for b in concurrency]
    cases = [_decode_case(c, b, gen, log) for c, b in shapes] if "decode" in parts else []
    dense = {(c["context"], c["concurrency"]): c["dense_flashinfer_ms"] for c in cases}
    sparse_ops = []
    if "sparse_ops" in parts:
        sparse_ops = [sparse_ops_case(c, b, gen, log, dense.get((c, b))) for c, b in shapes]
    accounting = _accounting(2048, 24, gen)
    dense_levels = accounting["dense_levels"]["ratio_vs_bf16"]
    token_sparse = accounting["token_sparse_1_1_0.25_0.10"]["ratio_vs_bf16"]
    log(
        f"  steady bytes/token over 4 depths: dense levels x{dense_levels:.2f}, "
        f"token sparse x{token_sparse:.2f} smaller than BF16"
    )
    return {
        "kind": "packed_kv",
        "environment": environment_record(),
        "shapes": {
            "heads": HEADS,
            "head_dim": HEAD_DIM,
            "group_size": GROUP,
            "block_size": BLOCK_SIZE,
            "dtype": "bfloat16",
            "policy": "fixed_prompt (whole prompt packed, no tail)",
        },
        "method": "CUDA-graph replay medians (30 x 10 calls), "
        "FlashInfer BF16 decode of the same rows in the same run",
        "decode": cases,
        "sparse_ops": sparse_ops,
        "accounting": accounting,
    }
