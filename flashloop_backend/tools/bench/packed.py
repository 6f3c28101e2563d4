"""Packed INT4 KV (encoding v3), ``bench packed``: the streaming reader per depth beside
FlashInfer's BF16 paged decode of the same rows (CUDA-graph medians, side by side) with
its launch variants, the sparse-decode ops (``packed_sparse``), and the steady bytes per
prompt token the store really holds (from its tensors) against BF16 copy-on-exit planes.
Shapes, stores and byte counts: ``packed_rows``."""

from __future__ import annotations

from dataclasses import asdict, replace

import torch

from flashloop_backend.config import ConfigError
from flashloop_backend.tools.bench.packed_rows import (
    BLOCK_SIZE,
    GROUP,
    HEAD_DIM,
    HEADS,
    bf16_rows,
    byte_rate,
    cuda_unavailable,
    encoded_store,
    flashinfer_decode,
    level_bytes,
    log_entry,
    rotation_layers,
    steady_accounting,
)
from flashloop_backend.tools.bench.packed_sparse import sparse_ops_case
from flashloop_backend.tools.bench.timing import (
    environment_record,
    graph_ms,
    require_cuda,
)


def _tunings(sweep: bool) -> list:
    """The registered launch, without half products, and (``sweep``) other programs per SM
    and warps."""
    from flashloop_backend.kernels.triton.packed_decode import DEFAULT_TUNING

    out = [DEFAULT_TUNING, replace(DEFAULT_TUNING, half_products=False)]
    if sweep:
        out += [replace(DEFAULT_TUNING, programs_per_sm=p) for p in (4, 16, 32)]
        out += [replace(DEFAULT_TUNING, num_warps=w) for w in (2, 8)]
    return out


def tuning_label(tuning) -> str:
    """``_w{warps}_p{programs per SM}``, ``_fp32`` without half products."""
    label = f"_w{tuning.num_warps}_p{tuning.programs_per_sm}"
    return label + ("" if tuning.half_products else "_fp32")


def _cuda_variants(levels: int, sweep: bool) -> list:
    """StreamTunings of the CUDA reader at ``levels`` levels: the registered launch and
    (``sweep``) other CTAs per SM, warps and stages (the reader writes no logits: the
    loop-2 source's keys pass does, ``packed_source.cu``)."""
    from flashloop_backend.kernels.cuda.packed_stream import (
        DEFAULT_STREAM,
        StreamTuning,
        copies_in_halves,
    )

    out = [DEFAULT_STREAM]
    if sweep:
        deep = [(4, 1), (3, 1), (2, 1)]
        shapes = {1: [(4, 2), (8, 1), (4, 1)], 2: [(4, 1), (8, 1), (2, 2)]}.get(levels, deep)
        for ctas in (1, 4, 8):
            out.append(StreamTuning(ctas_per_sm=ctas))
        for warps, stages in shapes:
            for ctas in (2, 4):
                out.append(StreamTuning(ctas_per_sm=ctas, warps=warps, stages=stages))
    if levels > 1:  # the copies other than the default's: whole blocks, K and V halves,
        # or units of a few levels' K or V half
        copies = [StreamTuning(split_copy=split, level_chunk=0) for split in (False, True)]
        for chunk, units in ((1, 3), (1, 4), (2, 3), (2, 2)):
            if levels >= 3 and levels % chunk == 0:
                copies.append(StreamTuning(level_chunk=chunk, ring_units=units))
        out += [c for c in copies if _copy(levels, c) != _copy(levels, DEFAULT_STREAM)]
        if sweep and levels > 2:
            split = copies_in_halves(levels, StreamTuning(level_chunk=0))
            out += [
                StreamTuning(warps=w, stages=1, split_copy=not split, level_chunk=0) for w in (3, 2)
            ]
    return out


def _copy(levels: int, stream) -> tuple:
    """What a tuning's copy is at ``levels`` levels: (halves, levels per unit, ring)."""
    from flashloop_backend.kernels.cuda.packed_stream import chunk_levels, copies_in_halves

    chunk = chunk_levels(levels, stream)
    return copies_in_halves(levels, stream), chunk, stream.ring_units if chunk else 0


def _stream_label(stream) -> str:
    from flashloop_backend.kernels.cuda.packed_stream import DEFAULT_STREAM

    if stream == DEFAULT_STREAM:
        return ""
    halves = {None: "", True: "_split_copy", False: "_whole_copy"}[stream.split_copy]
    units = "" if not stream.level_chunk else f"_units{stream.level_chunk}x{stream.ring_units}"
    return f"_c{stream.ctas_per_sm}_w{stream.warps or 0}_s{stream.stages or 0}{halves}{units}"


def _reader(tuning, with_logits: bool, shape, tables, provider: str):
    """A packed read with ``tuning`` by the Triton or CUDA reader, with the loop-2 logits
    and LSE into preallocated buffers when ``with_logits`` (output FP32, as the source)."""
    from flashloop_backend.kernels.triton.packed_decode import packed_decode_triton

    if provider == "cuda":
        from flashloop_backend.kernels.cuda.packed_stream import packed_decode_cuda

        def read(*args, **kwargs):
            return packed_decode_cuda(*args, tuning=tuning, **kwargs)

    else:

        def read(*args, **kwargs):
            return packed_decode_triton(*args, tuning=tuning, **kwargs)

    if not with_logits:
        return read
    rows, heads, _ = shape
    logits = torch.empty((rows, heads, tables.shape[1] * BLOCK_SIZE), device=tables.device)
    lse = torch.empty((rows, heads), device=tables.device)
    return lambda *args: read(*args, logits=logits, lse=lse, out_dtype=torch.float32)


