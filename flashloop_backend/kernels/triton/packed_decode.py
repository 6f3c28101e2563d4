"""Wrapper for decode attention over packed INT4 KV (encoding v3) plus a BF16 paged tail:
validates, splits the groups over programs from shapes only (no host sync), merges the
splits."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from flashloop_backend.kernels.triton.paged_decode import (
    merge_splits,
    next_pow2,
    sm_count,
    split_buffers,
)
from flashloop_backend.kernels.validate import check_paged_inputs
from flashloop_backend.kv.levels import LevelMetadata
from flashloop_backend.kv.store import PackedKVStore


@dataclass(frozen=True)
class PackedTuning:
    """Launch shape of the streaming packed reader: ``num_warps`` per program and about
    ``programs_per_sm`` programs per SM over the rows' heads and splits (splits from
    shapes only). Plain reads (no selection statistics) take ``half_products``: exact
    FP16 codes times FP16 folded weights, summed in FP32 (``PLAIN_READ_TOLERANCE``)."""

    num_warps: int = 4
    programs_per_sm: int = 8
    half_products: bool = True


DEFAULT_TUNING = PackedTuning()

# Absolute and relative tolerance of a plain read with half products against the FP32
# reconstruction: each product rounds to FP16 (q times K's scale, p times V's scale, times
# an exact code: 11-bit mantissas, finer than the BF16 a dense read multiplies in); reads
# with selection statistics stay within FP32 rounding (exact top-K needs it).
PLAIN_READ_TOLERANCE = 2e-3
# BF16 positions per step above the packed length (a group's tiles would hold D / 16
# times the registers of a packed group's codes)
TAIL_ROWS = 16


def uses_ptx(q: torch.Tensor) -> bool:
    """Whether kernels on q's device take their inline-PTX paths (not the interpreter)."""
    return q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


def packed_span(store: PackedKVStore, meta: LevelMetadata, block_tables, block_size: int) -> int:
    """Positions the readers cover: whole groups over the packed rows and the BF16 pages."""
    g = store.group_size
    return math.ceil(max(block_tables.shape[1] * block_size, meta.maps.shape[2]) / g) * g


def stream_splits(
    q,
    store: PackedKVStore,
    meta: LevelMetadata,
    block_tables,
    block_size: int,
    logits,
    per_sm: float,
    resident: int | None = None,
    warps: int = 4,
) -> tuple[int, int]:
    """(splits, groups per split) of a streaming reader's grid, checking that ``logits``
    [R, Hq, >= span] holds every covered position: about ``per_sm`` CTAs per SM, or with
    ``resident`` (CTAs of ``warps`` warps one SM holds at once) the count up to that
    which ``wave_splits`` models fastest."""
    rows, num_q_heads = q.shape[:2]
    g = store.group_size
    groups = packed_span(store, meta, block_tables, block_size) // g
    if logits is not None and (logits.shape[:2] != q.shape[:2] or logits.shape[2] < groups * g):
        raise ValueError(
            f"logits must be [{rows}, {num_q_heads}, >= {groups * g}]; got {tuple(logits.shape)}"
        )
    sms = sm_count(q.device)
    want = max(1, math.ceil(per_sm * sms / (rows * num_q_heads)))
    splits = max(1, min(want, groups))
    if resident:
        splits = wave_splits(rows * num_q_heads, groups, splits, resident * sms, warps)
    return splits, math.ceil(groups / splits)


def wave_splits(pairs: int, groups: int, most: int, capacity: int, warps: int) -> int:
    """The split count for a grid of ``pairs`` x splits CTAs of ``warps`` warps,
    ``capacity`` of them running at once: ``most`` unless a count below it takes a tenth
    less time modelled as waves x (groups per warp + 1) (a CTA's warps read their groups
    side by side, its set-up and end cost about one group more, and a last wave of a few
    CTAs costs a whole CTA's time); among the fastest, the most splits."""

    def cost(splits: int) -> int:
        waves = math.ceil(pairs * splits / max(1, capacity))
        return waves * (math.ceil(math.ceil(groups / splits) / warps) + 1)

    best = min(range(1, most + 1), key=lambda s: (cost(s), -s))
    return best if cost(best) <= 0.9 * cost(most) else most


