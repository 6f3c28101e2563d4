"""The typed inputs the backend passes to each op (one frozen object per op,
:data:`OP_INPUTS`), so no call site assembles a positional tuple; each calls an
implementation in its protocol's argument order (``kernels/op_protocols.py``). Also the
op sets the dispatcher reads: which ops have a packed version, take a loop-2 source's
outputs, read packed KV, or give the batch's base output.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, TypeAlias

import torch

from flashloop_backend.kernels.op_protocols import (
    DenseSource,
    OpName,
    PackedDecode,
    PackedDenseSource,
    PackedSparseCorrection,
    PagedAttention,
    SourceOutputs,
    SparseCorrection,
)
from flashloop_backend.kernels.validate import check_paired

if TYPE_CHECKING:
    from flashloop_backend.kernels.sequence_plan import SequencePlan
    from flashloop_backend.kernels.span_plan import SpanPlan
    from flashloop_backend.kv.levels import LevelMetadata
    from flashloop_backend.kv.store import PackedKVStore


@dataclass(frozen=True)
class PagedInputs:
    """Inputs of ``dense_attention``, ``dense_prefill`` and ``sparse_prefill``
    (:class:`PagedAttention`).

    q [R, Hq, D]; key_cache, value_cache [NB, BS, Hkv, D]; block_tables [R, MB] int32;
    context_lengths [R] int32 (0: a padding row, output zero); scale None: 1 / sqrt(D).
    row_spans [R] int32 (``dense_attention`` of an implementation declaring
    ``grouped_verify_rows``): rows r .. r + row_spans[r] - 1 form one verification group
    sharing row r's table, at most ``max_span`` rows; 0 for a row inside an earlier group.
    The output is the same; the implementation may read the group's keys once.
    sequence_plan (an implementation declaring ``host_sequence_plan``): the host's
    :class:`SequencePlan` of these rows' tables and lengths, which the implementation plans
    from in place of reading them back from the device; the same object at every layer of
    a traversal. span_plan (a ``sparse_prefill`` implementation declaring
    ``span_prefill``): the host's :class:`SpanPlan` of the rows, likewise."""

    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lengths: torch.Tensor
    scale: float | None = None
    row_spans: torch.Tensor | None = None
    max_span: int = 1
    sequence_plan: SequencePlan | None = None
    span_plan: SpanPlan | None = None

    def call(self, fn: PagedAttention) -> torch.Tensor:
        """``fn`` on these inputs, in the protocol's argument order: [R, Hq, D]."""
        paged = (self.q, self.key_cache, self.value_cache, self.block_tables, self.context_lengths)
        extra: dict = {}
        if self.row_spans is not None:
            extra |= {"row_spans": self.row_spans, "max_span": self.max_span}
        if self.sequence_plan is not None:
            extra["sequence_plan"] = self.sequence_plan
        if self.span_plan is not None:
            extra["span_plan"] = self.span_plan
        return fn(*paged, self.scale, **extra)


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
    contribution [R, Hq, D], FP32 (the loop-2 statistics); scale None: 1 / sqrt(D).
    base [R, Hq, D] and serves [R] bool, both or neither (an implementation declaring
    ``correction_into_base``): the rows where serves holds are written into base, which
    the op returns."""

    q: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    indices: torch.Tensor
    mass: torch.Tensor
    output: torch.Tensor
    contribution: torch.Tensor
    scale: float | None = None
    base: torch.Tensor | None = None
    serves: torch.Tensor | None = None

    def __post_init__(self) -> None:
        check_paired(self.base, self.serves)

    def base_keywords(self) -> dict[str, torch.Tensor]:
        """The keywords that write into ``base`` (none without it)."""
        return {} if self.base is None else {"base": self.base, "serves": self.serves}

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
            **self.base_keywords(),
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
    :class:`SourceInputs` plus the packed KV below each row's packed length;
    ``statistics_stream`` (an implementation declaring ``statistics_stream`` only) the
    stream it may write its selection statistics on (:class:`StatisticsStream`)."""

    kv: PackedKV
    paged: SourceInputs
    statistics_stream: torch.cuda.Stream | None = None

    def call(self, fn: PackedDenseSource) -> SourceOutputs:
        """``fn`` on these inputs, in the protocol's argument order."""
        kv, p = self.kv, self.paged
        extra = (
            {} if self.statistics_stream is None else {"statistics_stream": self.statistics_stream}
        )
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
                **extra,
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
            **p.base_keywords(),
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


def into_base(
    inputs: CorrectionInputs | PackedCorrectionInputs, base: torch.Tensor, serves: torch.Tensor
) -> CorrectionInputs | PackedCorrectionInputs:
    """A correction's ``inputs`` that write the rows where ``serves`` [R] bool holds into
    ``base`` [R, Hq, D] (the capability ``correction_into_base``)."""
    if isinstance(inputs, PackedCorrectionInputs):
        return replace(inputs, paged=replace(inputs.paged, base=base, serves=serves))
    return replace(inputs, base=base, serves=serves)


def over_packed(kv: PackedKV, paged: PagedOpInputs) -> PackedOpInputs:
    """The packed-KV op's inputs for a paged op's ``paged`` inputs: the same arguments, with
    K/V below each row's packed length read from ``kv`` (``packed_decode`` for
    :class:`PagedInputs`, ``packed_dense_source`` for :class:`SourceInputs`,
    ``packed_sparse_correction`` for :class:`CorrectionInputs`)."""
    return _OVER_PACKED[type(paged)](kv, paged)
