"""Sparse decode over packed INT4 KV without host syncs (the ``packed_dense_source`` and
``packed_sparse_correction`` contracts, ``ops.py``): the loop-2 source runs the packed
reader with logits, the Triton top-K selection, and sums p * v over the selected keys
reconstructed in registers; the correction reconstructs only the selected keys and runs
the softmax over them in the same kernel (``packed_selected_jit.py``), split over programs
from shapes only; ``packed_streamed_correction_triton`` is the streamed correction (the
reader over whole pages, unselected logits masked; the ``triton_streamed`` override, which
suits dense levels and not compact ones).
``packed_gather`` materialises chosen positions (a reconstruction tool the tests compare
with the store's history)."""

from __future__ import annotations

import math

import torch

from flashloop_backend.kernels.triton.dense_source import check_bucket
from flashloop_backend.kernels.triton.packed_decode import (
    DEFAULT_TUNING,
    PackedTuning,
    layer_pools,
    packed_decode_triton,
    packed_span,
    packed_strides,
)
from flashloop_backend.kernels.triton.paged_decode import merge_splits, split_buffers
from flashloop_backend.kernels.triton.sparse_decode import KEYS_PER_SPLIT_MIN
from flashloop_backend.kernels.triton.threshold_select import (
    DEFAULT_SELECT,
    SelectTuning,
    select_top_keys,
)
from flashloop_backend.kv.levels import LevelMetadata
from flashloop_backend.kv.store import PackedKVStore

GATHER_BLOCK_N = 32  # positions per program of packed_gather (a test tool, untimed)
# The selected-key launch: 16 positions per step by 2 warps is the fastest that
# ``bench packed`` times (against 32 x 4 and 16 x 4) for the source and both corrections,
# dense levels and token-sparse alike (results/bench_packed_kv_sparse_ops.json).
BLOCK_N = 16
SELECTED_WARPS = 2
# Programs in all over the (row, head) pairs: the optimum of the launch sweep at batch 1 and
# 16 alike (results/README.md, "Sparse decode, issue 22").
SELECTED_PROGRAMS = 512
# Level counts below this read V by channel (positions along the fast axis): faster at two
# and three levels, slower at four than V read as rows with K, both timed with the levels
# unrolled (results/README.md, issue 22).
V_BY_CHANNEL_BELOW = 4