def layer_blocks(store: PackedKVStore, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """One layer's v3 blocks as the packed kernels take them: a byte view, an FP16 view of
    the same memory [pages, Hkv, block bytes (/ 2)], and the bytes between pages."""
    codes = store.blocks[:, layer]
    return codes, store.blocks.view(torch.float16)[:, layer], codes.stride(0)


def metadata_strides(meta: LevelMetadata, key_cache, value_cache, block_tables) -> tuple:
    """The strides every packed kernel takes in this order: level metadata, the BF16 paged
    cache and its block tables."""
    return (
        meta.tables.stride(0),
        meta.tables.stride(1),
        meta.maps.stride(0),
        meta.maps.stride(1),
        meta.kinds.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
    )


def check_packed_inputs(q, store: PackedKVStore, meta: LevelMetadata, key_cache) -> None:
    """The store, the cache and the metadata fit q [R, Hq, D] and each other."""
    rows, _, head_dim = q.shape
    _, num_kv_heads, _ = key_cache.shape[1:]
    _, store_heads, store_dim = store.shape
    if (store_heads, store_dim) != (num_kv_heads, head_dim):
        raise ValueError(
            f"store holds {store_heads} heads x {store_dim} dims; "
            f"the cache {num_kv_heads} x {head_dim}"
        )
    tables, kinds, packed = meta.tables, meta.kinds, meta.packed_lengths
    if tables.shape[0] != rows or kinds.shape != tables.shape[:2] or packed.shape != (rows,):
        raise ValueError(
            f"metadata rows/levels disagree: tables {tuple(tables.shape)}, "
            f"kinds {tuple(kinds.shape)}, packed {tuple(packed.shape)} for {rows} rows"
        )
    for name in ("tables", "maps", "kinds", "packed_lengths"):
        tensor = getattr(meta, name)
        if tensor.dtype != torch.int32 or tensor.device != q.device:
            raise ValueError(
                f"meta.{name} must be int32 on {q.device}; got {tensor.dtype} on {tensor.device}"
            )
    if store.blocks.device != q.device:
        raise ValueError(f"the packed store lives on {store.blocks.device}; q is on {q.device}")


def packed_decode_triton(
    q,
    store: PackedKVStore,
    layer: int,
    meta: LevelMetadata,
    key_cache,
    value_cache,
    block_tables,
    context_lengths,
    scale: float | None = None,
    few_rows: bool = False,
    tuning: PackedTuning = DEFAULT_TUNING,
    logits: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    correction: tuple | None = None,
) -> torch.Tensor:
    """Decode attention of q [R, Hq, D] over each row's history: positions below
    ``packed_lengths`` from the packed store (reconstructed at the row's depth in
    registers), the rest from the BF16 paged cache [NB, BS, Hkv, D] through block_tables
    [R, MB]; context_lengths [R] int32. Returns [R, Hq, D] in q's dtype (or ``out_dtype``).
    Selection statistics (``packed_dense_source``): ``logits`` [R, Hq, T >= the grid's
    span] FP32 receives every visible key's scaled logit, ``lse`` [R, Hq] FP32 the LSE.
    ``correction`` (output, contribution [R, Hq, D], mass [R, Hq], FP32) is applied by
    the merge. ``few_rows``: one program per (row, head) (``PackedDecode``'s hint)."""
    from flashloop_backend.kernels.triton.packed_decode_jit import packed_decode_split_kernel

    rows, num_q_heads, head_dim = check_paged_inputs(
        q, key_cache, value_cache, block_tables, context_lengths
    )
    check_packed_inputs(q, store, meta, key_cache)
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty_like(q, dtype=out_dtype or q.dtype)
    if rows == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    g = store.group_size
    per_sm = 0 if few_rows else tuning.programs_per_sm
    splits, per_split = stream_splits(q, store, meta, block_tables, block_size, logits, per_sm)
    part_out, part_max, part_sum = split_buffers(rows, num_q_heads, splits, head_dim, q.device)
    codes, halves, page_bytes = layer_blocks(store, layer)
    block_tables = block_tables.contiguous()
    levels = meta.tables.shape[1]
    packed_decode_split_kernel[(rows, num_q_heads, splits)](
        q,
        codes,
        halves,
        meta.tables,
        meta.maps,
        meta.kinds,
        meta.packed_lengths,
        key_cache,
        value_cache,
        block_tables,
        context_lengths,
        part_out,
        part_max,
        part_sum,
        logits if logits is not None else part_max,
        scale,
        q.stride(0),
        q.stride(1),
        page_bytes,
        *metadata_strides(meta, key_cache, value_cache, block_tables),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_max.stride(0),
        part_max.stride(1),
        logits.stride(0) if logits is not None else 0,
        logits.stride(1) if logits is not None else 0,
        per_split,
        GROUP_Q=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        GROUP=g,
        BLOCK_SIZE=block_size,
        LEVELS=levels,
        LEVELS_PAD=max(2, next_pow2(levels)),
        COMPACT_FROM=min(meta.compact_from, levels),
        TAIL=TAIL_ROWS,
        STORE_LOGITS=logits is not None,
        HALF=tuning.half_products and logits is None,
        ASM=uses_ptx(q),
        num_warps=tuning.num_warps,
    )
    return merge_splits(part_out, part_max, part_sum, out, lse, correction)
