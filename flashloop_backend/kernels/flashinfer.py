"""FlashInfer adapter for dense paged attention (optional extra ``flashinfer``).

FlashInfer plans a batch on the host (its planner reads page counts), so this path
synchronises once per new batch and is not graph-safe; the plan is reused while the same
block tables and lengths are passed again (every layer of one traversal). Rows with no
context (padding) must not be mistaken for a sequence's continuation and return zeros.
Imported lazily: a missing package or GPU is a selection reason, never a crash.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from flashloop_backend._version import __version__
from flashloop_backend.capabilities import Capability, Support
from flashloop_backend.kernels.op_protocols import OpName
from flashloop_backend.kernels.ops import KernelImpl, KernelProvider
from flashloop_backend.kernels.validate import check_paged_inputs, tensor_versions

SUPPORT = Support(
    devices=frozenset({"cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16}),
    head_dims=frozenset({64, 128, 256}),
    min_compute_capability=(8, 0),
    python_modules=("flashinfer",),
    capabilities=frozenset({Capability.NONCONSECUTIVE_QUERIES, Capability.PACKED_PREFILL}),
)
WORKSPACE_BYTES = 256 * 1024 * 1024


def plan_sequences(
    tables: torch.Tensor, lengths: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's CSR plan of rows with tables [R, MB] and lengths [R] (any device):
    (qo_indptr [S + 1], kv_indptr [S + 1], page indices [sum of pages], last page length
    [S]), int32 on the host. Consecutive rows with one table and consecutive lengths form a
    causal sequence (a prefill chunk); other rows are sequences of one query. Padding rows
    (length 0) are planned as one visible key (zeroed afterwards), so FlashInfer never sees
    an empty sequence. The rows are grouped on the tables' device, so only each sequence's
    table travels to the host (a 32K-row chunk would otherwise copy R x MB entries)."""
    rows = lengths.shape[0]
    lengths = lengths.long().clamp(min=1)
    tables = tables.clamp(min=0)
    starts_here = torch.ones(rows, dtype=torch.bool, device=lengths.device)
    if rows > 1:
        same = (lengths[1:] == lengths[:-1] + 1) & (tables[1:] == tables[:-1]).all(dim=1)
        starts_here[1:] = ~same
    first = torch.nonzero(starts_here).flatten()
    ends = torch.cat([first[1:], first.new_tensor([rows])])
    kv_len = lengths[ends - 1].cpu()
    seq_tables = tables[first].cpu()
    first = first.cpu()
    pages = (kv_len + block_size - 1) // block_size
    keep = torch.arange(seq_tables.shape[1])[None, :] < pages[:, None]
    indices = seq_tables[keep].to(torch.int32)
    kv_indptr = torch.zeros(len(first) + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(pages, 0)
    last = (kv_len - (pages - 1) * block_size).to(torch.int32)
    qo_indptr = torch.cat([first, first.new_tensor([rows])]).to(torch.int32)
    return qo_indptr, kv_indptr, indices, last


class FlashInferPagedAttention:
    """Per-row paged attention through FlashInfer (NHD layout). Consecutive rows with the same
    block table and consecutive context lengths (a prefill chunk) are planned as one causal
    prefill sequence; a batch of single-row sequences uses the decode kernel."""

    def __init__(self, device: torch.device) -> None:
        import flashinfer

        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        self.decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self.prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        self._key: tuple | None = None
        self.use_prefill = False

    def plan(
        self, tables, lengths, device, num_q_heads, num_kv_heads, head_dim, block_size, dtype, scale
    ):
        """Plan for tables [R, MB] and lengths [R] (see :func:`plan_sequences`)."""
        self.empty_rows = lengths == 0
        # read once per batch, where planning waits for the device anyway: a batch without
        # padding rows then returns the kernel's output with no zeroing at every layer
        self.has_empty_rows = bool(self.empty_rows.any())
        qo_indptr, kv_indptr, indices, last = plan_sequences(tables, lengths, block_size)
        self.use_prefill = len(qo_indptr) - 1 < len(lengths)
        common = dict(q_data_type=dtype, kv_data_type=dtype, sm_scale=scale)
        if self.use_prefill:
            self.prefill.plan(
                qo_indptr.to(device),
                kv_indptr.to(device),
                indices.to(device),
                last.to(device),
                num_q_heads,
                num_kv_heads,
                head_dim,
                block_size,
                causal=True,
                **common,
            )
        else:
            self.decode.plan(
                kv_indptr.to(device),
                indices.to(device),
                last.to(device),
                num_q_heads,
                num_kv_heads,
                head_dim,
                block_size,
                **common,
            )

    def __call__(self, q, key_cache, value_cache, block_tables, context_lengths, scale=None):
        rows, num_q_heads, head_dim = check_paged_inputs(
            q, key_cache, value_cache, block_tables, context_lengths
        )
        if rows == 0:
            return q.new_empty((0, num_q_heads, head_dim))
        _, block_size, num_kv_heads, _ = key_cache.shape
        scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
        # The plan is reused only for identical contents (every layer of one traversal): a
        # fresh tensor at a recycled address must never pick up a stale plan. Contents are
        # compared on the device; only a new batch is copied to the host for planning.
        key = (q.dtype, num_q_heads, num_kv_heads, block_size, scale)
        last = self._key
        # the very tensors planned last, unmodified since (held here, so never recycled):
        # every later layer of one traversal, without a device comparison and its sync
        versions = tensor_versions(block_tables, context_lengths)
        same_objects = (
            last is not None
            and versions is not None
            and last[0] == key
            and last[3] is block_tables
            and last[4] is context_lengths
            and last[5] == versions
        )
        if not same_objects and (
            last is None
            or last[0] != key
            or last[1].shape != block_tables.shape
            or last[2].shape != context_lengths.shape
            or not (torch.equal(last[1], block_tables) and torch.equal(last[2], context_lengths))
        ):
            self.plan(
                block_tables,
                context_lengths,
                q.device,
                num_q_heads,
                num_kv_heads,
                head_dim,
                block_size,
                q.dtype,
                scale,
            )
            self._key = (key, block_tables.clone(), context_lengths.clone())
        self._key = (
            *self._key[:3],
            block_tables,
            context_lengths,
            versions,
        )
        wrapper = self.prefill if self.use_prefill else self.decode
        out = wrapper.run(q, (key_cache, value_cache))
        if not self.has_empty_rows:
            return out
        return torch.where(self.empty_rows[:, None, None], torch.zeros_like(out), out)


# one planner per device (benchmarks reach the planned wrapper through planned_wrapper)
_INSTANCES: dict[torch.device, FlashInferPagedAttention] = {}


def paged_attention_flashinfer(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """The ``PagedAttention`` contract through FlashInfer (one planner per device)."""
    instance = _INSTANCES.get(q.device)
    if instance is None:
        instance = _INSTANCES[q.device] = FlashInferPagedAttention(q.device)
    return instance(q, key_cache, value_cache, block_tables, context_lengths, scale)


def planned_wrapper(device: torch.device) -> Any:
    """The FlashInfer wrapper (``BatchDecodeWithPagedKVCacheWrapper``, or the prefill one for
    a batch of causal chunks) that the last :func:`paged_attention_flashinfer` call on
    ``device`` planned. Its ``run(q, (key_cache, value_cache))`` (q [R, Hq, D], caches
    [NB, BS, Hkv, D] of that call's shapes) repeats the attention without the plan check
    and without zeroing padding rows, so benchmarks time FlashInfer's kernel alone.
    LookupError if no call has planned on ``device`` yet."""
    instance = _INSTANCES.get(device)
    if instance is None or instance._key is None:
        raise LookupError(f"no paged_attention_flashinfer call has planned on {device} yet")
    return instance.prefill if instance.use_prefill else instance.decode


def provider() -> KernelProvider:
    try:
        from importlib.metadata import version

        fi_version = version("flashinfer-python")
    except Exception:
        fi_version = "not installed"
    # Not offered for ``sparse_prefill``: the planner makes every nonconsecutive query row a
    # sequence of its own, which is correct but re-reads the context once per row.
    # ``dense_prefill`` too: its planner makes each run of consecutive rows one causal sequence.
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
