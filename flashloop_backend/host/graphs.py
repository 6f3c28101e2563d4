"""CUDA-graph capture and replay of the host's decode traversal (RFC §6.7).

A step whose rows are all generated tokens (decode rows, and speculative verification rows,
several per request) runs from a graph captured for its bucket, the smallest configured
batch size that holds the rows. Every input the traversal reads lives
at a fixed address, allocated once for the largest bucket: the hidden states, the batch
view (positions, depths, modes, slots, incarnations, lengths; block tables at a fixed
width) and the KV write slots; the backend plans its own inputs (with KV quantization, the
packed reader's metadata) into fixed buffers it allocates (``reserve_graph_inputs``,
``plan_graph_step``). A step copies its rows into the leading part of those buffers (one
asynchronous copy of the engine's, ``graph_inputs.py``);
padding rows are PAD with length zero and slot -1 (their KV write lands in the cache's
scratch block and the backend returns zeros for them). The loop-2 reference states and the
packed store are the backend's own fixed device tensors.

Graph key: (bucket, variant, ops), where variant is the backend's kernel variant for the
step (the packed reader's ``LEVELS``: the deepest packed row's depth + 1; 1 without KV
quantization) and ops
the backend's ``decode_ops(depths, references_ready)`` for the loop depths of the step's
rows (a loop-1 step never launches the loop-2 source or the correction; a loop 3-4 step
whose references the backend vouches for launches no fallback read). The first step of
a key runs eagerly on the fixed buffers (compiling kernels), which is that step's result,
then captures; later steps replay. A step the graphs cannot take (more rows than the
largest bucket, a history wider than the capacity) runs eagerly with the same backend and
kernels, never a dense substitute; its reason is logged once and counted in ``fallbacks``.

``capture=False`` runs every step eagerly on the same buffers and shapes: bit-equal to a
replay on the GPU (the tests' reference), and the planning path on a CPU.
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator

from flashloop_backend.backends.base import AttentionBackend, GraphStep
from flashloop_backend.config import ConfigError
from flashloop_backend.dispatch import BatchView, RowMode
from flashloop_backend.host.batch import Batch, RowGroup, row_tokens
from flashloop_backend.host.graph_inputs import GraphInputs
from flashloop_backend.host.kvcache import PagedKVCache

LOG = logging.getLogger(__name__)
# verification rows are decode queries to every backend (each its own causal length)
GRAPH_MODES = (RowMode.DECODE, RowMode.VERIFY)
VIEW_FIELDS = (
    "positions",
    "depths",
    "row_modes",
    "slots",
    "incarnations",
    "request_ids",
    "window_ids",
    "context_lengths",
)


class GraphSettings(BaseModel):
    """CUDA graphs for decode steps: the batch-size buckets, the longest context a graph row
    may attend (block tables and packed metadata are sized for it; None: the model's
    ``max_position_embeddings``), whether to capture (False: eager on the same buffers),
    and whether a step with prompt chunks replays its decode rows from a graph and runs the
    chunks in a second, eager traversal (``split_mixed_steps``, the default: faster for
    every variant ``bench capacity`` timed; False: one eager traversal of every row, the
    weights read once)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    max_context: int | None = Field(default=None, ge=1)
    capture: bool = True
    split_mixed_steps: bool = True

    @field_validator("buckets")
    @classmethod
    def _increasing(cls, buckets: tuple[int, ...]) -> tuple[int, ...]:
        if not buckets or buckets[0] < 1 or any(b >= c for b, c in itertools.pairwise(buckets)):
            raise ValueError(f"buckets {buckets} must be positive and strictly increasing")
        return buckets


Traverse = Callable[[torch.Tensor, Batch], torch.Tensor]


