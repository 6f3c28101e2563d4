"""Wrapper for the Triton INT4 quantize-and-pack kernel: the same format as
``algorithms.quantize_int4`` (its oracle), bit for bit."""

from __future__ import annotations

import torch

from flashloop_backend.algorithms import QuantizedInt4


def quantize_int4_triton(x: torch.Tensor, group_size: int = 64, dim: int = -1) -> QuantizedInt4:
    """x [..., L along ``dim``, ...] -> QuantizedInt4 with codes [..., G, group_size // 2]."""
    from flashloop_backend.kernels.triton.quantize_jit import quantize_int4_kernel

    if group_size < 16 or group_size & (group_size - 1):
        raise ValueError(
            f"group_size={group_size} must be a power of two >= 16 for the triton kernel"
        )
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"x dtype {x.dtype} is not one of float32, float16, bfloat16")
    dim = dim % x.dim()
    moved = x.movedim(dim, -1)
    lead, length = moved.shape[:-1], moved.shape[-1]
    # a copy only when the grouped axis is not innermost-compatible
    rows = moved.reshape(-1, length)
    groups = -(-length // group_size)
    codes = torch.empty(
        (rows.shape[0], groups, group_size // 2), dtype=torch.uint8, device=x.device
    )
    minimum = torch.empty((rows.shape[0], groups), dtype=torch.float16, device=x.device)
    scale = torch.empty_like(minimum)
    if rows.numel():
        quantize_int4_kernel[(rows.shape[0], groups)](
            rows,
            codes,
            minimum,
            scale,
            length,
            rows.stride(0),
            rows.stride(1),
            codes.stride(0),
            codes.stride(1),
            minimum.stride(0),
            GROUP=group_size,
        )
    return QuantizedInt4(
        codes.reshape(*lead, groups, group_size // 2),
        minimum.reshape(*lead, groups),
        scale.reshape(*lead, groups),
        tuple(x.shape),
        dim,
        group_size,
    )
