"""The ``flashloop`` backend: routes each batch's rows to the kernels its config needs.

With every feature off it is the dense path (DESIGN §4). Its registry entry (what it can
claim on a machine, the kernels it needs) is ``flashloop_spec``; its request lifecycle
(stores, admission, packing, release, saved state) is the ``flashloop_requests`` mixin,
its decode steps' host plans (graph keys, packed levels, the references it vouches for)
the ``flashloop_steps`` one, and what it refuses to graph, speculate or split over ranks
the ``flashloop_support`` one.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from flashloop_backend.backends.base import AttentionBackend
from flashloop_backend.backends.batch_plan import BatchPlan, PlanRouting
from flashloop_backend.backends.flashloop_requests import FlashLoopRequests
from flashloop_backend.backends.flashloop_steps import FlashLoopSteps
from flashloop_backend.backends.flashloop_support import FlashLoopSupport
from flashloop_backend.backends.packed_state import PackedState
from flashloop_backend.backends.sparse_state import ReferenceStates
from flashloop_backend.capabilities import Capability
from flashloop_backend.config import FlashLoopConfig
from flashloop_backend.dispatch import (
    BatchView,
    prefill_route_ops,
    routable_ops,
)
from flashloop_backend.kernels.op_inputs import (
    BASE_OUTPUT_OPS,
    CORRECTION_OPS,
    PACKED_READ_OPS,
    SOURCE_OPS,
    CorrectionInputs,
    PackedKV,
    PagedInputs,
    SourceInputs,
    into_base,
    over_packed,
)
from flashloop_backend.kernels.op_protocols import OpName, SourceOutputs
from flashloop_backend.registry.spec import SelectionInfo

if TYPE_CHECKING:
    from flashloop_backend.registry import KernelChoice


class FlashLoopBackend(FlashLoopSteps, FlashLoopRequests, FlashLoopSupport, AttentionBackend):
    """The callable backend. ``__call__`` is vllm-rlt's dense surface; ``forward`` takes a
    :class:`~flashloop_backend.dispatch.BatchView` and dispatches segments."""

    def __init__(
        self,
        config: FlashLoopConfig,
        kernels: dict[OpName, KernelChoice],
        capabilities: frozenset[Capability],
        info: SelectionInfo,
    ) -> None:
        self.config = config
        self.kernels = kernels
        self.capabilities = capabilities
        self.info = info
        self.states: ReferenceStates | None = None
        self.packed: PackedState | None = None
        self.dense_attention = kernels[OpName.DENSE_ATTENTION].impl.fn
        self._plan: BatchPlan | None = None
        self._routing: PlanRouting | None = None
        self._prefill_ops = prefill_route_ops(config)  # the config is immutable
        self._ready_view: BatchView | None = None  # whose references the host vouches for
        self._skips = False  # the planned batch skips its fallback read
        self._zero_base: torch.Tensor | None = None
        self._vouched_any = False  # some step skipped its fallback read
        self._statistics_stream: torch.cuda.Stream | None = None  # made at reserve

    # ------------------------------------------------------------ accounting
    def kv_bytes_held(self) -> int:
        return 0 if self.packed is None else self.packed.store.accounting()["steady_bytes"]

    def held(self) -> dict[str, int]:
        counts = {}
        if self.packed is not None:
            store = self.packed.store
            counts["packed_sequences"] = len(store.sequences)
            counts["packed_pages_used"] = store.accounting()["pages_used"]
            counts["packed_pages_reserved"] = store.accounting()["pages_reserved"]
        if self.states is not None:
            counts["reference_slots_live"] = self.states.live_slots()
        return counts

    def memory(self) -> dict[str, int]:
        pools = {}
        if self.packed is not None:
            store = self.packed.store
            pools["packed_pool"] = sum(t.numel() * t.element_size() for t in store.pools)
        if self.states is not None:
            pools["reference_states"] = self.states.nbytes()
        return pools

    def forward(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        view: BatchView,
        layer: int = 0,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Attention for every row of ``view`` at ``layer``: q [R, Hq, D] -> [R, Hq, D].

        Rows are gathered decode-first then active prefill, each segment runs the op its
        route names, and results are scattered back; inactive and padding rows get zeros.
        Sparse decode: loop-2 rows write their reference into the state store; loop 3-4
        rows with this token's reference run the correction, others run dense and are
        counted in ``states.missing_reference`` (in a step whose references the host
        vouched for, none runs dense: ``FlashLoopSteps._skips_fallback``). A source
        kernel that declares ``statistics_stream`` writes its statistics, and the
        references are stored, on the backend's statistics stream beside its dense output;
        the caller's stream waits for that stream before the call returns. The output may
        be one tensor for every layer of a batch: it is valid until the next call. No
        host synchronisation."""
        self._planned(view)
        forked: list[SourceOutputs] = []  # sources whose statistics went to a side stream
        try:
            return self._forward_runs(q, key_cache, value_cache, view, layer, scale, forked)
        finally:  # their tensors (and holds) live until the caller's stream has waited
            for result in forked:
                torch.cuda.current_stream().wait_stream(result.statistics.stream)

    def _forward_runs(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        view: BatchView,
        layer: int,
        scale: float | None,
        forked: list[SourceOutputs],
    ) -> torch.Tensor:
        """``forward``'s runs over the batch :meth:`_planned` planned; each source result
        whose statistics went to a side stream is appended to ``forked`` as it returns."""
        plan, routing = self._plan, self._routing
        gathered_q = plan.gather(q)
        out = self._zero_base_for(gathered_q) if self._skips else None
        for op, choice, n in self._runs(view, plan):
            mine, inputs = self._op_inputs(op, n, layer, gathered_q, key_cache, value_cache, scale)
            merges = out is not None and self._merges_into_base(op, choice, out[:n])
            if merges:  # the correction writes its rows into the base: no where launch
                inputs = into_base(inputs, out[:n], mine)
            result = choice.impl(inputs)
            if op in SOURCE_OPS:
                if result.statistics is not None:
                    forked.append(result)
                result = self._store_reference(routing, layer, n, mine, result)
            if out is None and n == view.num_rows and op in BASE_OUTPUT_OPS:
                # rows this op does not serve had length 0, which the op contract answers
                # with zeros: its output is the base
                out = result
                continue
            if merges:
                continue
            if out is None:
                out = torch.zeros_like(gathered_q)
            torch.where(mine[:, None, None], result, out[:n], out=out[:n])  # one launch
        return plan.restore(out if out is not None else torch.zeros_like(gathered_q))

    def _store_reference(self, routing: PlanRouting, layer: int, n: int, mine, result):
        """Writes a loop-2 source's selection and reference states for its rows into the
        state store (on the statistics stream where the source wrote its statistics
        there, after the caller's stream's work so far: the output and the rows' slots);
        returns the rows' attention output."""
        states = self.states
        rows = routing.source_rows(states, n, mine)
        fields = (result.indices, result.mass, result.output, result.contribution)
        if result.statistics is None:
            states.store(layer, rows, *fields)
            return result.out
        stream = result.statistics.stream
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            states.store(layer, rows, *fields)
        return result.out

    @staticmethod
    def _merges_into_base(op: OpName, choice: KernelChoice, base: torch.Tensor) -> bool:
        """Whether ``op`` writes the rows it serves into the batch's ``base`` output itself:
        a correction whose kernel declares ``correction_into_base``, over a contiguous base."""
        declared = choice.impl.support.capabilities
        into = Capability.CORRECTION_INTO_BASE in declared and base.is_contiguous()
        return op in CORRECTION_OPS and into

    def _planned(self, view: BatchView) -> tuple[BatchPlan, PlanRouting]:
        """The batch's plan and routing, made at its first layer and reused by the others."""
        if self.config.sparse_decode_attention.enabled and self.states is None:
            raise RuntimeError(
                "sparse decode needs reserve(EngineCapacity) (or reserve_state) before the first forward"
            )
        if self._plan is None or self._plan.view is not view:
            self._plan = BatchPlan.of(view, self.config)
            self._routing = PlanRouting(self._plan, self.states, self.config)
            self._skips = self._skips_fallback(view, self._plan)
            self._zero_base = None
            if self._skips and self._routing.missing is not None:
                self.states.vouched_missing += self._routing.missing
                self._vouched_any = True
        return self._plan, self._routing

    def _runs(self, view: BatchView, plan: BatchPlan) -> list[tuple[OpName, KernelChoice, int]]:
        """(op, kernel choice, rows it runs on) of every op this batch launches, the op over
        every row whose other rows read nothing first (its output is the others' base)."""
        prefill_ops = self._prefill_ops
        launched = routable_ops(
            self.config, view.decode_only, view.decode_depths, view.prefill_depths
        )
        bound = view.num_rows if view.decode_bound is None else view.decode_bound
        if plan.order is None and bound != 0:  # the view's own order: padding may sit anywhere
            bound = view.num_rows
        runs = [
            (op, choice, view.num_rows if op in prefill_ops else bound)
            for op, choice in self.kernels.items()
        ]
        runs = [(op, choice, n) for op, choice, n in runs if op in launched and n != 0]
        if self._skips:
            runs = [run for run in runs if run[0] in CORRECTION_OPS]
        runs.sort(key=lambda run: not (run[0] in BASE_OUTPUT_OPS and run[2] == view.num_rows))
        return runs

    def _op_inputs(self, op, n: int, layer: int, gathered_q, key_cache, value_cache, scale):
        """(rows ``op`` serves among the first ``n`` planned rows [n] bool, its typed
        inputs) at ``layer``, from the batch's plan: the gathered queries, tables and
        lengths, the loop-2 references, the packed reader's metadata."""
        plan, routing, states = self._plan, self._routing, self.states
        prefill_ops = self._prefill_ops
        # the correction reads the reference's positions, not lengths
        mine, masked = routing.rows(
            op, n, layer, reads_lengths=op not in CORRECTION_OPS, decode=op not in prefill_ops
        )
        # the plan's own tensors where every row runs: a kernel that plans on the host
        # (FlashInfer) recognises them at every layer and plans once
        every_row = n == plan.view.num_rows
        q_n = gathered_q if every_row else gathered_q[:n]
        tables_n = plan.tables if every_row else plan.tables[:n]
        if op in CORRECTION_OPS:
            indices, mass, ref_out, contribution = routing.references(states, op, n, layer)
            inputs = CorrectionInputs(
                q_n, key_cache, value_cache, tables_n, indices, mass, ref_out, contribution, scale
            )
        elif op in SOURCE_OPS:
            retention = self.config.sparse_decode_attention.key_retention
            inputs = SourceInputs(
                q_n, key_cache, value_cache, tables_n, masked, retention, states.k_bucket, scale
            )
        else:
            sequences = spans = None
            if every_row and op in prefill_ops:
                if self._declares(op, Capability.SPAN_PREFILL):
                    spans = routing.host_spans(op, key_cache.shape[1])
                elif self._host_planned(op):
                    sequences = routing.host_sequences(op, key_cache.shape[1])
            inputs = PagedInputs(
                q_n,
                key_cache,
                value_cache,
                tables_n,
                masked,
                scale,
                sequence_plan=sequences,
                span_plan=spans,
            )
        if op in PACKED_READ_OPS:
            if self.packed is None:
                raise RuntimeError(
                    "KV quantization needs reserve(EngineCapacity) (or reserve_packed) before the first forward"
                )
            meta = self.packed.meta_for(plan.view, plan.order)
            inputs = over_packed(PackedKV(self.packed.store, layer, meta.head(n)), inputs)
            if op in SOURCE_OPS and self._statistics_stream is not None:
                if self._declares(op, Capability.STATISTICS_STREAM):
                    inputs = replace(inputs, statistics_stream=self._statistics_stream)
            if op == OpName.PACKED_DECODE and self._fallback_only(plan.view):
                inputs = replace(inputs, few_rows=True)
        return mine, inputs

    def _host_planned(self, op: OpName) -> bool:
        """Whether ``op``'s kernel plans from the host's sequence plan of its rows."""
        return self._declares(op, Capability.HOST_SEQUENCE_PLAN)

    def _declares(self, op: OpName, capability: Capability) -> bool:
        """Whether ``op``'s kernel declares ``capability``."""
        return capability in self.kernels[op].impl.support.capabilities

    def prefill_chunks_by_positions(self) -> bool:
        """Whether a token-sparse chunk's cost follows the positions its rows span, not
        its rows (its kernel computes every position of the span)."""
        op = OpName.SPARSE_PREFILL
        return op in self.kernels and self._declares(op, Capability.SPAN_PREFILL)
