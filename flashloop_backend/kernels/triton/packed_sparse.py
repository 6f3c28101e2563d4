"""Sparse decode over packed INT4 KV (encoding v3) without host syncs (the
``packed_dense_source`` and ``packed_sparse_correction`` contracts, ``ops.py``): the
loop-2 source runs the packed reader with logits, the Triton top-K selection, and sums
p * v over the selected keys reconstructed in registers; the correction reconstructs only
the selected keys and runs the softmax over them in the same kernel
(``packed_selected_jit.py``), split over programs from shapes only."""

from __future__ import annotations

import math

import torch

from flashloop_backend.kernels.triton.dense_source import check_bucket
from flashloop_backend.kernels.triton.packed_decode import (
    check_packed_inputs,
    layer_blocks,
    metadata_strides,
    packed_decode_triton,
    packed_span,
    uses_ptx,
)
from flashloop_backend.kernels.triton.paged_decode import merge_splits, next_pow2, split_buffers
from flashloop_backend.kernels.triton.threshold_select import (
    DEFAULT_SELECT,
    SelectTuning,
    select_top_keys,
    source_outputs,
)
from flashloop_backend.kernels.validate import correction_target
from flashloop_backend.kv.levels import LevelMetadata
from flashloop_backend.kv.store import PackedKVStore

# The selected-key launch: BLOCK_N keys per block whose pages lie within PAGE_WINDOW pages
# of each level (the folded query's rows per level), by SELECTED_WARPS warps, about
# SELECTED_PROGRAMS programs in all over the (row, head) pairs, at least KEYS_PER_SPLIT
# keys a split.
BLOCK_N = 16
PAGE_WINDOW = 16
SELECTED_WARPS = 4
SELECTED_PROGRAMS = 1024
KEYS_PER_SPLIT = 64
# Absolute and relative tolerance of the selected-key reads against the FP32
# reconstruction: FP16 folded weights times exact codes on tensor cores, summed in FP32
# (as ``PLAIN_READ_TOLERANCE``).
SELECTED_READ_TOLERANCE = 2e-3


