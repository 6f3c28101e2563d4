"""What the packed-KV benchmarks share: Ouro-1.4B's head shapes, stores of encoded
prompts written as the backend writes them, BF16 rows of the same shape, FlashInfer's
BF16 decode of them, and the bytes each packed read must move with the rate it reached.
Calls rotate over layers whose bytes together exceed the L2 cache several times, so
every rate is a memory rate."""

from __future__ import annotations

import math

import torch

from flashloop_backend.tools.bench.timing import (
    HBM_BYTES_PER_S,
    graph_ms,
)

HEADS, HEAD_DIM, BLOCK_SIZE, GROUP = 16, 128, 16, 64
SPARSITY = [1.0, 1.0, 0.25, 0.10]
L2_ROTATION = 4 * 60 * 2**20  # bytes a rotation covers: four times the H200's L2
MAX_LAYERS = 24


def level_versions(
    rows: int, layers: int, gen: torch.Generator, depths: int = 4
) -> list[torch.Tensor]:
    """Per-depth K or V [rows, layers, H, D] on ``gen``'s device whose loop-to-loop change
    shrinks like Ouro's."""
    shape = (rows, layers, HEADS, HEAD_DIM)
    out = [torch.randn(shape, device=gen.device, generator=gen)]
    for step in range(1, depths):
        out.append(out[-1] + (0.5 / step) * torch.randn(shape, device=gen.device, generator=gen))
    return out


def nested_active(rows: int, gen: torch.Generator) -> list[torch.Tensor]:
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


def encoded_store(sequences: int, rows: int, layers: int, sparse: bool, gen: torch.Generator):
    """A store holding ``sequences`` encoded prompts of ``rows`` rows and ``layers``
    layers, written as the backend writes them (the Triton level writer on a GPU, the
    torch chain elsewhere), and the largest allocation one encoding added on top of its
    inputs and the pools."""
    from flashloop_backend.kv.store import PackedKVStore

    pages = sequences * 4 * math.ceil(rows / GROUP) + 8
    store = PackedKVStore(pages, layers, HEADS, HEAD_DIM, GROUP, device=gen.device)
    cuda = gen.device.type == "cuda"
    write = None
    if cuda:
        from flashloop_backend.kernels.triton.encode import encode_levels_triton as write
    transient = 0
    for s in range(sequences):
        keys, values = level_versions(rows, layers, gen), level_versions(rows, layers, gen)
        active = nested_active(rows, gen) if sparse else None
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


def steady_accounting(rows: int, layers: int, gen: torch.Generator) -> dict:
    """Steady bytes per prompt token over 4 depths, dense and with token sparsity."""
    bf16_per_token = 4 * layers * HEADS * HEAD_DIM * 2 * 2  # 4 copy-on-exit planes, K and V
    record = {"bf16_bytes_per_token_4_depths": bf16_per_token, "layers": layers, "rows": rows}
    for name, sparse in (("dense_levels", False), ("token_sparse_1_1_0.25_0.10", True)):
        store, transient = encoded_store(1, rows, layers, sparse, gen)
        report = store.accounting()
        report["ratio_vs_bf16"] = bf16_per_token / report["steady_bytes_per_token"]
        report["conversion_peak_bytes_per_token"] = transient / rows
        record[name] = report
        del store
        torch.cuda.empty_cache()
    return record


def rotation_layers(bytes_per_layer: int) -> int:
    """Layers whose bytes together cover ``L2_ROTATION`` (at most ``MAX_LAYERS``)."""
    return max(2, min(MAX_LAYERS, math.ceil(L2_ROTATION / max(1, bytes_per_layer))))


def level_bytes(store, meta, rows: int, levels: int) -> int:
    """Bytes a streaming read of ``levels`` levels moves for ``rows`` rows of one layer:
    every block of the rows' pages at those levels (K and V codes, parameters), plus the
    compact levels' map entries."""
    _, heads, _ = store.shape
    total = 0
    for r in range(rows):
        entry = store.sequences[r]
        total += sum(len(p) for p in entry.pages[:levels]) * heads * store.layout.block_bytes
        total += sum(m.numel() * 4 for m in entry.maps[:levels] if m is not None)
    return total


