"""Device-side token selection for sparse prefill over fixed windows (RFC §3.1, §6.1).

Windows are anchored to absolute prompt positions (window w covers [w*W, (w+1)*W), the last
may be shorter), so their identity never depends on the batch, chunking or prefix hits.
Selection is local to one request's window: sorts with stable keys, no host reads, and
the same decisions as ``reference.select_tokens`` applied window by window.
"""

from __future__ import annotations

import torch


def window_budgets(eligible: torch.Tensor, ratio: float, window_size: int) -> torch.Tensor:
    """[num_windows] budget per window: min(|eligible in w|, max(1, ceil(ratio * len(w))))."""
    length = eligible.shape[0]
    windows = torch.arange(length, device=eligible.device) // window_size
    count = -(-length // window_size)
    prev = torch.zeros(count, dtype=torch.long, device=eligible.device).scatter_add_(
        0, windows, eligible.long()
    )
    sizes = torch.full((count,), window_size, dtype=torch.long, device=eligible.device)
    sizes[-1] = length - (count - 1) * window_size
    wanted = torch.ceil(torch.round(sizes.double() * ratio, decimals=6)).long().clamp(min=1)
    return torch.minimum(prev, wanted)


def select_in_windows(
    scores: torch.Tensor, eligible: torch.Tensor, ratio: float, window_size: int
) -> torch.Tensor:
    """[T] bool next active set: per window, the budgeted top eligible scores (earlier wins ties)."""
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