def packed_key_splits(
    rows: int, heads: int, bucket: int, programs: int, min_keys: int = KEYS_PER_SPLIT
) -> tuple[int, int]:
    """(splits, keys per split) over each (row, head)'s ``bucket`` selected keys: about
    ``programs`` programs in all (never fewer than one split per pair), at least
    ``min_keys`` keys per split."""
    want = max(1, programs // max(1, rows * heads))
    splits = max(1, min(want, math.ceil(bucket / min_keys)))
    return splits, math.ceil(bucket / splits)


def check_selected_indices(q, indices: torch.Tensor) -> None:
    """``indices`` must be int32 [R, Hq, Kb] for q [R, Hq, D]."""
    rows, num_q_heads = q.shape[:2]
    if indices.shape[:2] != (rows, num_q_heads) or indices.dtype != torch.int32:
        raise ValueError(
            f"indices must be int32 [{rows}, {num_q_heads}, Kb]; "
            f"got {indices.dtype} {tuple(indices.shape)}"
        )


def packed_selected_parts(
    q,
    store: PackedKVStore,
    layer: int,
    meta: LevelMetadata,
    key_cache,
    value_cache,
    block_tables,
    indices: torch.Tensor,
    scale: float,
    logits: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    block_n: int = BLOCK_N,
    num_warps: int = SELECTED_WARPS,
    programs: int = SELECTED_PROGRAMS,
    page_window: int = PAGE_WINDOW,
):
    """Split partials over the selected positions ``indices`` [R, Hq, Kb] (sorted, -1 past
    the last), keys reconstructed in registers ``block_n`` at a time within ``page_window``
    pages per level, by ``num_warps`` warps, about ``programs`` programs in all:
    (acc [R, Hq, S, D], max, sum [R, Hq, S]) of the softmax of q k^T * scale, or with
    ``logits`` [R, Hq, T] / ``lse`` [R, Hq] only acc = sum exp(logit - lse) v per split
    (the loop-2 contribution)."""
    from flashloop_backend.kernels.triton.packed_selected_jit import packed_selected_split_kernel

    rows, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if block_n not in (16, 32, 64):
        raise ValueError(f"block_n={block_n} must be one of 16, 32, 64")
    if page_window not in (16, 32):
        raise ValueError(f"page_window={page_window} must be 16 or 32")
    if num_warps not in (1, 2, 4, 8):
        raise ValueError(f"num_warps={num_warps} must be one of 1, 2, 4, 8")
    check_selected_indices(q, indices)
    if num_q_heads % num_kv_heads or tuple(store.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"q [R, {num_q_heads}, {head_dim}] does not fit the store's "
            f"{tuple(store.shape[1:])} / cache's {num_kv_heads} heads"
        )
    check_packed_inputs(q, store, meta, key_cache)
    bucket = indices.shape[-1]
    splits, keys_per_split = packed_key_splits(rows, num_q_heads, max(1, bucket), programs)
    part_out, part_max, part_sum = split_buffers(rows, num_q_heads, splits, head_dim, q.device)
    if rows == 0 or bucket == 0:
        return part_out.zero_(), part_max.fill_(float("-inf")), part_sum.zero_()
    indices, block_tables = indices.contiguous(), block_tables.contiguous()
    codes, halves, page_bytes = layer_blocks(store, layer)
    levels = meta.tables.shape[1]
    from_logits = logits is not None
    packed_selected_split_kernel[(rows, num_q_heads, splits)](
        q,
        indices,
        logits if from_logits else part_max,
        lse if from_logits else part_max,
        codes,
        halves,
        meta.tables,
        meta.maps,
        meta.kinds,
        meta.packed_lengths,
        key_cache,
        value_cache,
        block_tables,
        part_out,
        part_max,
        part_sum,
        scale,
        q.stride(0),
        q.stride(1),
        indices.stride(0),
        indices.stride(1),
        logits.stride(0) if from_logits else 0,
        logits.stride(1) if from_logits else 0,
        lse.stride(0) if from_logits else 0,
        page_bytes,
        *metadata_strides(meta, key_cache, value_cache, block_tables),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_max.stride(0),
        part_max.stride(1),
        keys_per_split,
        bucket,
        GROUP_Q=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        GROUP=store.group_size,
        BLOCK_SIZE=block_size,
        LEVELS=levels,
        LP=max(2, next_pow2(levels)),
        BLOCK_N=block_n,
        NPW=page_window,
        COMPACT_FROM=min(meta.compact_from, levels),
        FROM_LOGITS=from_logits,
        ASM=uses_ptx(q),
        num_warps=num_warps,
    )
    return part_out, part_max, part_sum


def _correction_terms(output, contribution, mass) -> tuple[torch.Tensor, ...]:
    """The loop-2 reference terms as ``merge_splits``' correction takes them (FP32)."""
    return output.float().contiguous(), contribution.float().contiguous(), mass.float()


def packed_sparse_correction_triton(
    q,
    store,
    layer,
    meta,
    key_cache,
    value_cache,
    block_tables,
    indices,
    mass,
    output,
    contribution,
    scale=None,
    base=None,
    serves=None,
    block_n: int = BLOCK_N,
    num_warps: int = SELECTED_WARPS,
    programs: int = SELECTED_PROGRAMS,
):
    """O = O_ref - C_ref + m * softmax(q k_S^T * scale) v_S with k_S, v_S reconstructed at
    ``indices`` [R, Hq, Kb] only, in registers. Returns [R, Hq, D] in q's dtype: ``base``
    with the rows where ``serves`` holds written, when given (``correction_into_base``)."""
    out = correction_target(q, base, serves)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    parts = packed_selected_parts(
        q,
        store,
        layer,
        meta,
        key_cache,
        value_cache,
        block_tables,
        indices.to(torch.int32),
        scale,
        block_n=block_n,
        num_warps=num_warps,
        programs=programs,
    )
    terms = _correction_terms(output, contribution, mass)
    return merge_splits(*parts, out, correction=terms, serves=serves)


def packed_dense_source_triton(
    q: torch.Tensor,
    store: PackedKVStore,
    layer: int,
    meta: LevelMetadata,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    key_retention: float,
    k_bucket: int,
    scale: float | None = None,
    tuning: SelectTuning = DEFAULT_SELECT,
    block_n: int = BLOCK_N,
    num_warps: int = SELECTED_WARPS,
    programs: int = SELECTED_PROGRAMS,
) -> tuple[torch.Tensor, ...]:
    """The ``PackedDenseSource`` contract from the Triton packed read with logits, the
    Triton top-K selection (``tuning``) and the Triton selected-key kernel for the selected
    keys' contribution: (out [R, Hq, D] q.dtype, indices [R, Hq, Kb] int32 in position
    order (-1 past K), mass [R, Hq], output [R, Hq, D], contribution [R, Hq, D]; the last
    three FP32), with K = max(1, ceil(key_retention * T)) and Kb = ``k_bucket``."""
    rows, num_q_heads, _ = q.shape
    span = packed_span(store, meta, block_tables, key_cache.shape[1])
    check_bucket(span, rows, key_retention, k_bucket)
    logits = torch.empty((rows, num_q_heads, span), device=q.device, dtype=torch.float32)
    lse = torch.empty((rows, num_q_heads), device=q.device, dtype=torch.float32)
    paged = (key_cache, value_cache, block_tables)
    output = packed_decode_triton(
        q,
        store,
        layer,
        meta,
        *paged,
        context_lengths,
        scale,
        logits=logits,
        lse=lse,
        out_dtype=torch.float32,
    )
    # the contribution is summed below from packed values, not by the selection
    out, indices, mass, output, unused = source_outputs(q, k_bucket, output)
    if rows == 0:
        return out, indices, mass, output, unused
    select_top_keys(
        logits,
        lse,
        context_lengths,
        None,
        block_tables.contiguous(),
        output,
        out,
        indices,
        mass,
        unused,
        key_retention,
        tuning,
    )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    parts = (indices, scale, logits, lse, block_n, num_warps, programs)
    part_out, _, _ = packed_selected_parts(q, store, layer, meta, *paged, *parts)
    return out, indices, mass, output, part_out.sum(2)
