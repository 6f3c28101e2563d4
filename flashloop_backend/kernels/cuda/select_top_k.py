"""Wrapper of the one-launch loop-2 top-K selection (``select_top_k.cu``): the
``select_positions`` contract (``kernels/triton/threshold_select.py``) as one CTA per
(row, head) reading the row's logits three times."""

from __future__ import annotations

import ctypes

import torch

from flashloop_backend.algorithms import key_retention_fraction
from flashloop_backend.kernels.cuda import loader
from flashloop_backend.kernels.cuda.trace import POINTS, traced
from flashloop_backend.kernels.triton.threshold_select import Selection

THREADS = 1024  # per CTA
# tiles of 32 positions a warp loads before using any: 4 fits the 32 registers a thread
# has when an SM holds two CTAs; 8 takes more registers and one CTA per SM
BATCH = (4, 8)


class _Params(ctypes.Structure):
    # the C layout of Params in select_top_k.cu
    _fields_ = [
        *(
            (name, ctypes.c_void_p)
            for name in "logits lse lengths plan offsets indices mass".split()
        ),
        ("l_row", ctypes.c_int64),
        ("l_head", ctypes.c_int64),
        *((name, ctypes.c_int) for name in "e_row i_row i_head m_row".split()),
        *((name, ctypes.c_int) for name in "ratio_num ratio_den bucket".split()),
        *((name, ctypes.c_void_p) for name in ("part_max", "part_sum")),
        *((name, ctypes.c_int) for name in "s_row s_head splits".split()),
    ]


def select_positions_cuda(
    logits: torch.Tensor,
    lse: torch.Tensor,
    context_lengths: torch.Tensor,
    indices: torch.Tensor,
    key_retention: float,
    batch: int = 4,
    split_states: tuple[torch.Tensor, torch.Tensor] | None = None,
    trace: torch.Tensor | None = None,
    rank_list: int = 0,
) -> Selection:
    """Top-K selection over ``logits`` [R, H, T] FP32 (each row valid
    below its ``context_lengths`` [R] int32) with ``lse`` [R, H] FP32: writes ``indices``
    [R, H, Kb] int32 in position order (-1 past K = max(1, ceil(key_retention * T))) and
    returns the plan as one split (``part_mass`` [R, H, 1] holds the mass); ``batch``
    tiles in flight per warp, one of ``BATCH``. With ``split_states`` (the keys pass's
    part_max and part_sum [R, H, S] FP32, natural log) the kernel merges each row's lse
    from them and writes it into ``lse`` (``merge_lse``'s work) instead of reading it.
    ``trace``: phase timestamps [R * H, points, 2] int64 (``trace.py``). ``rank_list``: a
    candidate list of up to that many keys is ranked directly in place of the three radix
    digits (0: never; at most ``THREADS``)."""
    rows, heads, bucket = indices.shape
    span = logits.shape[-1]
    if logits.dtype != torch.float32 or lse.dtype != torch.float32:
        raise ValueError(f"logits and lse must be float32; got {logits.dtype}, {lse.dtype}")
    if context_lengths.dtype != torch.int32 or indices.dtype != torch.int32:
        raise ValueError(
            f"context_lengths and indices must be int32; got {context_lengths.dtype}, "
            f"{indices.dtype}"
        )
    if logits.shape[:2] != (rows, heads) or lse.shape != (rows, heads):
        raise ValueError(
            f"logits {tuple(logits.shape)} and lse {tuple(lse.shape)} must lead with "
            f"indices' (rows, heads) = {(rows, heads)}"
        )
    if logits.stride(-1) != 1 or lse.stride(-1) != 1 or indices.stride(-1) != 1:
        raise ValueError("logits, lse and indices must have unit stride on their last axis")
    if batch not in BATCH:
        raise ValueError(f"batch={batch} must be one of {BATCH}")
    if not 0 <= rank_list <= THREADS:
        raise ValueError(f"rank_list={rank_list} must be in [0, {THREADS}] (the threads per CTA)")
    states = _split_states(split_states, rows, heads)
    device = logits.device
    int32 = {"dtype": torch.int32, "device": device}
    plan = torch.empty((rows, heads, 3), **int32)
    offsets = torch.empty((rows, heads, 1, 2), **int32)
    part_mass = torch.empty((rows, heads, 1), dtype=torch.float32, device=device)
    selection = Selection(plan, offsets, part_mass, 1, span)
    if rows == 0 or heads == 0:
        return selection
    ratio_num, ratio_den = key_retention_fraction(key_retention)
    t = lambda x: ctypes.c_void_p(x.data_ptr()).value  # noqa: E731
    params = _Params(
        *(t(logits), t(lse), t(context_lengths), t(plan), t(offsets), t(indices), t(part_mass)),
        *(logits.stride(0), logits.stride(1), lse.stride(0)),
        *(indices.stride(0), indices.stride(1), part_mass.stride(0)),
        *(ratio_num, ratio_den, bucket),
        *states,
    )
    defines = {"THREADS": THREADS, "BATCH": batch, "MIN_CTAS": 2 if batch == 4 else 1}
    if rank_list:
        defines["RANK_LIST"] = rank_list
    if trace is not None:
        defines["TRACE"] = len(POINTS["select"])
        params = traced(params, trace, rows * heads, "select")
    kernel = loader.build_file("select_top_k", defines)
    kernel((heads, rows, 1), (THREADS, 1, 1), [params])
    return selection


def _split_states(states: tuple[torch.Tensor, torch.Tensor] | None, rows: int, heads: int):
    """The kernel's (part_max, part_sum, s_row, s_head, splits) fields of ``states``."""
    if states is None:
        return (None, None, 0, 0, 0)
    part_max, part_sum = states
    if part_max.dtype != torch.float32 or part_sum.dtype != torch.float32:
        raise ValueError(f"split states must be float32; got {part_max.dtype}, {part_sum.dtype}")
    if (
        part_max.dim() != 3
        or part_max.shape[:2] != (rows, heads)
        or part_sum.shape != part_max.shape
    ):
        raise ValueError(
            f"split states {tuple(part_max.shape)}, {tuple(part_sum.shape)} must both be "
            f"[rows, heads, splits] with (rows, heads) = {(rows, heads)}"
        )
    if part_max.stride() != part_sum.stride() or part_max.stride(-1) != 1:
        raise ValueError("split states must share strides with unit stride on the splits")
    return (
        part_max.data_ptr(),
        part_sum.data_ptr(),
        part_max.stride(0),
        part_max.stride(1),
        part_max.shape[-1],
    )
