"""Pure-torch FlashLoop algorithm references (CPU and GPU), written for clarity.

These are the oracles for the kernels and the API external checks call. Shapes: H query
heads, D head dim, T visible keys (the current token included), K selected keys.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch


@dataclass(frozen=True)
class SparseReferenceState:
    """Loop-2 reference of one query row (RFC §3.2).

    indices:      [H, K] int64   absolute key positions S, by descending probability
    mass:         [H]    FP32    m = sum of reference probabilities over S
    output:       [H, D] FP32    O_ref, the full reference attention output
    contribution: [H, D] FP32    C_ref = sum over S of p_j v_j (unnormalised)
    """

    indices: torch.Tensor
    mass: torch.Tensor
    output: torch.Tensor
    contribution: torch.Tensor


def ratio_fraction(ratio: float) -> tuple[int, int]:
    """The retention ratio as the nearest fraction num/den with den <= 10^6: the form every
    K computation uses, so Python, torch and Triton agree exactly (0.1 * 30 is 3, never
    3.0000000000000004, and 2/3 stays 2/3)."""
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio={ratio!r} must be in (0, 1]")
    fraction = Fraction(ratio).limit_denominator(1_000_000)
    return max(1, fraction.numerator), fraction.denominator


def selected_count(ratio: float, visible: int) -> int:
    """K = max(1, ceil(ratio * T)) (DESIGN §4), never more than T, in integer arithmetic on
    :func:`ratio_fraction`."""
    num, den = ratio_fraction(ratio)
    return min(visible, max(1, -(-visible * num // den)))


def _per_query_head(q: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Expand K/V [T, Hkv, D] to the query's H heads (GQA), as FP32."""
    heads, kv_heads = q.shape[0], x.shape[1]
    if kv_heads <= 0 or heads % kv_heads:
        raise ValueError(
            f"query heads ({heads}) must be a positive multiple of KV heads ({kv_heads})"
        )
    return x.float().repeat_interleave(heads // kv_heads, dim=1)


def sparse_reference_state(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    ratio: float = 0.10,
    scale: float | None = None,
) -> SparseReferenceState:
    """Full attention of one query row (q [H, D] over k/v [T, Hkv, D]) plus the selection
    statistics: per head the K = max(1, ceil(ratio * T)) keys of highest probability (ties
    go to the earlier position), their mass, and their weighted value contribution."""
    if q.dim() != 2 or k.dim() != 3 or k.shape != v.shape or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"expected q [H, D], k/v [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    keys, values = _per_query_head(q, k), _per_query_head(q, v)  # [T, H, D]
    probs = torch.softmax(torch.einsum("hd,thd->ht", q.float(), keys) * scale, dim=-1)  # [H, T]
    count = selected_count(ratio, k.shape[0])
    order = torch.sort(-probs, dim=-1, stable=True).indices  # stable: earlier position wins ties
    indices = order[:, :count]
    chosen = torch.gather(probs, 1, indices)  # [H, K]
    chosen_values = values.permute(1, 0, 2)[torch.arange(q.shape[0])[:, None], indices]  # [H, K, D]
    return SparseReferenceState(
        indices=indices,
        mass=chosen.sum(-1),
        output=torch.einsum("ht,thd->hd", probs, values),
        contribution=torch.einsum("hk,hkd->hd", chosen, chosen_values),
    )


def sparse_correct(
    state: SparseReferenceState,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Later-loop output O = O_ref - C_ref + m * softmax(q k_S^T * scale) v_S, reading this
    loop's k/v [T, Hkv, D] at the state's indices. Returns [H, D] FP32."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    heads = torch.arange(q.shape[0])[:, None]
    keys = _per_query_head(q, k).permute(1, 0, 2)[heads, state.indices]  # [H, K, D]
    values = _per_query_head(q, v).permute(1, 0, 2)[heads, state.indices]
    local = torch.softmax(torch.einsum("hd,hkd->hk", q.float(), keys) * scale, dim=-1)
    fresh = torch.einsum("hk,hkd->hd", local, values)
    return state.output - state.contribution + state.mass[:, None] * fresh


# ---------------------------------------------------------------- token-sparse prefill (§3.1)
def token_change_scores(
    h_prev: torch.Tensor, h_prev2: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """[T] FP32 ||h_prev - h_prev2|| / max(||h_prev||, eps): h_prev is the state after loop
    r-1 and h_prev2 after loop r-2, both [T, hidden]."""
    if h_prev.shape != h_prev2.shape:
        raise ValueError(f"h_prev {tuple(h_prev.shape)} and h_prev2 {tuple(h_prev2.shape)} differ")
    a, b = h_prev.float(), h_prev2.float()
    return (a - b).norm(dim=-1) / a.norm(dim=-1).clamp_min(eps)


def retention_budget(ratio: float, window_length: int, prev_active: int) -> int:
    """min(|active[r-1]|, max(1, ceil(ratio * N))) for a window of N prompt tokens (DESIGN §4);
    the ratio refers to the window length, not to the previous active count."""
    if not 0 < ratio <= 1:
        raise ValueError(f"ratio={ratio!r} must be in (0, 1]")
    return min(prev_active, max(1, math.ceil(round(ratio * window_length, 6))))


def select_tokens(scores: torch.Tensor, eligible: torch.Tensor, budget: int) -> torch.Tensor:
    """[T] bool: the ``budget`` highest-scoring eligible positions; equal scores go to the
    earlier position; nothing is reserved for the last token."""
    order = sorted(
        (i for i in range(scores.shape[0]) if bool(eligible[i])),
        key=lambda i: (-float(scores[i]), i),
    )
    chosen = torch.zeros(scores.shape[0], dtype=torch.bool)
    chosen[order[:budget]] = True
    return chosen.to(scores.device)


# ---------------------------------------------------------------- INT4 residual KV (§3.3)
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
    scale = ((high - low) / 15).to(torch.float16)
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
