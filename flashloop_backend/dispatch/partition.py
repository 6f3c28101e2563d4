"""Stable decode-first / active-prefill partition of a batch's rows (RFC §6.2).

Built with cumulative sums on the device: no sort, no host synchronisation. Output sizes
depend only on the row count, so the partition is safe inside a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashloop_backend.dispatch.batch import RowMode


@dataclass(frozen=True)
class RowPartition:
    """Gather order and its inverse.

    order:       [R] int64  kept rows first (decode/verify rows, then active prefill rows,
                 each in original order), then the left-out rows (inactive, padding)
    inverse:     [R] int64  inverse[row] = index of ``row`` in ``order`` if kept, else -1
    num_decode:  0-d int64  split offset: rows order[:num_decode] are decode/verify
    num_kept:    0-d int64  rows order[num_decode:num_kept] are active prefill
    """

    order: torch.Tensor
    inverse: torch.Tensor
    num_decode: torch.Tensor
    num_kept: torch.Tensor

    def segments(self) -> tuple[list[int], list[int]]:
        """Host copy of (decode rows, active prefill rows). Synchronises: tests/CPU only."""
        order = self.order.tolist()
        split, kept = int(self.num_decode), int(self.num_kept)
        return order[:split], order[split:kept]


def partition_rows(row_modes: torch.Tensor) -> RowPartition:
    """Partition rows by mode: ``[P0, D0, P1, P2, D1, P3]`` with P1, P3 active ->
    ``[D0, D1 | P1, P3]``."""
    if row_modes.dim() != 1:
        raise ValueError(f"row_modes must be 1-D [rows]; got shape {tuple(row_modes.shape)}")
    modes = row_modes.long()
    is_decode = (modes == RowMode.DECODE) | (modes == RowMode.VERIFY)
    is_prefill = modes == RowMode.PREFILL
    is_rest = ~(is_decode | is_prefill)
    decode_rank = torch.cumsum(is_decode.long(), 0)
    prefill_rank = torch.cumsum(is_prefill.long(), 0)
    rest_rank = torch.cumsum(is_rest.long(), 0)
    num_decode = decode_rank[-1] if modes.numel() else modes.new_zeros(())
    num_prefill = prefill_rank[-1] if modes.numel() else modes.new_zeros(())
    num_kept = num_decode + num_prefill
    destination = torch.where(
        is_decode,
        decode_rank - 1,
        torch.where(is_prefill, num_decode + prefill_rank - 1, num_kept + rest_rank - 1),
    )
    rows = torch.arange(modes.numel(), device=modes.device)
    order = torch.empty_like(rows).scatter_(0, destination, rows)
    inverse = torch.where(is_rest, torch.full_like(destination, -1), destination)
    return RowPartition(order, inverse, num_decode, num_kept)


def verify_spans(
    row_modes: torch.Tensor, request_ids: torch.Tensor, depths: torch.Tensor
) -> torch.Tensor:
    """[R] int32: at the first row of each verification group (consecutive VERIFY rows of
    one request and depth, which share that request's table at that depth) the group's
    row count, 0 at its other rows, 1 at every other row. Fixed-size device ops only (no
    host synchronisation), so it plans inside a CUDA graph too."""
    verify = row_modes == RowMode.VERIFY
    follows = torch.zeros_like(verify)
    same = (request_ids[1:] == request_ids[:-1]) & (depths[1:] == depths[:-1])
    follows[1:] = verify[1:] & verify[:-1] & same
    leads = ~follows
    group = torch.cumsum(leads.to(torch.int64), 0) - 1
    sizes = torch.zeros_like(group).scatter_add_(0, group, torch.ones_like(group))
    return torch.where(leads, sizes[group], 0).to(torch.int32)
