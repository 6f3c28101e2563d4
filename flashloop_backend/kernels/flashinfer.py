"""FlashInfer adapter for paged attention (optional extra ``flashinfer``): dense decode
and prefill here, ``sparse_prefill`` over spans in ``flashinfer_span.py``.

FlashInfer plans a batch on the host, and a plan is reused while the same rows are
passed again (every layer of one traversal; plans rotate over ``PLAN_SLOTS`` slots, so
calls alternating between a few row sets keep theirs). Given the host's :class:`SequencePlan` of
the rows (``host_sequence_plan``), planning reads nothing from the device, so it does not
wait for the kernels queued before it (only for a plan slot's copy queued
``PLAN_SLOTS`` plans earlier); without one, the adapter reads the rows' tables and
lengths back once per new batch (counted in ``device_plans``) and waits for the device.
Either way the path is not graph-safe. Rows with no
context (padding) must not be mistaken for a sequence's continuation and return zeros.
Imported lazily: a missing package or GPU is a selection reason, never a crash.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from flashloop_backend._version import __version__
from flashloop_backend.capabilities import Capability, Support
from flashloop_backend.kernels.op_protocols import OpName
from flashloop_backend.kernels.ops import KernelImpl, KernelProvider
from flashloop_backend.kernels.sequence_plan import SequencePlan, plan_sequences
from flashloop_backend.kernels.span_plan import DeviceSpanPlans, SpanPlan, check_span_sequences
from flashloop_backend.kernels.validate import check_paged_inputs, tensor_versions

SUPPORT = Support(
    devices=frozenset({"cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16}),
    head_dims=frozenset({64, 128, 256}),
    min_compute_capability=(8, 0),
    python_modules=("flashinfer",),
    capabilities=frozenset(
        {
            Capability.NONCONSECUTIVE_QUERIES,
            Capability.PACKED_PREFILL,
            Capability.HOST_SEQUENCE_PLAN,
        }
    ),
)
WORKSPACE_BYTES = 256 * 1024 * 1024
# FlashInfer stages each plan in its wrapper's pinned buffer and copies it to the device
# asynchronously, so a wrapper is planned again only once its last plan's copy has run:
# plans rotate over this many wrappers, and the host waits for the oldest one's copy
# (queued several plans ago, so it has normally run) before planning on it again. Each
# slot's wrappers hold FlashInfer's 8 MiB integer workspace on the device and its pinned
# twin; the 256 MiB float workspace is shared (runs are ordered on one stream).
PLAN_SLOTS = 4
# Query heads per KV head that FlashInfer's decode kernel (CUDA cores) serves; a batch of
# single-row sequences at another ratio goes to the prefill wrapper (any ratio, the same
# attention).
DECODE_GROUP_SIZES = frozenset({1, 2, 3, 4, 8})
# Sequences FlashInfer's prefill wrapper plans at most (its key-length buffer's entries).
PREFILL_MAX_SEQUENCES = 32768


@dataclass
class _PlannedFrom:
    """What a slot's plan was made from, under ``key`` (heads, head size, dtype, scale,
    block size): the host's plan object, or the device's rows (copies of their tables and
    lengths to compare by content, and the tensors last passed with their versions, to
    recognise them unmodified without a comparison)."""

    key: tuple
    host_plan: SequencePlan | None = None
    tables: torch.Tensor | None = None
    lengths: torch.Tensor | None = None
    passed: tuple = ()


@dataclass
class _PlanSlot:
    """One pair of FlashInfer wrappers (made on first use), the event after its last
    plan's copies, what that plan was made from, and its rows to zero ([R] bool; None:
    no padding row)."""

    decode: Any = None
    prefill: Any = None
    use_prefill: bool = False
    copied: Any = None
    planned: _PlannedFrom | None = None
    empty_rows: torch.Tensor | None = None

    @property
    def wrapper(self) -> Any:
        return self.prefill if self.use_prefill else self.decode


class FlashInferPagedAttention:
    """Per-row paged attention through FlashInfer (NHD layout). Consecutive rows with the same
    block table and consecutive context lengths (a prefill chunk) are planned as one causal
    prefill sequence; a batch of single-row sequences uses the decode kernel. Each slot
    keeps its plan until it is planned again, so calls that alternate between row sets
    (one layer's prefill rows, then its decode rows) reuse their plans."""

    def __init__(self, device: torch.device) -> None:
        import flashinfer

        self._flashinfer = flashinfer
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self._slots = [_PlanSlot() for _ in range(PLAN_SLOTS)]
        self._next_slot = 0
        self.current: _PlanSlot | None = None
        self._last_device_slot: _PlanSlot | None = None
        self.device_plans = 0  # plans made by reading the rows back from the device
        self._span_rows: tuple | None = None  # (host span plan, its rows on the device)
        self.device_spans = DeviceSpanPlans()

    def plan(
        self,
        sequences: SequencePlan,
        lengths: torch.Tensor | None,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        scale: float,
        prefill: bool = False,
    ) -> None:
        """Plans ``sequences`` (lengths [R] are the rows' own, on the device; None for a plan
        with no empty row) on the next slot's wrapper, which becomes ``current``; the caller
        records what it was made from in the slot's ``planned``. ``prefill``: on the prefill
        wrapper even where every sequence is one row."""
        decode_ratio = num_q_heads // num_kv_heads in DECODE_GROUP_SIZES
        chunked = sequences.num_sequences < sequences.num_rows
        use_prefill = prefill or chunked or not decode_ratio
        if use_prefill and sequences.num_sequences > PREFILL_MAX_SEQUENCES:
            raise ValueError(
                f"FlashInfer's prefill plans at most {PREFILL_MAX_SEQUENCES} sequences; this "
                f"call's {sequences.num_rows} rows form {sequences.num_sequences}"
            )
        slot = self._slots[self._next_slot]
        self._next_slot = (self._next_slot + 1) % len(self._slots)
        if slot.copied is not None:
            slot.copied.synchronize()
        slot.use_prefill, slot.planned = use_prefill, None
        common = dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)
        heads = (num_q_heads, num_kv_heads, head_dim, sequences.block_size)
        pages = (sequences.kv_indptr, sequences.page_indices, sequences.last_page_lengths)
        if slot.use_prefill:
            if slot.prefill is None:
                make = self._flashinfer.BatchPrefillWithPagedKVCacheWrapper
                slot.prefill = make(self.workspace, "NHD")
            slot.prefill.plan(sequences.qo_indptr, *pages, *heads, causal=True, **common)
        else:
            if slot.decode is None:
                make = self._flashinfer.BatchDecodeWithPagedKVCacheWrapper
                slot.decode = make(self.workspace, "NHD")
            slot.decode.plan(*pages, *heads, **common)
        if slot.copied is None:
            slot.copied = torch.cuda.Event()
        slot.copied.record(torch.cuda.current_stream(self.workspace.device))
        self.current = slot
        # a batch without padding rows returns the kernel's output with no zeroing
        slot.empty_rows = (lengths == 0) if sequences.has_empty_rows else None

    def _host_planned_slot(self, key: tuple, plan: SequencePlan) -> _PlanSlot | None:
        """The slot already planned from this very host plan object under ``key``."""
        for slot in self._slots:
            planned = slot.planned
            if planned is not None and planned.key == key and planned.host_plan is plan:
                return slot
        return None

    def _device_planned_slot(self, key: tuple, tables, lengths, versions) -> _PlanSlot | None:
        """The slot whose plan, made from the device's tables and lengths, holds for these.
        The very tensors planned or passed before, unmodified since (held here, so never
        recycled), need no device comparison and its wait; otherwise only the last
        device-planned slot is compared by content (a fresh tensor at a recycled address is
        never trusted by address). ``versions``: the tensors' versions (None: unknown)."""
        for slot in self._slots:
            planned = slot.planned
            if planned is None or planned.key != key or planned.tables is None:
                continue
            if versions is not None and planned.passed:
                seen_tables, seen_lengths, seen_versions = planned.passed
                if seen_tables is tables and seen_lengths is lengths and seen_versions == versions:
                    return slot
        slot = self._last_device_slot
        last = None if slot is None else slot.planned
        if last is None or last.key != key or last.tables is None:
            return None
        same = (
            last.tables.shape == tables.shape
            and last.lengths.shape == lengths.shape
            and torch.equal(last.tables, tables)
            and torch.equal(last.lengths, lengths)
        )
        return slot if same else None

    def run_host_planned(
        self, q, key_cache, value_cache, sequence_plan: SequencePlan, scale: float | None
    ) -> torch.Tensor:
        """Attention of q [S, Hq, D] over the host's ``sequence_plan`` of its rows, which
        has no row of length 0 (a span plan's sequences), in caches [NB, BS, Hkv, D] of its
        page size; planned once per plan object, always on the prefill wrapper (one kernel
        for every span, whatever its rows)."""
        check_span_sequences(sequence_plan, q.shape[0], key_cache.shape[1])
        num_q_heads, head_dim = q.shape[1:]
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        shape = (num_q_heads, key_cache.shape[2], head_dim, q.dtype, scale)
        key = (*shape, key_cache.shape[1])
        slot = self._host_planned_slot(key, sequence_plan)
        if slot is None:
            self.plan(sequence_plan, None, *shape, prefill=True)
            self.current.planned = _PlannedFrom(key, host_plan=sequence_plan)
        else:
            self.current = slot
        return self.current.wrapper.run(q, (key_cache, value_cache))

    def span_rows(self, plan: SpanPlan, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(rows, slots) of a host span plan on ``device``, copied once per plan object."""
        if self._span_rows is None or self._span_rows[0] is not plan:
            copies = tuple(t.to(device, non_blocking=True) for t in (plan.rows, plan.slots))
            self._span_rows = (plan, copies)
        return self._span_rows[1]

    def __call__(
        self,
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lengths,
        scale=None,
        sequence_plan: SequencePlan | None = None,
    ):
        rows, num_q_heads, head_dim = check_paged_inputs(
            q, key_cache, value_cache, block_tables, context_lengths
        )
        if rows == 0:
            return q.new_empty((0, num_q_heads, head_dim))
        _, block_size, num_kv_heads, _ = key_cache.shape
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        shape = (num_q_heads, num_kv_heads, head_dim, q.dtype, scale)
        key = (*shape, block_size)
        if sequence_plan is not None:
            if (sequence_plan.num_rows, sequence_plan.block_size) != (rows, block_size):
                raise ValueError(
                    f"sequence_plan covers {sequence_plan.num_rows} rows in pages of "
                    f"{sequence_plan.block_size} keys; the call has {rows} rows in pages "
                    f"of {block_size}"
                )
            slot = self._host_planned_slot(key, sequence_plan)
            if slot is None:
                self.plan(sequence_plan, context_lengths, *shape)
                self.current.planned = _PlannedFrom(key, host_plan=sequence_plan)
            else:
                self.current = slot
        else:
            versions = tensor_versions(block_tables, context_lengths)
            slot = self._device_planned_slot(key, block_tables, context_lengths, versions)
            if slot is None:
                planned = plan_sequences(block_tables, context_lengths, block_size)
                self.plan(planned, context_lengths, *shape)
                self.device_plans += 1
                copies = block_tables.clone(), context_lengths.clone()
                self.current.planned = _PlannedFrom(key, None, *copies)
                self._last_device_slot = self.current
            else:
                self.current = slot
            self.current.planned.passed = (block_tables, context_lengths, versions)
        out = self.current.wrapper.run(q, (key_cache, value_cache))
        empty_rows = self.current.empty_rows
        if empty_rows is None:
            return out
        return torch.where(empty_rows[:, None, None], torch.zeros_like(out), out)


# one planner per device (benchmarks reach the planned wrapper through planned_wrapper)
_INSTANCES: dict[torch.device, FlashInferPagedAttention] = {}


def paged_attention_flashinfer(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    scale: float | None = None,
    sequence_plan: SequencePlan | None = None,
) -> torch.Tensor:
    """The ``PagedAttention`` contract through FlashInfer (one planner per device);
    ``sequence_plan``: the host's plan of the rows (``host_sequence_plan``)."""
    return instance_on(q.device)(
        q, key_cache, value_cache, block_tables, context_lengths, scale, sequence_plan
    )


def instance_on(device: torch.device) -> FlashInferPagedAttention:
    """The one planner of ``device`` (made on first use)."""
    instance = _INSTANCES.get(device)
    if instance is None:
        instance = _INSTANCES[device] = FlashInferPagedAttention(device)
    return instance


def planned_wrapper(device: torch.device) -> Any:
    """The FlashInfer wrapper (``BatchDecodeWithPagedKVCacheWrapper``, or the prefill one for
    a batch of causal chunks) that the last :func:`paged_attention_flashinfer` call on
    ``device`` planned. Its ``run(q, (key_cache, value_cache))`` (q [R, Hq, D], caches
    [NB, BS, Hkv, D] of that call's shapes) repeats the attention without the plan check
    and without zeroing padding rows, so benchmarks time FlashInfer's kernel alone.
    LookupError if no call has planned on ``device`` yet."""
    instance = _INSTANCES.get(device)
    if instance is None or instance.current is None:
        raise LookupError(f"no paged_attention_flashinfer call has planned on {device} yet")
    return instance.current.wrapper


def flashinfer_version() -> str:
    """The installed flashinfer-python's version, or "not installed"."""
    try:
        from importlib.metadata import version

        return version("flashinfer-python")
    except Exception:
        return "not installed"


def provider() -> KernelProvider:
    fi_version = flashinfer_version()
    # ``dense_prefill``: its planner makes each run of consecutive rows one causal sequence;
    # ``sparse_prefill`` over its rows' spans is the ``flashinfer_span`` provider's
    impl = {
        op: KernelImpl(op, paged_attention_flashinfer, SUPPORT)
        for op in (OpName.DENSE_ATTENTION, OpName.DENSE_PREFILL)
    }
    return KernelProvider(
        name="flashinfer",
        version=f"{__version__} (flashinfer {fi_version})",
        priority=30,
        description="FlashInfer batch paged decode and prefill (host-planned)",
        impls=impl,
    )
