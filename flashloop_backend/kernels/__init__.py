"""Kernel ops, providers and implementations (torch reference, Triton, FlashInfer)."""

from flashloop_backend.kernels.op_inputs import (
    OP_INPUTS,
    CorrectionInputs,
    OpInputs,
    PackedCorrectionInputs,
    PackedDecodeInputs,
    PackedKV,
    PackedSourceInputs,
    PagedInputs,
    SourceInputs,
    over_packed,
)
from flashloop_backend.kernels.op_protocols import (
    DenseSource,
    OpName,
    PackedDecode,
    PackedDenseSource,
    PackedKVWrite,
    PackedSparseCorrection,
    PagedAttention,
    SourceOutputs,
    SparseCorrection,
    StatisticsStream,
)
from flashloop_backend.kernels.ops import KernelImpl, KernelProvider

__all__ = [
    "OP_INPUTS",
    "CorrectionInputs",
    "DenseSource",
    "KernelImpl",
    "KernelProvider",
    "OpInputs",
    "OpName",
    "PackedCorrectionInputs",
    "PackedDecode",
    "PackedDecodeInputs",
    "PackedDenseSource",
    "PackedKV",
    "PackedKVWrite",
    "PackedSourceInputs",
    "PackedSparseCorrection",
    "PagedAttention",
    "PagedInputs",
    "SourceInputs",
    "SourceOutputs",
    "SparseCorrection",
    "StatisticsStream",
    "over_packed",
]