def packed_key_splits(rows: int, heads: int, bucket: int, programs: int) -> tuple[int, int]:
    """(splits, keys per split) over each (row, head)'s ``bucket`` selected keys: about
    ``programs`` programs in all (never fewer than one split per pair), at least
    ``KEYS_PER_SPLIT_MIN`` keys per split."""
    want = max(1, programs // max(1, rows * heads))
    splits = max(1, min(want, math.ceil(bucket / KEYS_PER_SPLIT_MIN)))
    return splits, math.ceil(bucket / splits)


def packed_gather(
    store: PackedKVStore,
    layer: int,
    meta: LevelMetadata,
    key_cache,
    value_cache,
    block_tables,
    positions: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V [R, Hq, N, D] in ``dtype`` at ``positions`` [R, Hq, N] int32 (-1: zeros):
    the row's reconstruction at its depth below its packed length, BF16 pages above."""
    from flashloop_backend.kernels.triton.packed_gather_jit import packed_gather_kernel

    rows, num_q_heads, count = positions.shape
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    if positions.dtype != torch.int32 or positions.device != key_cache.device:
        raise ValueError(
            f"positions must be int32 on {key_cache.device}; "
            f"got {positions.dtype} on {positions.device}"
        )
    if num_q_heads % num_kv_heads or tuple(store.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"positions for {num_q_heads} query heads do not fit the store's "
            f"{tuple(store.shape[1:])} / cache's {num_kv_heads} x {head_dim}"
        )
    out_k = torch.empty((rows, num_q_heads, count, head_dim), dtype=dtype, device=key_cache.device)
    out_v = torch.empty_like(out_k)
    if rows == 0 or count == 0:
        return out_k, out_v
    positions, block_tables = positions.contiguous(), block_tables.contiguous()
    tables, maps, kinds = meta.tables, meta.maps, meta.kinds
    pools = layer_pools(store, layer)
    packed_gather_kernel[(rows, num_q_heads, math.ceil(count / GATHER_BLOCK_N))](
        positions,
        *pools,
        tables,
        maps,
        kinds,
        meta.packed_lengths,
        key_cache,
        value_cache,
        block_tables,
        out_k,
        out_v,
        positions.stride(0),
        positions.stride(1),
        *packed_strides(pools, meta, key_cache, value_cache, block_tables),
        out_k.stride(0),
        out_k.stride(1),
        out_k.stride(2),
        count,
        GROUP_Q=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        GROUP=store.group_size,
        BLOCK_SIZE=block_size,
        LEVELS=tables.shape[1],
        BLOCK_N=GATHER_BLOCK_N,
    )
    return out_k, out_v


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
    v_by_channel: bool | None = None,
):
    """Split partials over the selected positions ``indices`` [R, Hq, Kb] (-1: none), keys
    reconstructed in registers ``block_n`` positions at a time by ``num_warps`` warps,
    about ``programs`` programs in all, V read by channel or as rows (``v_by_channel``;
    None: by channel below ``V_BY_CHANNEL_BELOW`` levels):
    (acc [R, Hq, S, D], max, sum [R, Hq, S]) of the softmax of q k^T * scale, or with
    ``logits`` [R, Hq, T] / ``lse`` [R, Hq] only acc = sum exp(logit - lse) v per split
    (the loop-2 contribution)."""
    from flashloop_backend.kernels.triton.packed_selected_jit import packed_selected_split_kernel

    rows, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    if block_n not in (16, 32, 64):
        raise ValueError(f"block_n={block_n} must be one of 16, 32, 64")
    if num_warps not in (1, 2, 4, 8):
        raise ValueError(f"num_warps={num_warps} must be one of 1, 2, 4, 8")
    if indices.shape[:2] != (rows, num_q_heads) or indices.dtype != torch.int32:
        raise ValueError(
            f"indices must be int32 [{rows}, {num_q_heads}, Kb]; "
            f"got {indices.dtype} {tuple(indices.shape)}"
        )
    if num_q_heads % num_kv_heads or tuple(store.shape[1:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"q [R, {num_q_heads}, {head_dim}] does not fit the store's "
            f"{tuple(store.shape[1:])} / cache's {num_kv_heads} heads"
        )
    bucket = indices.shape[-1]
    splits, keys_per_split = packed_key_splits(rows, num_q_heads, max(1, bucket), programs)
    part_out, part_max, part_sum = split_buffers(rows, num_q_heads, splits, head_dim, q.device)
    if rows == 0 or bucket == 0:
        return part_out.zero_(), part_max.fill_(float("-inf")), part_sum.zero_()
    indices, block_tables = indices.contiguous(), block_tables.contiguous()
    tables, maps, kinds = meta.tables, meta.maps, meta.kinds
    pools = layer_pools(store, layer)
    from_logits = logits is not None
    packed_selected_split_kernel[(rows, num_q_heads, splits)](
        q,
        indices,
        logits if from_logits else part_max,
        lse if from_logits else part_max,
        *pools,
        tables,
        maps,
        kinds,
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
        *packed_strides(pools, meta, key_cache, value_cache, block_tables),
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
        LEVELS=tables.shape[1],
        BLOCK_N=block_n,
        FROM_LOGITS=from_logits,
        V_BY_CHANNEL=tables.shape[1] < V_BY_CHANNEL_BELOW if v_by_channel is None else v_by_channel,
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
    block_n: int = BLOCK_N,
    num_warps: int = SELECTED_WARPS,
    programs: int = SELECTED_PROGRAMS,
    v_by_channel: bool | None = None,
):
    """O = O_ref - C_ref + m * softmax(q k_S^T * scale) v_S with k_S, v_S reconstructed at
    ``indices`` [R, Hq, Kb] only, in registers. Returns [R, Hq, D] in q's dtype."""
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
        v_by_channel=v_by_channel,
    )
    return merge_splits(
        *parts, torch.empty_like(q), correction=_correction_terms(output, contribution, mass)
    )


def packed_streamed_correction_triton(
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
    tuning: PackedTuning = DEFAULT_TUNING,
):
    """:func:`packed_sparse_correction_triton`'s result, streamed: the packed reader
    streams every page of the row up to its last selected position and masks the logits of
    positions not in ``indices`` [R, Hq, Kb] (-1: none), instead of gathering the selected
    keys (whose V rows each touch a whole page block per level). Returns [R, Hq, D]."""
    rows, num_q_heads, _ = q.shape
    span = packed_span(store, meta, block_tables, key_cache.shape[1])
    marks = torch.zeros((rows, num_q_heads, span + 1), dtype=torch.uint8, device=q.device)
    if indices.shape[-1]:
        valid = indices >= 0  # -1 lands in the spare last column, which no read reaches
        marks.scatter_(2, torch.where(valid, indices, span).long(), 1)
        lengths = (indices.amax(dim=-1).amax(dim=-1) + 1).to(torch.int32)  # 0: nothing selected
    else:
        lengths = torch.zeros(rows, dtype=torch.int32, device=q.device)
    return packed_decode_triton(
        q,
        store,
        layer,
        meta,
        key_cache,
        value_cache,
        block_tables,
        lengths,
        scale,
        tuning,
        selected=marks,
        correction=_correction_terms(output, contribution, mass),
    )


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
    v_by_channel: bool | None = None,
) -> tuple[torch.Tensor, ...]:
    """(out [R, Hq, D] q.dtype, indices [R, Hq, Kb] int32 in position order (-1 past K),
    mass [R, Hq], output [R, Hq, D], contribution [R, Hq, D]; the last three FP32), with
    K = max(1, ceil(key_retention * T)) and Kb = ``k_bucket`` (the ``PackedDenseSource``
    contract)."""
    rows, num_q_heads, _ = q.shape
    span = packed_span(store, meta, block_tables, key_cache.shape[1])
    check_bucket(span, rows, key_retention, k_bucket)
    logits = torch.empty((rows, num_q_heads, span), device=q.device, dtype=torch.float32)
    lse = torch.empty((rows, num_q_heads), device=q.device, dtype=torch.float32)
    output = packed_decode_triton(
        q,
        store,
        layer,
        meta,
        key_cache,
        value_cache,
        block_tables,
        context_lengths,
        scale,
        logits=logits,
        lse=lse,
        out_dtype=torch.float32,
    )
    out = torch.empty_like(q)
    indices = torch.empty((rows, num_q_heads, k_bucket), dtype=torch.int32, device=q.device)
    mass = torch.empty((rows, num_q_heads), dtype=torch.float32, device=q.device)
    unused = torch.empty_like(output)  # the contribution: summed below from packed values
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
    part_out, _, _ = packed_selected_parts(
        q,
        store,
        layer,
        meta,
        key_cache,
        value_cache,
        block_tables,
        indices,
        scale,
        logits,
        lse,
        block_n,
        num_warps,
        programs,
        v_by_channel,
    )
    return out, indices, mass, output, part_out.sum(2)
