"""Wrapper for decode attention over packed INT4 KV plus a BF16 paged tail: validates,
splits the groups over programs from shapes only (no host sync), merges the splits."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from flashloop_backend.kernels.triton.paged_decode import merge_splits, sm_count, split_buffers
from flashloop_backend.kernels.validate import check_paged_inputs
from flashloop_backend.kv.levels import LevelMetadata
from flashloop_backend.kv.store import PackedKVStore


@dataclass(frozen=True)
class PackedTuning:
    """Launch shape of the packed reader (chosen with ``flashloop-backend bench packed``).
    Launches that read fewer than ``deep_from_levels`` levels take ``num_warps`` /
    ``rows_per_step``, the others the ``deep_`` pair."""

    num_warps: int = 1  # one warp: every reduction is a warp shuffle, no shared memory
    programs_per_sm: int = 32
    # rows of a group per loop step, at most (None or a larger value: the whole group).
    # Fewer rows keep the tiles in registers (ptxas, scripts/kernel_registers.py) but take
    # more loop steps; at one or two levels the whole group is no slower
    # (results/bench_packed_rows_per_step.log)
    rows_per_step: int | None = None
    # three or more levels: one warp (more warps reduce across warps through shared
    # memory) over 32 rows per step (16 rows take twice the loop steps) is the fastest
    # launch (results/bench_packed_rows_per_step.log; results/README.md, "All three
    # features at 32K")
    deep_num_warps: int = 1
    deep_rows_per_step: int | None = 32
    deep_from_levels: int = 3  # the level count from which the deep_ pair applies
    # plain reads (no selection statistics, no selected marks): codes become exact FP16
    # values in registers (lop3, no convert) and meet FP16 folded weights in packed-half
    # products, summed in FP32 (``PLAIN_READ_TOLERANCE``)
    half_products: bool = True


DEFAULT_TUNING = PackedTuning()

# Absolute and relative tolerance of a plain read with half products against the FP32
# reconstruction: each product rounds to FP16 (q times K's scale, p times V's scale, times
# an exact code: 11-bit mantissas, finer than the BF16 a dense read multiplies in); reads
# with selection statistics or marks stay within FP32 rounding (exact top-K needs it).
PLAIN_READ_TOLERANCE = 2e-3


def _deep(tuning: PackedTuning, levels: int) -> bool:
    """Whether a launch that reads ``levels`` levels takes the ``deep_`` pair."""
    return levels >= tuning.deep_from_levels


def warps_for(tuning: PackedTuning, levels: int) -> int:
    """Warps of a launch that reads ``levels`` levels (base + residuals)."""
    return tuning.deep_num_warps if _deep(tuning, levels) else tuning.num_warps


def rows_for(tuning: PackedTuning, levels: int) -> int | None:
    """The configured rows per step of a launch that reads ``levels`` levels."""
    return tuning.deep_rows_per_step if _deep(tuning, levels) else tuning.rows_per_step


def rows_per_step(tuning: PackedTuning, group_size: int, levels: int = 1) -> int:
    """Rows of a group the reader takes per loop step: the configured power of two >= 16
    (Triton tiles), or the whole group when that is smaller or none is configured."""
    rows = rows_for(tuning, levels)
    if rows is None:
        return group_size
    if rows < 16 or rows & (rows - 1):
        name = "deep_rows_per_step" if _deep(tuning, levels) else "rows_per_step"
        raise ValueError(f"{name}={rows} must be a power of two >= 16 (or None: the whole group)")
    return min(rows, group_size)


def uses_ptx(q: torch.Tensor) -> bool:
    """Whether kernels on q's device take their inline-PTX paths (not the interpreter)."""
    return q.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


def packed_span(store: PackedKVStore, meta: LevelMetadata, block_tables, block_size: int) -> int:
    """Positions the readers cover: whole groups over the packed rows and the BF16 pages."""
    g = store.group_size
    return math.ceil(max(block_tables.shape[1] * block_size, meta.maps.shape[2]) / g) * g


def layer_pools(store: PackedKVStore, layer: int) -> tuple[torch.Tensor, ...]:
    """K codes, min, scale, V codes, min, scale of one layer (the packed kernels' order)."""
    return tuple(pool[:, layer] for pool in store.pools)


