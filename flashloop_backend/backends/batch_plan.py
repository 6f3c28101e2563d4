"""What the flashloop backend derives from a batch view once per batch; every layer of the
traversal reuses it: the gather order and rows (:class:`BatchPlan`) and, per layer, which
rows each op serves (:class:`PlanRouting`, loop-2 readiness included)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashloop_backend.backends.sparse_state import ReferenceStates
from flashloop_backend.config import FlashLoopConfig
from flashloop_backend.dispatch import (
    NOT_ROUTED,
    ROUTE_CODES,
    BatchView,
    base_routes,
    base_routes_of,
    partition_rows,
    routable_ops,
    sparse_decode_ops,
    with_references,
)
from flashloop_backend.kernels.sequence_plan import SequencePlan
from flashloop_backend.kernels.span_plan import SpanPlan


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
    rows. So does a view without decode rows (``decode_bound`` 0, a prefill step): its
    prefill ops run over every row."""

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
        # the view's own order when nothing is left out of the decode segment (the packed
        # metadata the host plans covers the first decode_bound rows only), or when the
        # host says no row decodes: every op then runs over all rows, and rows no op
        # serves read length 0, so their output is zeros without a gather or a scatter
        whole_decode = view.decode_only and view.decode_bound in (None, view.num_rows)
        if whole_decode or view.decode_bound == 0:
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


# The most bytes of selected-key indices a batch reads for every layer at once.
REFERENCE_READ_BYTES = 64 << 20


def _fits(states: ReferenceStates, n: int) -> bool:
    """Whether ``n`` rows' indices at every layer fit in ``REFERENCE_READ_BYTES``."""
    per_layer = n * states.indices.shape[2] * states.k_bucket * states.indices.element_size()
    return states.num_layers * per_layer <= REFERENCE_READ_BYTES


def _may_correct(view: BatchView, config: FlashLoopConfig) -> bool:
    """Whether a row of ``view`` can correct: the correction is among the ops its rows
    can route to (by the depths the host names; unknown depths may)."""
    launched = routable_ops(config, view.decode_only, view.decode_depths, view.prefill_depths)
    return sparse_decode_ops(config)[1] in launched


