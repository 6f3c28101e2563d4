"""Arrival counters of the CUDA kernels whose last CTA of each (row, query head) finishes
what its splits wrote (``last_split`` in ``common.cuh``): one zeroed int32 buffer per device
that every launch reuses, since that last CTA puts its counter back to 0. Also the finish
record of the split readers (``SplitFinish``): the merge of ``merge_splits`` in that last
CTA, in place of a launch after the kernel."""

from __future__ import annotations

import ctypes

import torch

_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, count: int) -> torch.Tensor:
    """At least ``count`` int32 counters on ``device``, 0 between launches. The buffer grows
    only outside graph capture (a warm-up runs every shape eagerly first)."""
    held = _COUNTERS.get(device)
    if held is None or held.numel() < count:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"arrival counters: {count} needed during graph capture, "
                f"{0 if held is None else held.numel()} allocated; run the shape eagerly first"
            )
        held = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _COUNTERS[device] = held
    return held


class SplitFinish(ctypes.Structure):
    # the C layout of SplitFinish in common.cuh (counters nullptr: no finish)
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


NO_FINISH = SplitFinish()
FINISH_SPLITS = 256  # the most splits a finish merges (FINISH_SPLITS in common.cuh)


def split_finish(
    out: torch.Tensor,
    splits: int,
    correction: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> SplitFinish:
    """The finish record that merges ``splits`` partials into ``out`` [R, Hq, D] bf16 as
    ``merge_splits(..., out, correction=correction)`` does; ``correction`` = (output,
    contribution [R, Hq, D], mass [R, Hq]), FP32 with a unit last stride."""
    if out.dtype != torch.bfloat16 or out.stride(-1) != 1:
        raise ValueError(f"a split finish writes bf16 rows of unit stride; got {out.dtype}")
    rows, heads, _ = out.shape
    counters = arrival_counters(out.device, rows * heads)
    ref = contrib = mass = None
    if correction is not None:
        ref, contrib, mass = correction
        for name, t in (("output", ref), ("contribution", contrib), ("mass", mass)):
            if t.dtype != torch.float32 or t.stride(-1) != 1:
                raise ValueError(f"a split finish needs FP32 {name} of unit last stride")
    return SplitFinish(
        counters.data_ptr(),
        out.data_ptr(),
        *(None if t is None else t.data_ptr() for t in (ref, contrib, mass)),
        out.stride(0),
        out.stride(1),
        *((ref.stride(0), ref.stride(1)) if ref is not None else (0, 0)),
        *((contrib.stride(0), contrib.stride(1)) if contrib is not None else (0, 0)),
        mass.stride(0) if mass is not None else 0,
        splits,
    )
