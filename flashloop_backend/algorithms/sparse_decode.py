"""The sparse decode attention reference (RFC §3.2, DESIGN §4): the loop-2 reference state
(top-K keys by probability, their mass, the full output and the selected keys'
contribution) and the later loops' correction. Shapes: H query heads, D head dim, T
visible keys (the current token included), K selected keys."""

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


def key_retention_fraction(key_retention: float) -> tuple[int, int]:
    """``key_retention`` as the nearest fraction (num, den) with den <= 10^6: the form every
    K computation uses, so Python, torch and Triton agree exactly (0.1 * 30 is 3, never
    3.0000000000000004, and 2/3 stays 2/3)."""
    if not 0 < key_retention <= 1:
        raise ValueError(f"key_retention={key_retention!r} must be in (0, 1]")
    fraction = Fraction(key_retention).limit_denominator(1_000_000)
    return max(1, fraction.numerator), fraction.denominator


def selected_count(key_retention: float, visible: int) -> int:
    """K = max(1, ceil(key_retention * T)) (DESIGN §4), never more than T, in integer
    arithmetic on :func:`key_retention_fraction`."""
    num, den = key_retention_fraction(key_retention)
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
    key_retention: float = 0.10,
    scale: float | None = None,
) -> SparseReferenceState:
    """Full attention of one query row (q [H, D] over k/v [T, Hkv, D]) plus the selection
    statistics: per head the K = max(1, ceil(key_retention * T)) keys of highest probability
    (ties go to the earlier position), their mass, and their weighted value contribution."""
    if q.dim() != 2 or k.dim() != 3 or k.shape != v.shape or k.shape[-1] != q.shape[-1]:
        raise ValueError(
            f"expected q [H, D], k/v [T, Hkv, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    keys, values = _per_query_head(q, k), _per_query_head(q, v)  # [T, H, D]
    probs = torch.softmax(torch.einsum("hd,thd->ht", q.float(), keys) * scale, dim=-1)  # [H, T]
    count = selected_count(key_retention, k.shape[0])
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
