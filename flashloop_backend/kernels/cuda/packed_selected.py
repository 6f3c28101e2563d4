"""Wrapper of the CUDA selected-key kernel (``packed_selected.cu``) and the packed
sparse-decode op over it, the loop 3-4 correction (``packed_sparse_correction``). BF16
queries and caches, head_dim 128; compact levels are read through their maps."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from flashloop_backend.kernels.cuda import loader
from flashloop_backend.kernels.cuda.packed_stream import unsupported
from flashloop_backend.kernels.triton.packed_decode import check_packed_inputs
from flashloop_backend.kernels.triton.packed_sparse import check_selected_indices, packed_key_splits
from flashloop_backend.kernels.triton.paged_decode import (
    merge_splits,
    sm_count,
    split_buffers,
)
from flashloop_backend.kernels.validate import correction_target
from flashloop_backend.kv.levels import LevelMetadata
from flashloop_backend.kv.store import PackedKVStore

WARPS = 4


@dataclass(frozen=True)
class SelectedTuning:
    """Launch of the selected-key kernel: about ``ctas_per_sm`` CTAs of 4 warps per SM
    over the (row, head) pairs, at least ``keys_per_split`` keys a split, registers capped
    so that ``resident_ctas`` CTAs fit on an SM at once (0: no cap)."""

    ctas_per_sm: int = 4
    keys_per_split: int = 64
    resident_ctas: int = 4


DEFAULT_SELECTED = SelectedTuning()

INT_FIELDS = (
    *("q_row", "q_head", "i_row", "i_head"),
    *("t_row", "t_level", "m_row", "m_level", "kind_row"),
    *("k_block", "k_slot", "k_head", "v_block", "v_slot", "v_head", "bt_row"),
    *("o_row", "o_head", "o_split", "s_row", "s_head"),
    *("keys_per_split", "bucket", "group_q", "block_size"),
)


class _Params(ctypes.Structure):
    # the C layout of Params in packed_selected.cu
    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("q", "indices", "blocks")),
        ("page_bytes", ctypes.c_int64),
        *(
            (name, ctypes.c_void_p)
            for name in ("tables", "maps", "kinds", "packed", "k_cache", "v_cache")
        ),
        *((name, ctypes.c_void_p) for name in ("block_tables", "part_out", "part_max")),
        ("part_sum", ctypes.c_void_p),
        ("scale", ctypes.c_float),
        *((name, ctypes.c_int) for name in INT_FIELDS),
    ]


def packed_selected_parts_cuda(
    q,
    store: PackedKVStore,
    layer: int,
    meta: LevelMetadata,
    key_cache,
    value_cache,
    block_tables,
    indices: torch.Tensor,
    scale: float,
    tuning: SelectedTuning = DEFAULT_SELECTED,
):
    """``packed_selected_parts``' contract (split partials over the selected positions
    ``indices`` [R, Hq, Kb], increasing, -1 after them) by the CUDA kernel."""
    rows, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    reason = unsupported(q, store, key_cache)
    if reason is not None:
        raise ValueError(f"packed_selected_parts_cuda: {reason}")
    check_selected_indices(q, indices)
    check_packed_inputs(q, store, meta, key_cache)
    bucket = indices.shape[-1]
    splits, keys_per_split = packed_key_splits(
        rows,
        num_q_heads,
        max(1, bucket),
        tuning.ctas_per_sm * sm_count(q.device),
        tuning.keys_per_split,
    )
    part_out, part_max, part_sum = split_buffers(rows, num_q_heads, splits, head_dim, q.device)
    if rows == 0 or bucket == 0:
        return part_out.zero_(), part_max.fill_(float("-inf")), part_sum.zero_()
    indices, block_tables = indices.contiguous(), block_tables.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    codes = store.blocks[:, layer]
    levels = meta.tables.shape[1]
    t = lambda x: x.data_ptr()  # noqa: E731
    params = _Params(
        t(q),
        t(indices),
        t(codes),
        codes.stride(0),
        t(meta.tables),
        t(meta.maps),
        t(meta.kinds),
        t(meta.packed_lengths),
        t(key_cache),
        t(value_cache),
        t(block_tables),
        t(part_out),
        t(part_max),
        t(part_sum),
        scale,
        q.stride(0),
        q.stride(1),
        indices.stride(0),
        indices.stride(1),
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
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_max.stride(0),
        part_max.stride(1),
        keys_per_split,
        bucket,
        num_q_heads // num_kv_heads,
        block_size,
    )
    defines = {
        "HEAD_DIM": head_dim,
        "GROUP": store.group_size,
        "LEVELS": levels,
        "WARPS": WARPS,
        "COMPACT_FROM": min(meta.compact_from, levels),
        "MIN_CTAS": tuning.resident_ctas,
    }
    kernel = loader.build_file("packed_selected", defines)
    kernel((splits, num_q_heads, rows), (WARPS * 32, 1, 1), [params])
    return part_out, part_max, part_sum


def packed_sparse_correction_cuda(
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
    tuning: SelectedTuning = DEFAULT_SELECTED,
):
    """O = O_ref - C_ref + m * softmax(q k_S^T * scale) v_S over the selected keys
    ``indices`` [R, Hq, Kb] read at the rows' depth (``PackedSparseCorrection``; into
    ``base`` at the rows where ``serves`` holds, when given)."""
    out = correction_target(q, base, serves)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    parts = packed_selected_parts_cuda(
        q,
        store,
        layer,
        meta,
        key_cache,
        value_cache,
        block_tables,
        indices.to(torch.int32),
        scale,
        tuning=tuning,
    )
    correction = (output.float().contiguous(), contribution.float().contiguous(), mass.float())
    return merge_splits(*parts, out, correction=correction, serves=serves)
