"""Loop-2 dense source with selection statistics (the ``DenseSource`` contract, ``ops.py``).

The Triton paged attention reads the keys only and writes every visible key's scaled
logit once plus the natural-log LSE; ``select_top_keys`` (``threshold_select.py``) then
finds each (row, head)'s exact top-K over order-preserving keys (ties to the earlier
position) in split programs, writes the indices in position order with their mass, and
one pass over the values sums the dense output and the contribution together. No sort,
no host sync.
"""

from __future__ import annotations

import torch

from flashloop_backend.algorithms import key_retention_fraction
from flashloop_backend.kernels.triton.paged_decode import paged_attention_triton
from flashloop_backend.kernels.triton.threshold_select import (
    DEFAULT_SELECT,
    SelectTuning,
    select_top_keys,
    source_outputs,
)

__all__ = [
    "DEFAULT_SELECT",
    "SelectTuning",
    "check_bucket",
    "dense_source_triton",
    "source_buffers",
]


def check_bucket(span: int, rows: int, key_retention: float, k_bucket: int) -> None:
    """``k_bucket`` must hold the keys ``key_retention`` selects from ``span`` positions."""
    num, den = key_retention_fraction(key_retention)
    need = min(span, -(-span * num // den))
    if rows and k_bucket < need:
        raise ValueError(f"k_bucket={k_bucket} cannot hold the {need} keys selected from {span}")


def logits_and_output(
    q, key_cache, value_cache, block_tables, context_lengths, scale, span, read_values=True
):
    """(logits [R, Hq, span] FP32 with every visible key's scaled logit, LSE [R, Hq] FP32,
    dense output [R, Hq, D] FP32) from one ``paged_attention_triton`` pass (without
    ``read_values`` the keys only: the output is zeros)."""
    rows, num_q_heads, _ = q.shape
    logits = torch.empty((rows, num_q_heads, span), device=q.device, dtype=torch.float32)
    lse = torch.empty((rows, num_q_heads), device=q.device, dtype=torch.float32)
    output = paged_attention_triton(
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lengths,
        scale,
        logits=logits,
        lse=lse,
        out_dtype=torch.float32,
        read_values=read_values,
    )
    return logits, lse, output


def source_buffers(
    q,
    key_cache,
    value_cache,
    block_tables,
    context_lengths,
    key_retention,
    k_bucket,
    scale=None,
    read_values=True,
):
    """What a source's selection reads and writes: (logits [R, Hq, T], lse [R, Hq],
    contiguous block tables, (out, indices [R, Hq, Kb], mass, output, contribution)), the
    logits, LSE and dense output (zeros without ``read_values``) from one Triton attention
    pass; the bucket checked against the span."""
    span = block_tables.shape[1] * key_cache.shape[1]
    check_bucket(span, block_tables.shape[0], key_retention, k_bucket)
    logits, lse, output = logits_and_output(
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lengths,
        scale,
        span,
        read_values=read_values,
    )
    outputs = source_outputs(q, k_bucket, output)
    return logits, lse, block_tables.contiguous(), outputs


def dense_source_triton(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    key_retention: float,
    k_bucket: int,
    scale: float | None = None,
    tuning: SelectTuning = DEFAULT_SELECT,
) -> tuple[torch.Tensor, ...]:
    """(out [R, Hq, D] q.dtype, indices [R, Hq, Kb] int32 in position order (-1 past K),
    mass [R, Hq], output [R, Hq, D], contribution [R, Hq, D]; the last three FP32), with
    K = max(1, ceil(key_retention * T)) and Kb = ``k_bucket``.

    Paged inputs as ``paged_attention_triton``; each key and value is read once: the keys
    by the attention pass, the values by the selection's value pass."""
    logits, lse, block_tables, outputs = source_buffers(
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lengths,
        key_retention,
        k_bucket,
        scale,
        read_values=False,
    )
    out, indices, mass, output, contribution = outputs
    select_top_keys(
        logits,
        lse,
        context_lengths,
        value_cache,
        block_tables,
        output,
        out,
        indices,
        mass,
        contribution,
        key_retention,
        tuning,
    )
    return outputs