class CudaCapture:
    """How graphs are made: CUDA graphs sharing one memory pool. Tests substitute a
    recorder with the same methods to run the capture/replay discipline on a CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.pool = device, torch.cuda.graph_pool_handle()

    def reserved(self) -> int:
        """Reserved bytes after the flush a capture does on entry."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.memory_reserved(self.device)

    def new_graph(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph()

    @contextmanager
    def capturing(self, graph: torch.cuda.CUDAGraph) -> Iterator[None]:
        """Capture into ``graph`` with the cyclic garbage collector held off. An engine is a
        reference cycle (its graphs call back into it): collected during a capture, a
        dropped engine would destroy its graphs there, which invalidates the capture. So
        what is already garbage goes first, and nothing is collected while capturing."""
        gc.collect()
        enabled = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                yield
        finally:
            if enabled:
                gc.enable()

    def event(self) -> torch.cuda.Event:
        """A timing event on the stream replays run on (recorded without a host sync)."""
        return torch.cuda.Event(enable_timing=True)


class DecodeGraphs:
    """Graphs of one engine's decode traversal. ``traverse(hidden, batch)`` is the engine's
    eager traversal (KV write and backend attention per layer) -> [R, hidden]."""

    def __init__(
        self,
        settings: GraphSettings,
        kv: PagedKVCache,
        backend: AttentionBackend,
        hidden_size: int,
        max_context: int,
        traverse: Traverse,
        capture=None,
        verify_rows: int = 1,
    ) -> None:
        blockers = backend.graph_blockers()
        if settings.capture and capture is None and blockers:  # a CUDA capture
            raise ConfigError("CUDA graphs cannot capture this backend: " + "; ".join(blockers))
        device = kv.key_pool.device
        if settings.capture and capture is None and device.type != "cuda":
            raise ConfigError(
                f"CUDA graph capture needs a CUDA device; the KV cache is on {device}"
            )
        if settings.capture and capture is None:
            capture = CudaCapture(device)
        self.capture = capture
        self.settings, self.kv, self.backend, self.traverse = settings, kv, backend, traverse
        # a graph serves plain decode and verification steps alike: its views allow the
        # largest verification group (the speculation block) that fits the bucket
        self.verify_rows = verify_rows
        self.max_context = settings.max_context or max_context
        self.width = math.ceil(self.max_context / kv.block_size)
        rows = settings.buckets[-1]
        self.hidden = torch.zeros(rows, hidden_size, dtype=kv.key_pool.dtype, device=device)
        self.inputs = GraphInputs(rows, kv.num_depths, self.width, device)
        fields = self.inputs.device_fields
        self.fields = {name: fields[name] for name in VIEW_FIELDS}
        self.tables, self.kv_slots = fields["tables"], fields["kv_slots"]
        backend.reserve_graph_inputs(rows, self.width * kv.block_size)
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.fallbacks: Counter[str] = Counter()
        self.replays = self.eager_steps = 0
        self.fill_seconds = 0.0  # host time planning graph steps' inputs (not the replays)
        self._timed: list[tuple[tuple, object, object]] | None = None
        self.graph_bytes = 0  # reserved memory the captures added (the shared graph pool)

    # ------------------------------------------------------------ planning
    def _reason(self, groups: list[RowGroup]) -> str | None:
        """Why these rows cannot run from a graph (None: they can)."""
        if any(g.mode not in GRAPH_MODES for g in groups):
            return "the step has prefill rows"
        rows = sum(g.count for g in groups)
        if rows > self.settings.buckets[-1]:
            return f"{rows} decode rows exceed the largest bucket {self.settings.buckets[-1]}"
        widest = max(self.kv.table_blocks(g.request_id) for g in groups)
        if widest > self.width:
            return (
                f"a block table of {widest} blocks exceeds the graph capacity of {self.width} "
                f"(max_context={self.max_context})"
            )
        return None

    def _view(self, bucket: int, depths: frozenset[int]) -> BatchView:
        fields = {name: tensor[:bucket] for name, tensor in self.fields.items()}
        return BatchView(
            **fields,
            block_tables=self.tables[:, :bucket],
            decode_only=True,
            decode_depths=depths,
            verify_rows=min(self.verify_rows, bucket),
        )

    def _fill(self, groups: list[RowGroup], hidden: torch.Tensor, bucket: int) -> None:
        """Copy this step's rows into the fixed buffers (padding rows after them)."""
        self.inputs.fill(groups, self.kv, bucket)
        rows = hidden.shape[0]
        self.hidden[:rows].copy_(hidden)
        if bucket > rows:
            self.hidden[rows:bucket].zero_()

    # ------------------------------------------------------------ running
    def run(self, groups: list[RowGroup], hidden: torch.Tensor) -> torch.Tensor | None:
        """The traversal's output [rows, hidden] for the decode and verification rows of
        ``groups`` (in group order) with inputs ``hidden`` [rows, hidden]; None when these
        rows must run eagerly (reason in ``fallbacks``)."""
        started = time.perf_counter()
        reason = self._reason(groups)
        rows = sum(g.count for g in groups)
        bucket = next((b for b in self.settings.buckets if b >= rows), 0)
        step = GraphStep()
        if reason is None:
            pad = bucket - rows
            owners = [g.request_id for g in groups for _ in range(g.count)] + [None] * pad
            depths = [g.depth for g in groups for _ in range(g.count)] + [0] * pad
            tokens = row_tokens(groups) + [(-1, -1)] * pad
            step = self.backend.plan_graph_step(owners, depths, tokens)
            reason = step.reason
        if reason is not None:
            if reason not in self.fallbacks:
                LOG.warning("decode step runs eagerly (same backend and kernels): %s", reason)
            self.fallbacks[reason] += 1
            return None
        self._fill(groups, hidden, bucket)
        self.fill_seconds += time.perf_counter() - started

        # the depths present decide which ops the traversal launches (and so captures)
        present = frozenset(g.depth for g in groups)
        traverse = self._traversal(bucket, present, step, tuple(groups), rows)
        key = (bucket, step.variant, self.backend.decode_ops(present, step.references_ready))
        with torch.no_grad():
            if not self.settings.capture:
                self.eager_steps += 1
                return traverse()[:rows]
            if key in self.graphs:
                graph, out = self.graphs[key]
                if self._timed is None:
                    graph.replay()
                else:  # events around the replay: GPU time per key, read after the run
                    start, end = self.capture.event(), self.capture.event()
                    start.record()
                    graph.replay()
                    end.record()
                    self._timed.append((key, start, end))
                self.replays += 1
                return out[:rows].clone()  # the pool is shared: the next replay reuses it
            out = traverse()  # this step's result; compiles every kernel before the capture
            self.eager_steps += 1
            self._capture(key, traverse)
            return out[:rows]

    def _traversal(
        self,
        bucket: int,
        depths: frozenset[int],
        step: GraphStep,
        groups: tuple[RowGroup, ...],
        rows: int,
    ) -> Callable[[], torch.Tensor]:
        """The traversal of ``bucket`` rows from the fixed buffers, ``rows`` of them real."""

        def traverse() -> torch.Tensor:
            # A new view object each time: the backend plans once per view (gather order,
            # routes, packed metadata), so the capture must see one no eager run planned,
            # or the graph would replay the warm-up's plan instead of computing it.
            view = self._view(bucket, depths)
            self.backend.bind_graph_step(view, step)
            batch = Batch(view, self.kv_slots[:bucket], groups, rows)
            return self.traverse(self.hidden[:bucket], batch)

        return traverse

    def _capture(self, key: tuple, traverse: Callable[[], torch.Tensor]) -> None:
        before = self.capture.reserved()
        graph = self.capture.new_graph()
        with self.capture.capturing(graph):
            static = traverse()
        self.graph_bytes += self.capture.reserved() - before
        self.graphs[key] = (graph, static)

    def prepare(
        self, bucket: int, depths: frozenset[int], variant: int, references_ready: bool = False
    ) -> bool:
        """Capture the graph of key (``bucket``, ``variant``, the ops of rows at ``depths``
        when ``references_ready`` or not) on padding rows, unless it exists: a replay
        reads whatever rows the fixed buffers hold then, so serving that key later
        captures and compiles nothing. Returns whether it captured."""
        key = (bucket, variant, self.backend.decode_ops(depths, references_ready))
        if not self.settings.capture or key in self.graphs:
            return False
        self._fill([], self.hidden[:0], bucket)
        planned = self.backend.plan_graph_step([None] * bucket, [0] * bucket)
        step = dataclasses.replace(planned, variant=variant, references_ready=references_ready)
        traverse = self._traversal(bucket, depths, step, (), 0)
        with torch.no_grad():
            traverse()  # compiles every kernel before the capture
            self._capture(key, traverse)
        return True

    def prepare_every_key(self, max_rows: int, loops: int, one_depth: bool = False) -> int:
        """:meth:`prepare` every key a decode step of up to ``max_rows`` rows at depths
        below ``loops`` can meet: each bucket that holds such a step (the smallest at or
        above ``max_rows`` included), each set of depths with no more depths than the
        bucket has rows (``one_depth``: single depths, as steps in lockstep meet), each
        variant the backend can plan for them. Returns how many graphs it captured."""
        captured = 0
        for bucket in self.settings.buckets:
            for size in range(1, 1 + (1 if one_depth else min(bucket, loops))):
                for depths in map(frozenset, itertools.combinations(range(loops), size)):
                    for variant in self.backend.graph_variants(depths):
                        for ready in self.backend.reference_variants(depths):
                            captured += self.prepare(bucket, depths, variant, ready)
            if bucket >= max_rows:
                break
        return captured

    def time_replays(self) -> None:
        """From now on, time every replay on the device (no host sync per step)."""
        self._timed = []

    def replay_ms(self) -> dict[str, dict]:
        """GPU ms per replay of each graph key since :meth:`time_replays` (this syncs)."""
        per_key: dict[tuple, list[float]] = {}
        for key, start, end in self._timed or []:
            end.synchronize()
            per_key.setdefault(key, []).append(start.elapsed_time(end))
        # the total and the max beside the median: a step's wall time is compared with the
        # GPU time of its replays, and a few slow replays hide under a median
        return {
            repr(key): {
                "median_ms": sorted(ms)[len(ms) // 2],
                "mean_ms": sum(ms) / len(ms),
                "max_ms": max(ms),
                "total_ms": sum(ms),
                "replays": len(ms),
            }
            for key, ms in sorted(per_key.items())
        }

    def stats(self) -> dict:
        steps = max(1, self.replays + self.eager_steps)
        return {
            "graphs": sorted(self.graphs),
            "replays": self.replays,
            "eager_steps": self.eager_steps,
            "fallbacks": dict(self.fallbacks),
            "graph_bytes": self.graph_bytes,
            "host_fill_ms_per_step": 1e3 * self.fill_seconds / steps,
            "max_context": self.max_context,
            "buckets": list(self.settings.buckets),
            "split_mixed_steps": self.settings.split_mixed_steps,
        }
