"""The split merge inside the CUDA readers (``SplitMerge`` in ``common.cuh``): the last CTA of
each (row, query head) merges the split partials into the output, so no merge launch
follows the reader. Its arrival counters live in one zeroed buffer per device that every
launch reuses: the last CTA puts each counter back to 0."""

from __future__ import annotations

import ctypes

import torch


class SplitMergeFields(ctypes.Structure):
    # the C layout of SplitMerge in common.cuh
    _fields_ = [
        *((name, ctypes.c_void_p) for name in ("counters", "out", "ref", "contrib", "mass")),
        *(
            (name, ctypes.c_int)
            for name in (
                "out_row",
                "out_head",
                "ref_row",
                "ref_head",
                "contrib_row",
                "contrib_head",
                "mass_row",
                "splits",
            )
        ),
    ]


NO_MERGE = SplitMergeFields()  # counters nullptr: the kernel writes its partials only
MERGE_SPLITS_MAX = 256  # MERGE_SPLITS_MAX in common.cuh: the most splits a CTA merges

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` int32 counters on ``device``, 0 between launches. The buffer grows
    only outside graph capture (a warm-up runs every shape eagerly first)."""
    held = _COUNTERS.get(device)
    if held is None or held.numel() < count:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"split-merge counters: {count} needed during graph capture, "
                f"{0 if held is None else held.numel()} allocated; run the shape eagerly first"
            )
        held = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = held
    return held


def split_merge(
    out: torch.Tensor,
    splits: int,
    correction: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> SplitMergeFields:
    """The merge record writing ``out`` [R, Hq, D] bf16 (last dim contiguous) from ``splits``
    partials per (row, head); ``correction`` = (O_ref [R, Hq, D], C_ref [R, Hq, D], m [R, Hq]),
    FP32 with contiguous last dims, turns it into O_ref - C_ref + m * merged."""
    rows, heads, _ = out.shape
    if not 1 <= splits <= MERGE_SPLITS_MAX:
        raise ValueError(f"split merge: splits={splits} must lie in [1, {MERGE_SPLITS_MAX}]")
    if out.dtype != torch.bfloat16 or out.stride(-1) != 1:
        raise ValueError(
            f"split merge: out must be bf16 with a contiguous last dim, got {out.dtype} "
            f"strides {tuple(out.stride())}"
        )
    counters = arrival_counters(out.device, rows * heads)
    fields = SplitMergeFields(counters.data_ptr(), out.data_ptr())
    fields.out_row, fields.out_head, fields.splits = out.stride(0), out.stride(1), splits
    if correction is not None:
        ref, contrib, mass = correction
        for name, t, dims in (("O_ref", ref, 3), ("C_ref", contrib, 3), ("mass", mass, 2)):
            if t.dtype != torch.float32 or t.dim() != dims or t.stride(-1) != 1:
                raise ValueError(
                    f"split merge: {name} must be FP32 [{'R, Hq, D' if dims == 3 else 'R, Hq'}] "
                    f"with a contiguous last dim, got {t.dtype} {tuple(t.shape)} "
                    f"strides {tuple(t.stride())}"
                )
            if tuple(t.shape) != tuple(out.shape[:dims]):
                raise ValueError(
                    f"split merge: {name} shape {tuple(t.shape)} != {tuple(out.shape[:dims])}"
                )
        fields.ref, fields.contrib, fields.mass = (
            ref.data_ptr(),
            contrib.data_ptr(),
            mass.data_ptr(),
        )
        fields.ref_row, fields.ref_head = ref.stride(0), ref.stride(1)
        fields.contrib_row, fields.contrib_head = contrib.stride(0), contrib.stride(1)
        fields.mass_row = mass.stride(0)
    return fields