def selected_bytes(store, meta, indices: torch.Tensor, levels: int) -> int:
    """Bytes a read of the selected keys ``indices`` [R, H, Kb] at ``levels`` levels
    moves: per present (key, level) its K row, V row and V record; per touched (row, head,
    page, level) the page's K parameters; 4 bytes per index (host count, untimed)."""
    layout = store.layout
    key_bytes = 2 * layout.row_bytes + layout.record_bytes
    total = int((indices >= 0).sum()) * 4
    for r in range(indices.shape[0]):
        entry = store.sequences[r]
        for h in range(indices.shape[1]):
            pos = indices[r, h][indices[r, h] >= 0].long().cpu()
            for level in range(min(levels, len(entry.pages))):
                mapping = entry.host_maps[level]
                rows = pos if mapping is None else mapping[pos]
                rows = rows[rows >= 0]
                total += rows.numel() * key_bytes
                total += torch.unique(rows // store.group_size).numel() * 4 * layout.head_dim
    return total


def byte_rate(nbytes: int, ms: float, dense_tb_s: float | None) -> dict:
    tb_s = nbytes / (ms / 1e3) / 1e12
    out = {"bytes": nbytes, "tb_s": tb_s, "hbm_fraction": tb_s * 1e12 / HBM_BYTES_PER_S}
    if dense_tb_s:
        out["fraction_of_flashinfer_tb_s"] = tb_s / dense_tb_s
    return out


def bf16_rows(context: int, batch: int, layers: int, gen: torch.Generator):
    """(q [B, H, D], per-layer key/value caches [pages, 16, H, D], block tables [B, pages],
    lengths [B]) of ``batch`` rows at ``context`` in BF16 on ``gen``'s device."""
    device = gen.device
    pages = math.ceil(context / BLOCK_SIZE)
    shape = (batch * pages, BLOCK_SIZE, HEADS, HEAD_DIM)
    caches = [
        (
            torch.randn(shape, device=device, generator=gen).bfloat16(),
            torch.randn(shape, device=device, generator=gen).bfloat16(),
        )
        for _ in range(layers)
    ]
    tables = torch.randperm(batch * pages, device=device, generator=gen).int().reshape(batch, pages)
    lengths = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, generator=gen).bfloat16()
    return q, caches, tables, lengths


def flashinfer_decode(context: int, batch: int, gen: torch.Generator) -> dict:
    """FlashInfer's BF16 paged decode of these rows: CUDA-graph median ms over rotating
    layers, its bytes and rate."""
    from flashloop_backend.kernels.flashinfer import paged_attention_flashinfer, planned_wrapper

    nbytes = batch * context * HEADS * HEAD_DIM * 2 * 2
    q, caches, tables, lengths = bf16_rows(context, batch, rotation_layers(nbytes), gen)
    paged_attention_flashinfer(q, *caches[0], tables, lengths)
    wrapper = planned_wrapper(q.device)
    ms = graph_ms(lambda kv: wrapper.run(q, kv), rotate=caches)
    del caches
    torch.cuda.empty_cache()
    return {"ms": ms, **byte_rate(nbytes, ms, None)}


def cuda_unavailable() -> str | None:
    from flashloop_backend.kernels.cuda.loader import unavailable

    return unavailable()


def log_entry(log, where: str, key: str, entry: dict, dense: dict) -> None:
    log(
        f"  {where} {key}: {entry['ms'] * 1e3:.1f} us vs FlashInfer {dense['ms'] * 1e3:.1f} us "
        f"(x{dense['ms'] / entry['ms']:.2f}), {entry['bytes'] / 1e6:.1f} MB at "
        f"{entry['tb_s']:.2f} TB/s = {entry.get('fraction_of_flashinfer_tb_s', 0):.2f} of "
        f"FlashInfer's {dense['tb_s']:.2f} TB/s"
    )
