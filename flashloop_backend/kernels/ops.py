"""Attention operations the dispatcher routes segments to: typed protocols and inputs.

Each op is implemented by one or more kernel providers (torch reference, Triton,
FlashInfer, plugins) registered under the ``flashloop_backend.kernels`` entry-point group.
An implementation is a function with the op protocol's explicit arguments (tests,
benchmarks and plugins call it that way); the backend calls it through
:class:`KernelImpl` with one frozen inputs object per op (:data:`OP_INPUTS`), so no call
site assembles a positional tuple. Shapes use: R rows, Hq query heads, Hkv KV heads, D
head dim, NB cache blocks, BS block size, MB block-table width, Kb selected-key bucket.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import TYPE_CHECKING, NamedTuple, Protocol, TypeAlias

import torch

from flashloop_backend.capabilities import Support

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


class SourceOutputs(NamedTuple):
    """What ``dense_source`` and ``packed_dense_source`` return: out [R, Hq, D] in q's
    dtype; indices [R, Hq, Kb] int32 absolute positions in increasing order, -1 in the
    unused slots after them; mass [R, Hq];
    output [R, Hq, D] and contribution [R, Hq, D]; the last three FP32."""

    out: torch.Tensor
    indices: torch.Tensor
    mass: torch.Tensor
    output: torch.Tensor
    contribution: torch.Tensor


# ------------------------------------------------------------------ protocols


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
    [R, Hq, D] in q's dtype."""

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


# ------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class PagedInputs:
    """Inputs of ``dense_attention``, ``dense_prefill`` and ``sparse_prefill``
    (:class:`PagedAttention`).

    q [R, Hq, D]; key_cache, value_cache [NB, BS, Hkv, D]; block_tables [R, MB] int32;
    context_lengths [R] int32 (0: a padding row, output zero); scale None: 1 / sqrt(D).
    row_spans [R] int32 (``dense_attention`` of an implementation declaring
    ``grouped_verify_rows``): rows r .. r + row_spans[r] - 1 form one verification group
    sharing row r's table, at most ``max_span`` rows; 0 for a row inside an earlier group.
    The output is the same; the implementation may read the group's keys once."""

    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lengths: torch.Tensor
    scale: float | None = None
    row_spans: torch.Tensor | None = None
    max_span: int = 1

    def call(self, fn: PagedAttention) -> torch.Tensor:
        """``fn`` on these inputs, in the protocol's argument order: [R, Hq, D]."""
        paged = (self.q, self.key_cache, self.value_cache, self.block_tables, self.context_lengths)
        if self.row_spans is None:
            return fn(*paged, self.scale)
        return fn(*paged, self.scale, row_spans=self.row_spans, max_span=self.max_span)


@dataclass(frozen=True)
class SourceInputs:
    """Inputs of ``dense_source`` (:class:`DenseSource`): paged fields as
    :class:`PagedInputs`; key_retention in (0, 1] (K = max(1, ceil(key_retention * T)));
    k_bucket: Kb, the width of the selected-index output (at least the largest K)."""

    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lengths: torch.Tensor
    key_retention: float
    k_bucket: int
    scale: float | None = None

    def call(self, fn: DenseSource) -> SourceOutputs:
        """``fn`` on these inputs, in the protocol's argument order."""
        return SourceOutputs(
            *fn(
                self.q,
                self.key_cache,
                self.value_cache,
                self.block_tables,
                self.context_lengths,
                self.key_retention,
                self.k_bucket,
                self.scale,
            )
        )


@dataclass(frozen=True)
class CorrectionInputs:
    """Inputs of ``sparse_correction`` (:class:`SparseCorrection`).

    q [R, Hq, D]; key_cache, value_cache [NB, BS, Hkv, D]; block_tables [R, MB] int32;
    indices [R, Hq, Kb] int32 absolute positions in increasing order (-1 in the unused
    slots after them); mass [R, Hq], output and
    contribution [R, Hq, D], FP32 (the loop-2 statistics); scale None: 1 / sqrt(D)."""

    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    indices: torch.Tensor
    mass: torch.Tensor
    output: torch.Tensor
    contribution: torch.Tensor
    scale: float | None = None

    def call(self, fn: SparseCorrection) -> torch.Tensor:
        """``fn`` on these inputs, in the protocol's argument order: [R, Hq, D]."""
        return fn(
            self.q,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.indices,
            self.mass,
            self.output,
            self.contribution,
            self.scale,
        )


@dataclass(frozen=True)
class PackedKV:
    """Where the packed ops read K/V below each row's packed length: layer ``layer`` of the
    packed INT4 ``store`` through ``meta`` (:class:`~flashloop_backend.kv.levels.LevelMetadata`
    of the op's R rows: tables [R, Lv, P], maps [R, Lv, Tp], kinds [R, Lv],
    packed_lengths [R], all int32)."""

    store: PackedKVStore
    layer: int
    meta: LevelMetadata


@dataclass(frozen=True)
class PackedDecodeInputs:
    """Inputs of ``packed_decode`` (:class:`PackedDecode`): ``dense_attention``'s
    :class:`PagedInputs` (the BF16 pages above each row's packed length) plus the packed
    KV below it; ``few_rows`` the protocol's launch hint."""

    kv: PackedKV
    paged: PagedInputs
    few_rows: bool = False

    def call(self, fn: PackedDecode) -> torch.Tensor:
        """``fn`` on these inputs, in the protocol's argument order: [R, Hq, D]."""
        kv, p = self.kv, self.paged
        return fn(
            p.q,
            kv.store,
            kv.layer,
            kv.meta,
            p.key_cache,
            p.value_cache,
            p.block_tables,
            p.context_lengths,
            p.scale,
            self.few_rows,
        )