def packed_strides(pools, meta, key_cache, value_cache, block_tables) -> tuple[int, ...]:
    """The strides every packed kernel takes in this order: layer pools, level metadata,
    the BF16 paged cache and its block tables."""
    kc, kmin, _, vc, vmin, _ = pools
    tables, maps, kinds = meta.tables, meta.maps, meta.kinds
    return (
        kc.stride(0),
        kc.stride(1),
        kc.stride(2),
        kmin.stride(0),
        kmin.stride(1),
        vc.stride(0),
        vc.stride(1),
        vc.stride(2),
        vmin.stride(0),
        vmin.stride(1),
        vmin.stride(2),
        tables.stride(0),
        tables.stride(1),
        maps.stride(0),
        maps.stride(1),
        kinds.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
    )


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
    tuning: PackedTuning = DEFAULT_TUNING,
    logits: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    selected: torch.Tensor | None = None,
    correction: tuple | None = None,
) -> torch.Tensor:
    """Decode attention of q [R, Hq, D] over each row's history: positions below
    ``packed_lengths`` from the packed store (reconstructed at the row's depth in
    registers), the rest from the BF16 paged cache [NB, BS, Hkv, D] through block_tables
    [R, MB]; context_lengths [R] int32. Returns [R, Hq, D] in q's dtype (or ``out_dtype``).
    Selection statistics (``packed_dense_source``): ``logits`` [R, Hq, T >= the grid's
    span] FP32 receives every visible key's scaled logit, ``lse`` [R, Hq] FP32 the LSE.
    ``selected`` [R, Hq, >= the span] uint8: only marked positions attend; ``correction``
    (output, contribution [R, Hq, D], mass [R, Hq], FP32) is applied by the merge (the
    streamed loop 3-4 correction, ``packed_streamed_correction_triton``)."""
    from flashloop_backend.kernels.triton.packed_decode_jit import packed_decode_split_kernel

    rows, num_q_heads, head_dim = check_paged_inputs(
        q, key_cache, value_cache, block_tables, context_lengths
    )
    _, block_size, num_kv_heads, _ = key_cache.shape
    _, store_heads, store_dim = store.shape
    if (store_heads, store_dim) != (num_kv_heads, head_dim):
        raise ValueError(
            f"store holds {store_heads} heads x {store_dim} dims; "
            f"the cache {num_kv_heads} x {head_dim}"
        )
    tables, maps = meta.tables, meta.maps
    kinds, packed = meta.kinds, meta.packed_lengths
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
    if store.k_codes.device != q.device:
        raise ValueError(f"the packed store lives on {store.k_codes.device}; q is on {q.device}")
    out = torch.empty_like(q, dtype=out_dtype or q.dtype)
    if rows == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    g = store.group_size
    groups = packed_span(store, meta, block_tables, block_size) // g
    if logits is not None and (logits.shape[:2] != q.shape[:2] or logits.shape[2] < groups * g):
        raise ValueError(
            f"logits must be [{rows}, {num_q_heads}, >= {groups * g}]; got {tuple(logits.shape)}"
        )
    if selected is not None and (
        selected.dtype != torch.uint8
        or selected.device != q.device
        or selected.shape[:2] != q.shape[:2]
        or selected.shape[2] < groups * g
        or selected.stride(2) != 1
        or logits is not None
    ):
        raise ValueError(
            f"selected must be uint8 [{rows}, {num_q_heads}, >= {groups * g}] on {q.device}, "
            f"last axis contiguous, without logits; got {selected.dtype} "
            f"{tuple(selected.shape)} on {selected.device}"
        )
    want = max(1, math.ceil(tuning.programs_per_sm * sm_count(q.device) / (rows * num_q_heads)))
    splits = max(1, min(want, groups))
    per_split = math.ceil(groups / splits)
    part_out, part_max, part_sum = split_buffers(rows, num_q_heads, splits, head_dim, q.device)
    pools = layer_pools(store, layer)
    block_tables = block_tables.contiguous()
    args = (
        q,
        *pools,
        tables,
        maps,
        kinds,
        packed,
        key_cache,
        value_cache,
        block_tables,
        context_lengths,
        part_out,
        part_max,
        part_sum,
        logits if logits is not None else part_max,
        selected if selected is not None else packed,
        scale,
        q.stride(0),
        q.stride(1),
        *packed_strides(pools, meta, key_cache, value_cache, block_tables),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_max.stride(0),
        part_max.stride(1),
        logits.stride(0) if logits is not None else 0,
        logits.stride(1) if logits is not None else 0,
        selected.stride(0) if selected is not None else 0,
        selected.stride(1) if selected is not None else 0,
        per_split,
    )
    shape = dict(
        GROUP_Q=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        GROUP=g,
        BLOCK_SIZE=block_size,
        LEVELS=tables.shape[1],
        STORE_LOGITS=logits is not None,
        SELECTED=selected is not None,
        HALF=tuning.half_products and logits is None and selected is None,
        ASM=uses_ptx(q),
        ROWS=rows_per_step(tuning, g, tables.shape[1]),
        num_warps=warps_for(tuning, tables.shape[1]),
    )
    packed_decode_split_kernel[(rows, num_q_heads, splits)](*args, **shape)
    return merge_splits(part_out, part_max, part_sum, out, lse, correction)
