"""Attention operations the dispatcher routes segments to, as typed protocols.

Each op is implemented by one or more kernel providers (torch reference, Triton,
FlashInfer, plugins) registered under the ``flashloop_backend.kernels`` entry-point group.
Shapes use: R rows, Hq query heads, Hkv KV heads, D head dim, NB cache blocks,
BS block size, MB block-table width.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Protocol

import torch

from flashloop_backend.capabilities import Support


class OpName(str, Enum):
    """Attention segment operations (RFC §4)."""

    DENSE_ATTENTION = "dense_attention"  # per-row causal paged attention (decode rows)
    DENSE_PREFILL = "dense_prefill"  # prefill rows of dense loops: consecutive rows share K/V tiles
    SPARSE_PREFILL = "sparse_prefill"  # active prefill rows at nonconsecutive positions
    DENSE_SOURCE = "dense_source"  # reference-loop decode attention + selection statistics
    SPARSE_CORRECTION = "sparse_correction"  # later-loop decode over selected keys + correction
    PACKED_KV_WRITE = "packed_kv_write"  # INT4 quantize-and-pack of K/V into the store
    PACKED_DECODE = "packed_decode"  # decode over packed INT4 KV plus a BF16 paged tail
    PACKED_SOURCE = "packed_dense_source"  # dense_source over packed KV
    PACKED_CORRECTION = "packed_sparse_correction"  # sparse_correction over packed KV

    def __str__(self) -> str:
        return self.value


class PagedAttention(Protocol):
    """``dense_attention``, ``dense_prefill`` and ``sparse_prefill``: each row is one query at absolute
    position ``context_lengths[r] - 1`` attending causally to keys ``[0, context_lengths[r])``
    of its own block table, so rows may come from any request, depth or position.

    q: [R, Hq, D]; key_cache, value_cache: [NB, BS, Hkv, D] (strided per-layer views allowed);
    block_tables: [R, MB] int32 (entries past a row's context may be -1, 0 or stale);
    context_lengths: [R] int32, 0 for padding rows (their output is zero).
    Returns [R, Hq, D] in q's dtype.
    """

    def __call__(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lengths: torch.Tensor,
        scale: float | None = None,
    ) -> torch.Tensor: ...


class DenseSource(Protocol):
    """``dense_source``: loop-2 decode attention that also returns selection statistics.

    Paged inputs as :class:`PagedAttention`; ``ratio`` keeps K = max(1, ceil(ratio * T)) keys
    per (row, head); ``k_bucket`` (Kb) is the fixed width of the index output. Returns
    (out [R, Hq, D] q.dtype, indices [R, Hq, Kb] int32 absolute positions (-1 unused),
    mass [R, Hq], output [R, Hq, D], contribution [R, Hq, D]; the last three FP32)."""

    def __call__(self, q, key_cache, value_cache, block_tables, context_lengths, ratio: float,
                 k_bucket: int, scale: float | None = None) -> tuple[torch.Tensor, ...]: ...  # fmt: skip


class PackedKVWrite(Protocol):
    """``packed_kv_write``: ``algorithms.quantize_int4``'s contract (x, group_size, dim) ->
    ``QuantizedInt4``; the store lays its codes out in pages."""

    def __call__(self, x: torch.Tensor, group_size: int = 64, dim: int = -1): ...


class PackedDecode(Protocol):
    """``packed_decode``: decode attention of q [R, Hq, D] over each row's history: rows
    below ``meta.packed_lengths`` reconstructed from the packed store at the row's
    depth (``meta``: :class:`~flashloop_backend.kv.levels.LevelMetadata`), later rows from
    the BF16 paged cache through block_tables [R, MB]. Returns [R, Hq, D] q.dtype."""

    def __call__(self, q, store, layer: int, meta, key_cache, value_cache, block_tables,
                 context_lengths, scale: float | None = None) -> torch.Tensor: ...  # fmt: skip


class PackedSparseDecode(Protocol):
    """``packed_dense_source`` / ``packed_sparse_correction``: :class:`DenseSource` and
    :class:`SparseCorrection` whose K/V below each row's packed length come from the
    packed store (arguments as :class:`PackedDecode`, then the op's own: ``ratio,
    k_bucket`` or ``indices, mass, output, contribution``)."""

    def __call__(self, q, store, layer: int, meta, key_cache, value_cache, block_tables,
                 *args, scale: float | None = None): ...  # fmt: skip


class SparseCorrection(Protocol):
    """``sparse_correction``: O = O_ref - C_ref + m * softmax(q k_S^T * scale) v_S, with k_S, v_S
    read from this depth's pages at ``indices`` [R, Hq, Kb]. Returns [R, Hq, D] q.dtype."""

    def __call__(self, q, key_cache, value_cache, block_tables, indices, mass, output,
                 contribution, scale: float | None = None) -> torch.Tensor: ...  # fmt: skip


@dataclass(frozen=True)
class KernelImpl:
    """One implementation of one op, with what it supports."""

    op: OpName
    fn: Callable[..., torch.Tensor]
    support: Support


@dataclass(frozen=True)
class KernelProvider:
    """What a ``flashloop_backend.kernels`` entry point returns when called.

    ``priority`` orders automatic selection (higher first); explicit overrides ignore it.
    """

    name: str
    version: str
    impls: Mapping[OpName, KernelImpl]
    priority: int = 0
    description: str = ""
    extras: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for op, impl in self.impls.items():
            if impl.op != op:
                raise ValueError(f"provider {self.name!r}: impl for {op} declares op {impl.op}")
