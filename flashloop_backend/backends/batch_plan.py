"""What the flashloop backend derives from a batch view once per batch; every layer of the
traversal reuses it (only the loop-2 readiness changes from layer to layer)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashloop_backend.config import FlashLoopConfig
from flashloop_backend.dispatch import NOT_ROUTED, BatchView, base_routes, partition_rows


@dataclass(frozen=True)
class BatchPlan:
    """Rows in the decode-first gather order ``order`` [R]:

    tables [R, MB] int32, lengths [R] int32, slots / incarnations [R] int64 of each row;
    routes [R] int64 the layer-independent routes (:func:`base_routes`); correctable [R]
    bool (or None) the decode rows that correct when their reference is ready. ``kept``
    [R] bool and ``source`` [R] int64 (original order) scatter the results back.

    A decode-only view whose decode segment spans every row (``decode_bound`` None, as in
    a CUDA graph's bucket, or all rows) keeps its own order (``order``, ``kept`` and
    ``source`` None): its rows are decode rows or padding, padding routes to no op and
    reads no key, so no gather or scatter is needed and every decode op runs over all its
    rows."""

    view: BatchView
    order: torch.Tensor | None
    tables: torch.Tensor
    lengths: torch.Tensor
    slots: torch.Tensor
    incarnations: torch.Tensor
    routes: torch.Tensor
    correctable: torch.Tensor | None
    kept: torch.Tensor | None
    source: torch.Tensor | None

    @staticmethod
    def of(view: BatchView, config: FlashLoopConfig) -> BatchPlan:
        routes, correctable = base_routes(view, config)
        # the view's own order when nothing is left out of the decode segment: the packed
        # metadata the host plans covers the first decode_bound rows only
        if view.decode_only and view.decode_bound in (None, view.num_rows):
            return BatchPlan(
                view,
                None,
                view.row_block_tables(),
                view.context_lengths,
                view.slots,
                view.incarnations,
                routes,
                correctable,
                None,
                None,
            )
        partition = partition_rows(view.row_modes)
        order = partition.order
        return BatchPlan(
            view,
            order,
            view.row_block_tables()[order],
            view.context_lengths[order],
            view.slots[order],
            view.incarnations[order],
            routes[order],
            correctable[order] if correctable is not None else None,
            partition.inverse != NOT_ROUTED,
            partition.inverse.clamp(min=0),
        )

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """[R, ...] in the view's order -> the plan's order."""
        return rows if self.order is None else rows[self.order]

    def restore(self, gathered: torch.Tensor) -> torch.Tensor:
        """[R, ...] in gather order -> original row order; inactive and padding rows zero
        (rows no op wrote hold zeros already)."""
        if self.order is None:
            return gathered
        restored = gathered[self.source]
        return torch.where(self.kept[:, None, None], restored, torch.zeros_like(restored))