@dataclass(frozen=True)
class PackedSourceInputs:
    """Inputs of ``packed_dense_source`` (:class:`PackedDenseSource`): ``dense_source``'s
    :class:`SourceInputs` plus the packed KV below each row's packed length."""

    kv: PackedKV
    paged: SourceInputs

    def call(self, fn: PackedDenseSource) -> SourceOutputs:
        """``fn`` on these inputs, in the protocol's argument order."""
        kv, p = self.kv, self.paged
        return SourceOutputs(
            *fn(
                p.q,
                kv.store,
                kv.layer,
                kv.meta,
                p.key_cache,
                p.value_cache,
                p.block_tables,
                p.context_lengths,
                p.key_retention,
                p.k_bucket,
                p.scale,
            )
        )


@dataclass(frozen=True)
class PackedCorrectionInputs:
    """Inputs of ``packed_sparse_correction`` (:class:`PackedSparseCorrection`):
    ``sparse_correction``'s :class:`CorrectionInputs` plus the packed KV below each row's
    packed length."""

    kv: PackedKV
    paged: CorrectionInputs

    def call(self, fn: PackedSparseCorrection) -> torch.Tensor:
        """``fn`` on these inputs, in the protocol's argument order: [R, Hq, D]."""
        kv, p = self.kv, self.paged
        return fn(
            p.q,
            kv.store,
            kv.layer,
            kv.meta,
            p.key_cache,
            p.value_cache,
            p.block_tables,
            p.indices,
            p.mass,
            p.output,
            p.contribution,
            p.scale,
        )


PagedOpInputs: TypeAlias = PagedInputs | SourceInputs | CorrectionInputs
PackedOpInputs: TypeAlias = PackedDecodeInputs | PackedSourceInputs | PackedCorrectionInputs
OpInputs: TypeAlias = PagedOpInputs | PackedOpInputs

# The inputs class each op takes (``packed_kv_write`` has none: it is called directly).
OP_INPUTS: Mapping[OpName, type[OpInputs]] = MappingProxyType(
    {
        OpName.DENSE_ATTENTION: PagedInputs,
        OpName.DENSE_PREFILL: PagedInputs,
        OpName.SPARSE_PREFILL: PagedInputs,
        OpName.DENSE_SOURCE: SourceInputs,
        OpName.SPARSE_CORRECTION: CorrectionInputs,
        OpName.PACKED_DECODE: PackedDecodeInputs,
        OpName.PACKED_SOURCE: PackedSourceInputs,
        OpName.PACKED_CORRECTION: PackedCorrectionInputs,
    }
)
# The op that serves a decode op's rows when KV quantization stores their history packed.
PACKED_VERSION: Mapping[OpName, OpName] = MappingProxyType(
    {
        OpName.DENSE_ATTENTION: OpName.PACKED_DECODE,
        OpName.DENSE_SOURCE: OpName.PACKED_SOURCE,
        OpName.SPARSE_CORRECTION: OpName.PACKED_CORRECTION,
    }
)


def _ops_taking(*kinds: type) -> frozenset[OpName]:
    return frozenset(op for op, inputs in OP_INPUTS.items() if issubclass(inputs, kinds))


# Roles read from the table above: the loop-2 sources (write a reference), the loop 3-4
# corrections (read one), the ops over packed KV, and the ops whose rows of context length
# 0 come out as zeros, so that their output can be a batch's base: the PagedInputs
# contract, and the sources' (such a row selects nothing and attends to nothing).
SOURCE_OPS = _ops_taking(SourceInputs, PackedSourceInputs)
CORRECTION_OPS = _ops_taking(CorrectionInputs, PackedCorrectionInputs)
PACKED_READ_OPS = _ops_taking(PackedDecodeInputs, PackedSourceInputs, PackedCorrectionInputs)
BASE_OUTPUT_OPS = _ops_taking(PagedInputs, PackedDecodeInputs) | SOURCE_OPS

_OVER_PACKED: Mapping[type[PagedOpInputs], type[PackedOpInputs]] = MappingProxyType(
    {
        PagedInputs: PackedDecodeInputs,
        SourceInputs: PackedSourceInputs,
        CorrectionInputs: PackedCorrectionInputs,
    }
)


def over_packed(kv: PackedKV, paged: PagedOpInputs) -> PackedOpInputs:
    """The packed-KV op's inputs for a paged op's ``paged`` inputs: the same arguments, with
    K/V below each row's packed length read from ``kv`` (``packed_decode`` for
    :class:`PagedInputs`, ``packed_dense_source`` for :class:`SourceInputs`,
    ``packed_sparse_correction`` for :class:`CorrectionInputs`)."""
    return _OVER_PACKED[type(paged)](kv, paged)


# ------------------------------------------------------------------ providers


@dataclass(frozen=True)
class KernelImpl:
    """One implementation of one op, with what it supports.

    ``fn`` follows the op's protocol and stays callable with explicit arguments; calling the
    impl itself with the op's inputs object (:data:`OP_INPUTS`) checks the inputs' class
    and calls ``fn`` in the protocol's argument order."""

    op: OpName
    fn: OpFunction
    support: Support

    def __call__(self, inputs: OpInputs) -> torch.Tensor | SourceOutputs:
        expected = OP_INPUTS.get(self.op)
        if expected is None:
            raise TypeError(
                f"op {self.op.value!r} takes no inputs object: call KernelImpl.fn with the "
                "protocol's arguments"
            )
        if not isinstance(inputs, expected):
            raise TypeError(
                f"op {self.op.value!r} takes {expected.__name__}; got {type(inputs).__name__}"
            )
        return inputs.call(self.fn)


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
