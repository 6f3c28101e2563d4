"""Wrapper of ``packed_contribution.cu``: the loop-2 contribution over the selected keys
alone, which the source (``packed_source.py``) runs on its statistics stream beside a
values pass that sums the dense output alone."""

from __future__ import annotations

import ctypes

import torch

from flashloop_backend.kernels.cuda import loader
from flashloop_backend.kernels.cuda.arrivals import arrival_counters
from flashloop_backend.kernels.validate import check_unit_last_stride
from flashloop_backend.kv.levels import LevelMetadata
from flashloop_backend.kv.store import PackedKVStore

WARPS = 4
KEYS_PER_SPLIT = 128  # selected positions a CTA takes


class _Params(ctypes.Structure):
    # the C layout of ContribParams in packed_contribution.cu
    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("indices", "logits", "lse", "blocks")),
        ("page_bytes", ctypes.c_int64),
        *(
            (name, ctypes.c_void_p)
            for name in "tables kinds packed v_cache block_tables part_contrib counters "
            "contribution".split()
        ),
        *(
            (name, ctypes.c_int)
            for name in "i_row i_head g_row g_head e_row t_row t_level kind_row v_block v_slot "
            "v_head bt_row o_row o_head o_split c_row c_head keys_per_split bucket group_q "
            "block_size".split()
        ),
    ]


def check_contribution_inputs(
    indices: torch.Tensor, logits: torch.Tensor, contribution: torch.Tensor
) -> None:
    """What :func:`selected_contribution` needs of its own buffers beyond the source's
    checks: each with a contiguous last dim."""
    check_unit_last_stride(
        "selected_contribution", indices=indices, logits=logits, contribution=contribution
    )


def selected_contribution(
    indices: torch.Tensor,
    logits: torch.Tensor,
    lse: torch.Tensor,
    store: PackedKVStore,
    layer: int,
    meta: LevelMetadata,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    contribution: torch.Tensor,
    keys_per_split: int = KEYS_PER_SPLIT,
) -> None:
    """``contribution`` [R, Hq, D] FP32 = sum over the positions in ``indices`` [R, Hq, Kb]
    int32 (increasing, -1 after them) of exp(logit - lse) v, from the keys pass's natural
    ``logits`` [R, Hq, T] FP32 and ``lse`` [R, Hq] FP32; v is the sum of the dense levels
    of ``meta`` [R rows] below each row's packed length and the BF16 ``value_cache`` [NB,
    BS, Hkv, D] (through ``block_tables`` [R, MB] int32) above it. Shapes, dtypes and
    strides are the source's own (``packed_dense_source_cuda`` checks them)."""
    rows, num_q_heads, bucket = indices.shape
    _, block_size, num_kv_heads, head_dim = value_cache.shape
    check_contribution_inputs(indices, logits, contribution)
    if rows == 0 or bucket == 0:
        contribution.zero_()
        return
    splits = -(-bucket // keys_per_split)
    levels = meta.tables.shape[1]
    part = torch.empty(
        (rows, num_q_heads, splits, head_dim), dtype=torch.float32, device=indices.device
    )
    counters = arrival_counters(indices.device, rows * num_q_heads, role="statistics")
    codes = store.blocks[:, layer]
    t = lambda x: x.data_ptr()  # noqa: E731
    params = _Params(
        *(t(indices), t(logits), t(lse), t(codes), codes.stride(0)),
        *(t(meta.tables), t(meta.kinds), t(meta.packed_lengths), t(value_cache)),
        *(t(block_tables), t(part), t(counters), t(contribution)),
        *(indices.stride(0), indices.stride(1), logits.stride(0), logits.stride(1)),
        *(lse.stride(0), meta.tables.stride(0), meta.tables.stride(1), meta.kinds.stride(0)),
        *(*value_cache.stride()[:3], block_tables.stride(0)),
        *(part.stride(0), part.stride(1), part.stride(2)),
        *(contribution.stride(0), contribution.stride(1)),
        *(keys_per_split, bucket, num_q_heads // num_kv_heads, block_size),
    )
    defines = {
        "HEAD_DIM": head_dim,
        "GROUP": store.group_size,
        "LEVELS": levels,
        "WARPS": WARPS,
        "SELECTED": 0,
    }
    kernel = loader.build_file("packed_contribution", defines)
    kernel((splits, num_q_heads, rows), (WARPS * 32, 1, 1), [params])
