"""The host's plan of a ``flashloop`` decode step, a mixin of ``FlashLoopBackend``: which
ops the step launches (a CUDA graph key's part), which packed levels its rows read, and
whether the host vouches for the loop-2 reference of every row at loops 3-4.

A loop 3-4 row without its reference reads its loop's KV densely (the fallback read); a
steady decode step has none, but only the device's record says so. The host keeps its own
record of the sources its steps write (``ReferenceStates.host_written``), so a step whose
every row it can vouch for leaves the fallback read, and its split merge, out.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from flashloop_backend.backends.base import GraphStep
from flashloop_backend.backends.batch_plan import BatchPlan
from flashloop_backend.backends.sparse_state import key_bucket
from flashloop_backend.capabilities import Capability
from flashloop_backend.dispatch import (
    REFERENCE_DEPTH,
    SPARSE_START_DEPTH,
    BatchView,
    routable_ops,
    sparse_decode_ops,
)
from flashloop_backend.kernels.op_inputs import CORRECTION_OPS
from flashloop_backend.kernels.op_protocols import OpName


class FlashLoopSteps:
    """Decode-step planning of :class:`~flashloop_backend.backends.flashloop.FlashLoopBackend`."""

    def decode_ops(self, depths: frozenset[int], references_ready: bool = False) -> tuple[str, ...]:
        """The ops a decode-only step with rows at ``depths`` launches (a graph key part);
        the packed read marked ``:few_rows`` where it carries that launch hint (a graph
        captured with it must not serve a step that reads real rows), and left out where
        ``references_ready`` lets the step skip it (:meth:`_skips_fallback`)."""
        ops = sorted(op.value for op in routable_ops(self.config, True, depths))
        if references_ready and self._fallback_skippable(depths):
            return tuple(op for op in ops if OpName(op) in CORRECTION_OPS)
        if self._fallback_depths(depths):
            hinted = OpName.PACKED_DECODE.value
            ops = [f"{op}:few_rows" if op == hinted else op for op in ops]
        return tuple(ops)

    def reference_variants(self, depths: frozenset[int]) -> tuple[bool, ...]:
        """Both where a step at ``depths`` can skip its fallback read: a row the host
        cannot vouch for (a host that gives no tokens) needs the key with it."""
        return (False, True) if self._fallback_skippable(depths) else (False,)

    # ------------------------------------------------------------ steps and graphs
    def plan(
        self,
        view: BatchView,
        request_ids: list[int],
        depths: list[int],
        tokens: list[tuple[int, int]] | None = None,
    ) -> None:
        """Which decode rows read which packed levels (KV quantization; see
        ``PackedState``), and whether the host vouches for every loop 3-4 row's reference
        (:meth:`_skips_fallback`)."""
        if self.packed is not None:
            self.packed.plan(view, request_ids, depths)
        vouched = self._vouches(depths, tokens)
        self._record_sources(depths, tokens)
        self._ready_view = view if vouched else None

    def _vouches(self, depths: list[int], tokens: list[tuple[int, int]] | None) -> bool:
        """Whether the host's record holds the reference of every row of a step at a
        sparse loop (``depths`` and ``tokens``, each row's slot and incarnation, of the
        step's decode rows; False where it has no such row)."""
        rows = self._token_rows(depths, tokens)
        readers = [token for token, depth in rows if depth >= SPARSE_START_DEPTH]
        return bool(readers) and self.states.host_ready(readers)

    def _record_sources(self, depths: list[int], tokens: list[tuple[int, int]] | None) -> None:
        """Record the loop-2 sources a planned step writes (after :meth:`_vouches`: a step
        never writes the slot of a row that reads its reference)."""
        rows = self._token_rows(depths, tokens)
        if rows:
            self.states.host_sources(token for token, depth in rows if depth == REFERENCE_DEPTH)

    def _token_rows(self, depths: list[int], tokens: list[tuple[int, int]] | None) -> list:
        """[(token, depth)] of a step's decode rows; empty without sparse decode or tokens."""
        if self.states is None or tokens is None:
            return []
        if len(tokens) != len(depths):
            raise ValueError(f"{len(tokens)} row tokens for {len(depths)} decode rows")
        return list(zip(tokens, depths, strict=True))

    def reserve_graph_inputs(self, rows: int, max_context: int) -> None:
        states = self.states
        # graph rows read tables of ``max_context`` positions; the runner reserves its
        # inputs when it is built, before any step has written a reference
        if states is not None:
            span = self.reader_span(max_context)
            key_retention = self.config.sparse_decode_attention.key_retention
            if key_bucket(key_retention, span) > states.k_bucket:
                heads, head_dim = states.output.shape[-2:]
                device = states.indices.device
                self.reserve_state(
                    states.num_slots, states.num_layers, heads, head_dim, span, device
                )
        if self.packed is not None:
            self.packed.reserve_graph_inputs(rows, max_context, self.config.num_loops)

    def graph_variants(self, depths: frozenset[int]) -> tuple[int, ...]:
        if self.packed is None:
            return (1,)
        # the packed reader's levels: the deepest row whose sequence has packed pages, + 1
        # (1 when none has: a prompt shorter than one group packs nothing)
        return tuple(sorted({1, *(depth + 1 for depth in depths)}))

    def plan_graph_step(
        self,
        request_ids: list[int | None],
        depths: list[int],
        tokens: list[tuple[int, int]] | None = None,
    ) -> GraphStep:
        step = (
            GraphStep() if self.packed is None else self.packed.plan_graph_step(request_ids, depths)
        )
        # padding rows (no request) are no decode rows
        rows = [i for i, owner in enumerate(request_ids) if owner is not None]
        known = None if tokens is None else [tokens[i] for i in rows]
        row_depths = [depths[i] for i in rows]
        vouched = self._vouches(row_depths, known)
        self._record_sources(row_depths, known)
        present = frozenset(row_depths)
        return replace(step, references_ready=vouched and self._fallback_skippable(present))

    def bind_graph_step(self, view: BatchView, step: GraphStep) -> None:
        if self.packed is not None:
            self.packed.bind_graph_step(view, step)
        self._ready_view = view if step.references_ready else None

    def _skips_fallback(self, view: BatchView, plan: BatchPlan) -> bool:
        """Whether this batch leaves out the dense read for loop 3-4 rows without their
        reference: the host vouched for every row's reference (:meth:`plan` or the graph
        step), every row decodes at a sparse loop in the view's own order, and the
        correction writes its rows into a base (:meth:`_zero_base_for`). The device still
        routes by its own readiness: a row it finds without a reference is left as the
        base holds it (no stale state is read) and counted in ``states.vouched_missing``,
        which :meth:`release` checks."""
        return (
            self._ready_view is view
            and view.decode_only
            and plan.order is None
            and self._fallback_skippable(view.decode_depths)
        )

    def _zero_base_for(self, gathered_q: torch.Tensor) -> torch.Tensor:
        """The zeros every layer of a batch that skips its fallback read writes its
        corrections into, made at the batch's first layer (one memset a step, not one a
        layer): rows the correction does not serve (padding) are never written, and each
        layer's output is read before the next layer's correction writes its rows again
        (``forward``'s output is valid until the next ``forward``)."""
        if self._zero_base is None:
            self._zero_base = torch.zeros_like(gathered_q, memory_format=torch.contiguous_format)
        return self._zero_base

    def _fallback_only(self, view: BatchView) -> bool:
        """Whether the batch's packed read serves only rows a loop 3-4 correction could not
        (every row decodes at a sparse loop: none in a steady run), the launch hint
        ``few_rows``."""
        return view.decode_only and self._fallback_depths(view.decode_depths)

    def _fallback_skippable(self, depths: frozenset[int] | None) -> bool:
        """Whether decode rows at ``depths`` all run at a sparse loop and the correction's
        kernel writes into a base (so a step whose references the host vouches for can
        leave the fallback read out)."""
        if not self._fallback_depths(depths):
            return False
        correction = sparse_decode_ops(self.config)[1]
        return self._declares(correction, Capability.CORRECTION_INTO_BASE)

    def _fallback_depths(self, depths: frozenset[int] | None) -> bool:
        """Whether decode rows at ``depths`` (None: unknown) all run at a sparse loop."""
        return (
            self.config.sparse_decode_attention.enabled
            and bool(depths)
            and min(depths) >= SPARSE_START_DEPTH
        )
