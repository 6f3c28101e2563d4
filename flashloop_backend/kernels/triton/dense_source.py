"""Loop-2 dense source with selection statistics (the ``DenseSource`` contract, ``ops.py``).

The Triton paged attention writes every visible key's scaled logit once plus the
natural-log LSE; ``select_statistics_kernel`` then finds each (row, head)'s exact top-K
over order-preserving keys (ties to the earlier position): a strided sample brackets the
K-th key and a sort of the keys inside the bracket gives it, with an exact radix select
when the bracket misses. It writes the indices in position order with their mass and
contribution. No full sort, no host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashloop_backend.algorithms import key_retention_fraction
from flashloop_backend.kernels.triton.paged_decode import paged_attention_triton


@dataclass(frozen=True)
class SelectTuning:
    """Selection kernel shape: the strided sample that brackets the K-th key, the scratch
    for keys inside the bracket (a miss or overflow falls back to the exact radix select,
    ``radix_bits`` per pass), ``block`` keys per step, ``num_warps`` warps. One program
    per (row, head): at batch 16 these programs already fill the GPU, and spreading a row
    over split programs costs more in launches and shared-histogram atomics than the
    spread saves (``split_select`` in results/bench_sparse_decode.json; results/README.md,
    "Sparse decode attention per layer call")."""

    sample: int = 4096
    candidates: int = 4096
    block: int = 1024
    radix_bits: int = 8
    num_warps: int = 8


DEFAULT_SELECT = SelectTuning()


def check_bucket(span: int, rows: int, key_retention: float, k_bucket: int) -> None:
    """``k_bucket`` must hold the keys ``key_retention`` selects from ``span`` positions."""
    num, den = key_retention_fraction(key_retention)
    need = min(span, -(-span * num // den))
    if rows and k_bucket < need:
        raise ValueError(f"k_bucket={k_bucket} cannot hold the {need} keys selected from {span}")


def logits_and_output(q, key_cache, value_cache, block_tables, context_lengths, scale, span):
    """(logits [R, Hq, span] FP32 with every visible key's scaled logit, LSE [R, Hq] FP32,
    dense output [R, Hq, D] FP32) from one ``paged_attention_triton`` pass."""
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
    )
    return logits, lse, output


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

    Paged inputs as ``paged_attention_triton``; the value cache is read again only at the
    selected positions."""
    block_size = key_cache.shape[1]
    span = block_tables.shape[1] * block_size
    check_bucket(span, block_tables.shape[0], key_retention, k_bucket)
    logits, lse, output = logits_and_output(
        q, key_cache, value_cache, block_tables, context_lengths, scale, span
    )
    rows, num_q_heads, _ = q.shape
    block_tables = block_tables.contiguous()
    out = torch.empty_like(q)
    indices = torch.empty((rows, num_q_heads, k_bucket), dtype=torch.int32, device=q.device)
    mass = torch.empty((rows, num_q_heads), dtype=torch.float32, device=q.device)
    contribution = torch.empty_like(output)
    scratch = torch.empty(
        (rows, num_q_heads, tuning.candidates), dtype=torch.int32, device=q.device
    )
    if rows == 0:
        return out, indices, mass, output, contribution
    launch_selection(
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
        scratch,
        key_retention,
        tuning,
        contribute=True,
    )
    return out, indices, mass, output, contribution


def launch_selection(
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
    scratch,
    key_retention: float,
    tuning: SelectTuning,
    contribute: bool,
) -> None:
    """The top-K selection (K = max(1, ceil(key_retention * T))) over ``logits`` [R, Hq, T]
    / ``lse`` [R, Hq]: writes ``indices`` [R, Hq, Kb], ``mass`` [R, Hq], ``out`` [R, Hq, D]
    (``output`` [R, Hq, D] FP32 in q's dtype) and, if ``contribute``, ``contribution``
    [R, Hq, D] from the value cache (packed KV sums it itself: its values are not in
    pages)."""
    from flashloop_backend.kernels.triton.select_jit import select_statistics_kernel

    rows, num_q_heads, k_bucket = indices.shape
    _, block_size, num_kv_heads, head_dim = value_cache.shape
    select_statistics_kernel[(rows, num_q_heads)](
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
        scratch,
        *key_retention_fraction(key_retention),
        logits.stride(0),
        logits.stride(1),
        lse.stride(0),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        output.stride(0),
        output.stride(1),
        out.stride(0),
        out.stride(1),
        indices.stride(0),
        indices.stride(1),
        mass.stride(0),
        contribution.stride(0),
        contribution.stride(1),
        k_bucket,
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK=tuning.block,
        RADIX_BITS=tuning.radix_bits,
        SAMPLE=tuning.sample,
        CANDIDATES=tuning.candidates,
        CONTRIBUTE=contribute,
        num_warps=tuning.num_warps,
    )
