"""Token selection for sparse prefill (RFC §3.1, §6.1): the reference (scores, the budget
of a window, the selection of one window) and the device-side selection over fixed windows.

Windows are anchored to absolute prompt positions (window w covers [w*W, (w+1)*W), the last
may be shorter), so their identity never depends on the batch, chunking or prefix hits.
Selection is local to one request's window: sorts with stable keys, no host reads, and
the same decisions as :func:`select_tokens` applied window by window.
"""

from __future__ import annotations

import math

import torch


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


def window_budgets(eligible: torch.Tensor, ratio: float, window_size: int) -> torch.Tensor:
    """[num_windows] budget per window: min(|eligible in w|, max(1, ceil(ratio * len(w))))."""
    length = eligible.shape[0]
    windows = torch.arange(length, device=eligible.device) // window_size
    count = -(-length // window_size)
    prev = torch.zeros(count, dtype=torch.long, device=eligible.device).scatter_add_(
        0, windows, eligible.long()
    )
    # the last window may be short; computed on the device, as a Python scalar written
    # into a GPU tensor is a blocking copy
    starts = torch.arange(count, dtype=torch.long, device=eligible.device) * window_size
    sizes = (length - starts).clamp(max=window_size)
    wanted = torch.ceil(torch.round(sizes.double() * ratio, decimals=6)).long().clamp(min=1)
    return torch.minimum(prev, wanted)


def select_in_windows(
    scores: torch.Tensor, eligible: torch.Tensor, ratio: float, window_size: int
) -> torch.Tensor:
    """[T] bool next active set: per window, the budgeted top eligible scores (the earlier
    position wins ties)."""
    length = scores.shape[0]
    if ratio >= 1.0:
        return eligible.clone()
    positions = torch.arange(length, device=scores.device)
    windows = positions // window_size
    budgets = window_budgets(eligible, ratio, window_size)
    keyed = torch.where(eligible, scores.float(), float("-inf"))
    # order by (window, score descending, position): stable sorts, least significant first
    by_score = torch.sort(-keyed, stable=True).indices
    order = by_score[torch.sort(windows[by_score], stable=True).indices]
    starts = torch.searchsorted(
        windows[order], torch.arange(budgets.shape[0], device=scores.device)
    )
    rank = torch.arange(length, device=scores.device) - starts[windows[order]]
    chosen_sorted = (rank < budgets[windows[order]]) & eligible[order]
    chosen = torch.zeros_like(eligible)
    chosen[order] = chosen_sorted
    return chosen
