"""Attention operations the dispatcher routes segments to: their names and the protocol
each implementation follows (explicit arguments: tests, benchmarks and plugins call an
implementation that way). Shapes use: R rows, Hq query heads, Hkv KV heads, D head dim,
NB cache blocks, BS block size, MB block-table width, Kb selected-key bucket.
"""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeAlias

import torch

if TYPE_CHECKING:
    from flashloop_backend.kv.levels import LevelMetadata
    from flashloop_backend.kv.store import PackedKVStore


class OpName(str, Enum):
    """Attention segment operations (RFC §4)."""

    DENSE_ATTENTION = "dense_attention"  # per-row causal paged attention (decode rows)
    DENSE_PREFILL = "dense_prefill"  # prefill rows of dense loops: consecutive rows share K/V tiles
    SPARSE_PREFILL = "sparse_prefill"  # active prefill rows at nonconsecutive positions
    DENSE_SOURCE = "dense_source"  # reference-loop decode attention + selection statistics
    SPARSE_CORRECTION = "sparse_correction"  # later-loop decode over selected keys + correction
    PACKED_KV_WRITE = "packed_kv_write"  # every level of a packed append into its pages
    PACKED_DECODE = "packed_decode"  # decode over packed INT4 KV plus a BF16 paged tail
    PACKED_SOURCE = "packed_dense_source"  # dense_source over packed KV
    PACKED_CORRECTION = "packed_sparse_correction"  # sparse_correction over packed KV

    def __str__(self) -> str:
        return self.value


class StatisticsStream(NamedTuple):
    """Where a loop-2 source left its selection statistics (``statistics_stream``): its
    indices, mass and contribution are written on ``stream``, its out and output on the
    caller's stream. The caller orders every use of the statistics after ``stream`` (and a
    use of output there after its own stream) and keeps ``holds`` (the tensors ``stream``
    reads) alive until its own stream has waited for ``stream``."""

    stream: torch.cuda.Stream
    holds: tuple[torch.Tensor, ...]


class SourceOutputs(NamedTuple):
    """What ``dense_source`` and ``packed_dense_source`` return: out [R, Hq, D] in q's
    dtype; indices [R, Hq, Kb] int32 absolute positions in increasing order, -1 in the
    unused slots after them; mass [R, Hq];
    output [R, Hq, D] and contribution [R, Hq, D]; the last three FP32. ``statistics``:
    set where a kernel given a statistics stream wrote the statistics there."""

    out: torch.Tensor
    indices: torch.Tensor
    mass: torch.Tensor
    output: torch.Tensor
    contribution: torch.Tensor
    statistics: StatisticsStream | None = None


class PagedAttention(Protocol):
    """``dense_attention``, ``dense_prefill`` and ``sparse_prefill``: each row is one query at
    absolute position ``context_lengths[r] - 1`` attending causally to keys
    ``[0, context_lengths[r])`` of its own block table, so rows may come from any request,
    depth or position.

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

    Paged inputs as :class:`PagedAttention`; ``key_retention`` keeps
    K = max(1, ceil(key_retention * T)) keys per (row, head); ``k_bucket`` (Kb) is the fixed
    width of the index output. Returns :class:`SourceOutputs`' five tensors in order (a
    plain tuple will do)."""

    def __call__(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lengths: torch.Tensor,
        key_retention: float,
        k_bucket: int,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, ...]: ...


class SparseCorrection(Protocol):
    """``sparse_correction``: O = O_ref - C_ref + m * softmax(q k_S^T * scale) v_S, with k_S,
    v_S read from this depth's pages at ``indices`` [R, Hq, Kb] int32 (increasing
    positions, -1 in the unused slots after them: ``SourceOutputs``' order); mass
    [R, Hq], output and contribution [R, Hq, D], FP32 (``dense_source``'s statistics);
    paged inputs as :class:`PagedAttention`. A (row, head) with no selected key (all -1)
    returns O_ref - C_ref: the softmax term of an empty S is zero, as m is. Returns
    [R, Hq, D] in q's dtype. An implementation declaring ``correction_into_base`` also
    takes keywords ``base`` [R, Hq, D] (q's dtype, contiguous) and ``serves`` [R] bool:
    it writes the rows where ``serves`` holds into ``base``, leaves the others as they
    are, and returns ``base``."""

    def __call__(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        indices: torch.Tensor,
        mass: torch.Tensor,
        output: torch.Tensor,
        contribution: torch.Tensor,
        scale: float | None = None,
    ) -> torch.Tensor: ...


class PackedKVWrite(Protocol):
    """``packed_kv_write``: ``kv.codec.LevelWriter``'s contract (store, rows, presents,
    pages; ``rows`` per depth a ``kv.rows.KVRows``, in place in paged pools or as tensors,
    or None for a level not written, read from its pages when it has some): every written
    level of one append quantized against the reconstruction of the levels before
    and written into its pages, bit for bit what ``kv.codec.encode_levels_chain`` writes.
    Called directly by the store's append (it has no inputs class)."""

    def __call__(self, store, rows, presents, pages) -> None: ...


class PackedDecode(Protocol):
    """``packed_decode``: decode attention of q [R, Hq, D] over each row's history: rows
    below ``meta.packed_lengths`` reconstructed from layer ``layer`` of the packed ``store``
    at the row's depth (``meta``: :class:`~flashloop_backend.kv.levels.LevelMetadata` of
    the R rows), later rows from the BF16 paged cache [NB, BS, Hkv, D] through block_tables
    [R, MB]; context_lengths [R] int32. Returns [R, Hq, D] in q's dtype. ``few_rows``: a
    launch hint, not a change of result: at most a few rows read any key (the rows a loop
    3-4 correction could not serve, none in a steady run), so one program per (row, head)
    serves them and an empty launch costs little."""

    def __call__(
        self,
        q: torch.Tensor,
        store: PackedKVStore,
        layer: int,
        meta: LevelMetadata,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lengths: torch.Tensor,
        scale: float | None = None,
        few_rows: bool = False,
    ) -> torch.Tensor: ...


class PackedDenseSource(Protocol):
    """``packed_dense_source``: :class:`DenseSource` whose K/V below each row's packed length
    come from the packed store (``store``, ``layer``, ``meta`` as :class:`PackedDecode`)."""

    def __call__(
        self,
        q: torch.Tensor,
        store: PackedKVStore,
        layer: int,
        meta: LevelMetadata,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lengths: torch.Tensor,
        key_retention: float,
        k_bucket: int,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, ...]: ...


class PackedSparseCorrection(Protocol):
    """``packed_sparse_correction``: :class:`SparseCorrection` whose selected K/V below each
    row's packed length come from the packed store (``store``, ``layer``, ``meta`` as
    :class:`PackedDecode`)."""

    def __call__(
        self,
        q: torch.Tensor,
        store: PackedKVStore,
        layer: int,
        meta: LevelMetadata,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        indices: torch.Tensor,
        mass: torch.Tensor,
        output: torch.Tensor,
        contribution: torch.Tensor,
        scale: float | None = None,
    ) -> torch.Tensor: ...


OpFunction: TypeAlias = (
    PagedAttention
    | DenseSource
    | SparseCorrection
    | PackedKVWrite
    | PackedDecode
    | PackedDenseSource
    | PackedSparseCorrection
)
