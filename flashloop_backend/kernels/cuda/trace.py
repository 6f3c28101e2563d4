"""Phase timestamps of a CUDA kernel built with ``TRACE`` (``common.cuh``'s ``TRACE_AT``):
thread 0 of each CTA writes (%globaltimer ns, clock64 cycles) at each of the kernel's
points into a buffer [CTAs, points, 2] int64 that follows the kernel's parameters. For
diagnostics (``scripts/trace_loop2.py``); served launches never carry one."""

from __future__ import annotations

import ctypes
import functools

import torch

# points per traced kernel, in the order the kernels mark them
POINTS = {
    "keys": ("entry", "set up", "first group", "groups", "tail", "end"),
    "values": ("entry", "set up", "first group", "groups", "tail", "partials", "finish"),
    "select": (
        *("entry", "lse", "read 1", "bin", "read 2"),
        *("digits", "counts", "read 3", "end"),
    ),
}


@functools.cache
def _traced_type(base: type) -> type:
    return type(f"Traced{base.__name__}", (base,), {"_fields_": [("trace", ctypes.c_void_p)]})


def traced(params: ctypes.Structure, trace: torch.Tensor, ctas: int, kernel: str):
    """``params`` with ``trace`` [>= ctas, len(POINTS[kernel]), 2] int64 (on the kernel's
    device) appended as the C struct's ``TRACE_FIELD``."""
    points = len(POINTS[kernel])
    if trace.dtype != torch.int64 or trace.dim() != 3 or trace.shape[1:] != (points, 2):
        raise ValueError(
            f"a {kernel} trace must be int64 [CTAs, {points}, 2]; got {trace.dtype} "
            f"{tuple(trace.shape)}"
        )
    if trace.shape[0] < ctas or not trace.is_contiguous():
        raise ValueError(f"a {kernel} trace needs {ctas} contiguous CTA rows; got {trace.shape[0]}")
    out = _traced_type(type(params))()
    ctypes.memmove(ctypes.addressof(out), ctypes.addressof(params), ctypes.sizeof(params))
    out.trace = trace.data_ptr()
    return out