def _decode_case(
    context: int, batch: int, gen: torch.Generator, log, sweep: bool, cuda_only: bool = False
) -> dict:
    from flashloop_backend.kernels.triton.packed_decode import DEFAULT_TUNING, packed_decode_triton
    from flashloop_backend.kv.levels import level_metadata

    dense = flashinfer_decode(context, batch, gen)
    results = {"context": context, "concurrency": batch, "flashinfer_bf16": dense, "depths": {}}
    q, caches, tables, lengths = bf16_rows(context, batch, 1, gen)  # BF16 pages: never read
    kc, vc = caches[0]
    per_layer = batch * context * HEADS * GROUP * 2  # one level's codes, about
    layers = rotation_layers(per_layer)
    for sparse in (False,) if cuda_only else (False, True):
        store, _ = encoded_store(batch, context, layers, sparse, gen)
        for depth in range(4):
            meta = level_metadata(store, list(range(batch)), [depth] * batch, "cuda")
            nbytes = level_bytes(store, meta, batch, depth + 1)
            args = (q, store, 0, meta, kc, vc, tables, lengths)
            exact = packed_decode_triton(*args, tuning=replace(DEFAULT_TUNING, half_products=False))
            name = f"{'token_sparse' if sparse else 'dense_levels'}_depth{depth + 1}"
            variants = [
                (name + ("" if t == DEFAULT_TUNING else tuning_label(t)), t, False)
                for t in _tunings(sweep and not sparse)
            ]
            if not sparse and depth == 1:  # the loop-2 read: with logits, FP32
                variants.append((name + "_logits", DEFAULT_TUNING, True))
            if cuda_unavailable() is None:  # the registered Triton launch alone
                variants = variants[:1] + variants[-1:] if depth == 1 else variants[:1]
            if cuda_only:
                variants = []
            for key, tuning, with_logits in variants:
                reader = _reader(tuning, with_logits, q.shape, tables, "triton")
                gap = reader(q, store, 0, meta, kc, vc, tables, lengths).float() - exact.float()
                ms = graph_ms(
                    lambda layer, m=meta, s=store, r=reader: r(
                        q, s, layer, m, kc, vc, tables, lengths
                    ),
                    rotate=list(range(layers)),
                )
                entry = {"ms": ms, "speedup_vs_flashinfer_bf16": dense["ms"] / ms}
                entry |= byte_rate(nbytes, ms, dense["tb_s"])
                entry |= {"tuning": asdict(tuning), "max_abs_vs_fp32": gap.abs().max().item()}
                results["depths"][key] = entry
                log_entry(log, f"packed ctx={context} conc={batch}", key, entry, dense)
            if sparse or cuda_unavailable() is not None:
                continue
            for stream in _cuda_variants(depth + 1, sweep):
                reader = _reader(stream, False, q.shape, tables, "cuda")
                gap = reader(q, store, 0, meta, kc, vc, tables, lengths).float() - exact.float()
                ms = graph_ms(
                    lambda layer, m=meta, s=store, r=reader: r(
                        q, s, layer, m, kc, vc, tables, lengths
                    ),
                    rotate=list(range(layers)),
                )
                key = name + "_cuda" + _stream_label(stream)
                entry = {"ms": ms, "speedup_vs_flashinfer_bf16": dense["ms"] / ms}
                entry |= byte_rate(nbytes, ms, dense["tb_s"]) | {
                    "max_abs_vs_fp32": gap.abs().max().item()
                }
                results["depths"][key] = entry
                log_entry(log, f"packed ctx={context} conc={batch}", key, entry, dense)
        del store
        torch.cuda.empty_cache()
    return results


PACKED_PARTS = ("decode", "sparse_ops")


def bench_packed_kv(
    contexts: list[int],
    concurrency: list[int],
    log=print,
    parts: tuple[str, ...] = PACKED_PARTS,
    sweep: bool = True,
    cuda_only: bool = False,
) -> dict:
    """``parts``: the reader per depth with its launch sweep (``decode``) and the packed
    sparse-decode ops (``sparse_ops``); each names FlashInfer's BF16 decode of its rows.
    ``cuda_only``: the reader per depth times the CUDA launches alone, over dense levels."""
    unknown = sorted(set(parts) - set(PACKED_PARTS))
    if unknown or not parts:
        named = unknown or list(parts)
        raise ConfigError(f"bench packed parts {named} are not among {list(PACKED_PARTS)}")
    require_cuda()
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(c, b) for c in contexts for b in concurrency]
    cases = []
    if "decode" in parts:
        cases = [_decode_case(c, b, gen, log, sweep, cuda_only) for c, b in shapes]
    dense = {(c["context"], c["concurrency"]): c["flashinfer_bf16"] for c in cases}
    sparse_ops = []
    if "sparse_ops" in parts:
        sparse_ops = [
            sparse_ops_case(c, b, gen, log, dense.get((c, b)), sweep=sweep) for c, b in shapes
        ]
    accounting = steady_accounting(2048, 24, gen)
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
            "encoding": 3,
            "policy": "fixed_prompt (whole prompt packed, no tail)",
        },
        "method": "CUDA-graph replay medians, calls rotating over layers that together hold "
        "four times the L2 cache; FlashInfer BF16 decode of the same rows in the same run; "
        "bytes from the layout and the selection",
        "decode": cases,
        "sparse_ops": sparse_ops,
        "accounting": accounting,
    }
