"""What the dense backend derives from a batch view once, for every layer of its
traversal: each row's table, the lengths each kernel sees, and the host's sequence plans
of a kernel that plans on the host."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from flashloop_backend.dispatch import BatchView, RowMode, verify_spans
from flashloop_backend.kernels.sequence_plan import SequencePlan


def masked_lengths(
    modes: torch.Tensor,
    lengths: torch.Tensor,
    decode_only: bool,
    one_kernel: bool,
    decode_bound: int | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(prefill kernel's lengths, decode kernel's lengths, decode rows [R] bool) of rows
    with modes and lengths [R] on any device, as :class:`DensePlan` describes them."""
    if decode_only:  # DECODE, VERIFY or PAD rows: padding already has length 0
        return (lengths, None, None) if one_kernel else (None, lengths, None)
    modes = modes.long()
    decode = (modes == RowMode.DECODE) | (modes == RowMode.VERIFY)
    prefill = modes == RowMode.PREFILL
    zeros = torch.zeros_like(lengths)
    if one_kernel:
        return torch.where(decode | prefill, lengths, zeros), None, None
    decode_lengths = None
    if decode_bound != 0:
        decode_lengths = torch.where(decode, lengths, zeros)
    return torch.where(prefill, lengths, zeros), decode_lengths, decode


@dataclass(frozen=True)
class DensePlan:
    """What the dense backend derives from a view once: tables [R, MB] int32 of each row's
    own depth plane; the lengths [R] int32 each kernel sees (rows it does not serve at 0),
    None for a kernel not launched; decode_rows [R] bool picks the decode kernel's rows
    where both run. With one kernel for every row, its lengths are ``prefill_lengths``.
    row_spans [R] int32 (:func:`verify_spans`): the verification groups the decode kernel
    computes together, when it declares ``grouped_verify_rows`` and the view may hold a
    group of several rows (else None). prefill_sequences / decode_sequences: the host's
    :class:`SequencePlan` of a launched kernel's rows, for a kernel declaring
    ``host_sequence_plan`` when the view carries its host rows (else None)."""

    view: BatchView
    tables: torch.Tensor
    prefill_lengths: torch.Tensor | None
    decode_lengths: torch.Tensor | None
    decode_rows: torch.Tensor | None
    row_spans: torch.Tensor | None = None
    prefill_sequences: SequencePlan | None = None
    decode_sequences: SequencePlan | None = None

    @staticmethod
    def of(
        view: BatchView,
        one_kernel: bool,
        grouped: bool = False,
        host_planned: tuple[bool, bool] = (False, False),
        block_size: int = 0,
    ) -> DensePlan:
        """``host_planned``: whether the (prefill, decode) kernels take the host's
        sequence plans, of pages of ``block_size`` keys."""
        lengths = masked_lengths(
            view.row_modes, view.context_lengths, view.decode_only, one_kernel, view.decode_bound
        )
        plan = DensePlan(view, view.row_block_tables(), *lengths)
        if grouped and view.verify_rows > 1 and plan.decode_lengths is not None:
            spans = verify_spans(view.row_modes, view.request_ids, view.depths)
            plan = replace(plan, row_spans=spans)
        host = view.host_rows
        if host is None or not any(host_planned):
            return plan
        host_lengths = masked_lengths(
            host.row_modes, host.context_lengths, view.decode_only, one_kernel, view.decode_bound
        )
        sequences = [
            host.sequences(lengths, block_size, view.device)
            if lengths is not None and planned
            else None
            for lengths, planned in zip(host_lengths[:2], host_planned, strict=True)
        ]
        return replace(plan, prefill_sequences=sequences[0], decode_sequences=sequences[1])