class PlanRouting:
    """Which rows each op serves, for every layer of a planned batch, computed once.

    Under sparse decode a loop 3-4 row corrects at a layer when its slot holds its own
    loop-2 reference for that layer. A step never writes the slot of a row that reads its
    reference (a row runs one depth per step, a token owns its slot), so the readiness of
    every layer is known when the batch is planned: one gather gives routes [L, R], and a
    layer's rows are row ``layer`` of each op's masks, with no launch per layer. A batch
    none of whose rows can route to the correction (``routable_ops``: decode depths all
    below loop 3, or prompt rows only) skips the gather; its routes stay [R]. The rows
    that would correct but find no reference are counted in ``missing_reference`` once, for
    every layer of the state; so are the source's writes (:meth:`source_rows`)."""

    def __init__(
        self, plan: BatchPlan, states: ReferenceStates | None, config: FlashLoopConfig
    ) -> None:
        self.plan, self.config = plan, config
        self.lengths, self.incarnations = plan.lengths, plan.incarnations
        self.target = states.target(plan.slots) if states is not None else None
        self.base_routes = plan.routes  # [R]
        self.routes = plan.routes  # [R], or [L, R] when routes follow references
        self.missing: torch.Tensor | None = None  # () int64: this batch's count
        if states is not None and plan.correctable is not None and _may_correct(plan.view, config):
            ready = states.ready_layers(self.target, plan.incarnations)  # [R, L]
            correctable = plan.correctable[:, None]
            routes = with_references(plan.routes[:, None], correctable, config, ready)
            self.routes = routes.T.contiguous()
            self.missing = (correctable & ~ready).sum()
            states.missing_reference += self.missing
        # op -> (rows it serves [n] or [L, n] bool, their masked lengths or None)
        self._masks: dict = {}
        self._writes: dict = {}
        self._references: dict = {}
        self._host_sequences: dict = {}
        self._host_spans: dict = {}

    def rows(
        self, op, n: int, layer: int, reads_lengths: bool, decode: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(rows ``op`` serves [n] bool, and if it ``reads_lengths`` their lengths with
        other rows masked to 0 [n] int32, else None) at ``layer``, among the first ``n``
        planned rows. Only a ``decode`` op's rows can change with the layer; the others
        get the same tensors at every layer (a kernel that plans on the host recognises
        them)."""
        mine, masked = self._all_layers(op, n, reads_lengths, decode)
        if mine.dim() == 1:
            return mine, masked
        return mine[layer], None if masked is None else masked[layer]

    def _all_layers(self, op, n: int, reads_lengths: bool, decode: bool):
        """:meth:`rows` for every layer at once ([L, n] where routes follow references)."""
        if (op, n) not in self._masks:
            routes = self.routes if decode else self.base_routes
            mine = routes[..., :n] == ROUTE_CODES[op]
            masked = None
            if reads_lengths:
                lengths = self.lengths[:n]
                masked = torch.where(mine, lengths, torch.zeros_like(lengths))
            self._masks[(op, n)] = (mine, masked)
        return self._masks[(op, n)]

    def host_sequences(self, op, block_size: int) -> SequencePlan | None:
        """The host's :class:`SequencePlan` of the rows a prefill ``op`` serves, with pages
        of ``block_size`` keys: a prompt row's route depends only on its mode and depth, so
        the host's copy of the rows gives it without reading the device. None where the
        view carries no host rows or the plan gathers its rows (a mixed batch, whose
        order the device holds)."""
        view = self.plan.view
        if view.host_rows is None or self.plan.order is not None:
            return None
        if op not in self._host_sequences:
            lengths = self._host_lengths(op)
            self._host_sequences[op] = view.host_rows.sequences(lengths, block_size, view.device)
        return self._host_sequences[op]

    def host_spans(self, op, block_size: int) -> SpanPlan | None:
        """The host's :class:`SpanPlan` of the rows a prefill ``op`` serves, as
        :meth:`host_sequences`."""
        view = self.plan.view
        if view.host_rows is None or self.plan.order is not None:
            return None
        if op not in self._host_spans:
            self._host_spans[op] = view.host_rows.spans(
                self._host_lengths(op), block_size, view.device
            )
        return self._host_spans[op]

    def _host_lengths(self, op) -> torch.Tensor:
        """[R] int32 on the host: the context lengths of the rows a prefill ``op`` serves,
        0 for the others (a prompt row's route depends only on its mode and depth)."""
        host = self.plan.view.host_rows
        routes, _ = base_routes_of(host.row_modes, host.depths, self.config)
        return torch.where(routes == ROUTE_CODES[op], host.context_lengths, 0).int()

    def references(
        self, states: ReferenceStates, op, n: int, layer: int
    ) -> tuple[torch.Tensor, ...]:
        """(indices [n, H, K], mass [n, H], output and contribution [n, H, D]) of the
        first ``n`` rows' reference at ``layer`` for the correction ``op``. A row that
        ``op`` does not serve at a layer selects no key there (its slot may hold another
        token's state). Every layer's is read once per batch
        (:meth:`ReferenceStates.read_layers`: a launch per field, not per field and layer)
        while the batch's indices at every layer fit in ``REFERENCE_READ_BYTES``; larger
        batches read each layer's indices when it runs, so the indices held stay one
        layer's."""
        if (op, n) not in self._references:
            mine, _ = self._all_layers(op, n, reads_lengths=False, decode=True)
            if mine.dim() == 1:
                mine = mine.expand(states.num_layers, n)
            indices, mass, output, contribution = states.read_layers(
                self.target[:n], indices=_fits(states, n)
            )
            if indices is not None:
                indices = torch.where(mine[:, :, None, None], indices, -1)
            self._references[(op, n)] = (mine, indices, mass, output, contribution)
        mine, indices, mass, output, contribution = self._references[(op, n)]
        if indices is None:
            indices = torch.where(
                mine[layer][:, None, None], states.indices[layer, self.target[:n]], -1
            )
        else:
            indices = indices[layer]
        return indices, mass[layer], output[layer], contribution[layer]

    def source_rows(
        self, states: ReferenceStates, n: int, mine: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What the loop-2 source writes for the first ``n`` rows (``mine`` [n]: the rows it
        serves, the same at every layer: a source row never corrects), planned once per
        batch: :meth:`ReferenceStates.write_rows`, and the batch's writes counted in
        ``sources_written`` for every layer of the state."""
        if n not in self._writes:
            self._writes[n] = states.write_rows(self.target[:n], self.incarnations[:n], mine)
            states.sources_written += mine.sum() * states.num_layers
        return self._writes[n]
