"""Arrival counters of the CUDA kernels whose last CTA of each (row, query head) finishes
what its splits wrote (``last_split`` in ``common.cuh``): one zeroed int32 buffer per device
and stream role that every launch reuses, since that last CTA puts its counter back to 0.
Kernels that may run at once on different streams take different roles."""

from __future__ import annotations

import torch

_COUNTERS: dict[tuple[torch.device, str], torch.Tensor] = {}


def arrival_counters(device: torch.device, count: int, role: str = "main") -> torch.Tensor:
    """At least ``count`` int32 counters on ``device`` for launches of ``role`` (one
    stream's kernels: ``main``, or ``statistics`` for the loop-2 side stream), 0 between
    launches. The buffer grows only outside graph capture (a warm-up runs every shape
    eagerly first)."""
    held = _COUNTERS.get((device, role))
    if held is None or held.numel() < count:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"arrival counters: {count} needed during graph capture, "
                f"{0 if held is None else held.numel()} allocated; run the shape eagerly first"
            )
        held = torch.zeros(max(count, 4096), dtype=torch.int32, device=device)
        _COUNTERS[(device, role)] = held
    return held
