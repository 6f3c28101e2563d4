"""The FlashLoop algorithm references (CPU and GPU), written for clarity: the oracles the
kernels are tested against. A leaf: it imports nothing else of the package."""

from flashloop_backend.algorithms.int4 import (
    CompactChain,
    QuantizedInt4,
    dequantize_int4,
    encode_compact_chain,
    encode_residual_chain,
    quantize_int4,
    reconstruct,
    reconstruct_compact,
    unpack_codes,
)
from flashloop_backend.algorithms.sparse_decode import (
    SparseReferenceState,
    key_retention_fraction,
    selected_count,
    sparse_correct,
    sparse_reference_state,
)
from flashloop_backend.algorithms.token_selection import (
    retention_budget,
    select_in_windows,
    select_tokens,
    token_change_scores,
    window_budgets,
)

__all__ = [
    "CompactChain",
    "QuantizedInt4",
    "SparseReferenceState",
    "dequantize_int4",
    "encode_compact_chain",
    "encode_residual_chain",
    "key_retention_fraction",
    "quantize_int4",
    "reconstruct",
    "reconstruct_compact",
    "retention_budget",
    "select_in_windows",
    "select_tokens",
    "selected_count",
    "sparse_correct",
    "sparse_reference_state",
    "token_change_scores",
    "unpack_codes",
    "window_budgets",
]
