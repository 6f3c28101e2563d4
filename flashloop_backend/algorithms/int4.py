"""The INT4 base + residual KV reference (RFC §3.3, DESIGN §4): affine 16-level groups
with FP16 minimum and scale, residual chains against the reconstructed predecessor, and
compact chains for token-sparse depths."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class QuantizedInt4:
    """Affine INT4 groups along ``dim`` (DESIGN §4).

    codes:   uint8 [..., G, group_size // 2] two codes per byte, low nibble first, with
             ``dim`` moved last and cut into G groups (a trailing partial group is padded
             with code 0 past its own elements)
    minimum: FP16 [..., G] stored minimum;  scale: FP16 [..., G] stored (max - min) / 15
    shape:   the original shape;  dim: the grouped axis;  group_size: elements per group
    """

    codes: torch.Tensor
    minimum: torch.Tensor
    scale: torch.Tensor
    shape: tuple[int, ...]
    dim: int
    group_size: int


def _grouped(x: torch.Tensor, group_size: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x with ``dim`` last, cut into groups: values [..., G, group_size] (padding = NaN) and
    a validity mask of the same shape."""
    moved = x.movedim(dim, -1).float()
    length = moved.shape[-1]
    groups = -(-length // group_size)
    padded = torch.full((*moved.shape[:-1], groups * group_size), float("nan"), device=x.device)
    padded[..., :length] = moved
    values = padded.reshape(*moved.shape[:-1], groups, group_size)
    return values, ~torch.isnan(values)


def quantize_int4(x: torch.Tensor, group_size: int = 64, dim: int = -1) -> QuantizedInt4:
    """Affine INT4 with FP16 minimum and scale; codes round half to even from the stored
    (FP16-rounded) parameters; a constant group stores scale 0 and code 0."""
    if group_size < 2 or group_size % 2:
        raise ValueError(f"group_size={group_size} must be an even number >= 2")
    dim = dim % x.dim()
    values, valid = _grouped(x, group_size, dim)
    low = torch.where(valid, values, float("inf")).amin(-1)
    high = torch.where(valid, values, float("-inf")).amax(-1)
    minimum = low.to(torch.float16)
    # a tensor divisor: CUDA turns division by a Python scalar into a product with its
    # reciprocal, one bit off the division the Triton kernels round to
    scale = ((high - low) / torch.full_like(high, 15.0)).to(torch.float16)
    m32, s32 = minimum.float()[..., None], scale.float()[..., None]
    ratio = torch.where(s32 > 0, (values - m32) / torch.where(s32 > 0, s32, 1.0), 0.0)
    codes = torch.where(valid, torch.round(ratio).clamp(0, 15), 0.0).to(
        torch.uint8
    )  # round half to even
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return QuantizedInt4(packed, minimum, scale, tuple(x.shape), dim, group_size)


def unpack_codes(q: QuantizedInt4) -> torch.Tensor:
    """uint8 codes [..., G, group_size] from the packed bytes."""
    low, high = q.codes & 0x0F, q.codes >> 4
    return torch.stack((low, high), dim=-1).reshape(*q.codes.shape[:-1], q.group_size)


def dequantize_int4(q: QuantizedInt4) -> torch.Tensor:
    """FP32 tensor of the original shape: minimum + scale * code."""
    values = q.minimum.float()[..., None] + q.scale.float()[..., None] * unpack_codes(q).float()
    flat = values.reshape(*values.shape[:-2], -1)
    length = q.shape[q.dim]
    return flat[..., :length].movedim(-1, q.dim).contiguous()


def encode_residual_chain(
    versions: list[torch.Tensor], group_size: int = 64, dim: int = -1
) -> list[QuantizedInt4]:
    """[q(X1), q(X2 - X̂1), q(X3 - X̂2), ...] where X̂ is the running reconstruction: each
    residual is taken against the reconstructed predecessor, not its source value."""
    chain: list[QuantizedInt4] = []
    reconstruction: torch.Tensor | None = None
    for version in versions:
        target = version.float() if reconstruction is None else version.float() - reconstruction
        encoded = quantize_int4(target, group_size, dim)
        decoded = dequantize_int4(encoded)
        reconstruction = decoded if reconstruction is None else reconstruction + decoded
        chain.append(encoded)
    return chain


def reconstruct(chain: list[QuantizedInt4], depth: int) -> torch.Tensor:
    """X̂ at zero-based ``depth``: the base plus every residual up to it."""
    if not 0 <= depth < len(chain):
        raise ValueError(f"depth={depth} is outside the chain's [0, {len(chain)})")
    total = dequantize_int4(chain[0])
    for residual in chain[1 : depth + 1]:
        total = total + dequantize_int4(residual)
    return total


@dataclass(frozen=True)
class CompactChain:
    """Residual chain whose deeper levels exist only for active rows (token-sparse prefill).

    levels: [QuantizedInt4 | None] base over all rows, then residuals over ``rows[d]`` only
            (None where no row recomputed that level)
    rows:   [LongTensor] logical row indices present at each level (level 0: every row);
            a row absent from a level inherits the previous reconstruction (never code 0)
    """

    levels: list[QuantizedInt4 | None]
    rows: list[torch.Tensor]


def encode_compact_chain(
    versions: list[torch.Tensor], active: list[torch.Tensor], group_size: int = 64, dim: int = 0
) -> CompactChain:
    """Encode versions [T, ...] (rows on axis 0) where ``active[d]`` ([T] bool) marks the rows
    that recomputed level d. Residuals are grouped along ``dim`` over the compact rows."""
    rows = [torch.arange(versions[0].shape[0], device=versions[0].device)]
    levels = [quantize_int4(versions[0], group_size, dim)]
    reconstruction = dequantize_int4(levels[0])
    for version, mask in zip(versions[1:], active[1:], strict=True):
        present = mask.nonzero().flatten()
        if present.numel() == 0:
            rows.append(present)
            levels.append(None)
            continue
        residual = quantize_int4(
            version.float()[present] - reconstruction[present], group_size, dim
        )
        reconstruction = reconstruction.clone()
        reconstruction[present] += dequantize_int4(residual)
        rows.append(present)
        levels.append(residual)
    return CompactChain(levels, rows)


def reconstruct_compact(chain: CompactChain, depth: int) -> torch.Tensor:
    """Logical version at ``depth``: the base plus each present row's residuals up to it."""
    if not 0 <= depth < len(chain.levels):
        raise ValueError(f"depth={depth} is outside the chain's [0, {len(chain.levels)})")
    total = dequantize_int4(chain.levels[0])
    for level, present in zip(chain.levels[1 : depth + 1], chain.rows[1 : depth + 1], strict=True):
        if level is not None:
            total[present] += dequantize_int4(level)
    return total
