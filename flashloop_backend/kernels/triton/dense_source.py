"""Loop-2 dense source with selection statistics (the ``DenseSource`` contract, ``ops.py``).

The Triton paged attention writes every visible key's scaled logit once plus the
natural-log LSE; ``select_statistics_kernel`` then finds each (row, head)'s exact top-K by
radix select over order-preserving keys (ties to the earlier position) and writes the
indices in position order with their mass and contribution. No full sort, no host sync.

``dense_source_torch_topk`` is the first design (one ``torch.topk`` over a composite
int64 key); the benchmark keeps timing it beside the radix-select kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashloop_backend.algorithms import key_retention_fraction
from flashloop_backend.kernels.torch_ref.sparse_decode import selected_counts
from flashloop_backend.kernels.triton.paged_decode import (
    next_pow2,
    paged_attention_triton,
    sm_count,
)

LOW32 = 0xFFFFFFFF


@dataclass(frozen=True)
class SelectTuning:
    """Selection kernel shape: the strided sample that brackets the K-th key, the scratch
    for keys inside the bracket (a miss or overflow falls back to an exact radix select).
    Rows spanning ``split_min_span`` keys or more use the split design instead
    (``select_split_jit.py``): about ``split_programs_per_sm`` programs per SM, at most
    ``split_max`` splits of a (row, head), each at least ``block`` keys. Off: on the H200
    it was 1.3-4.8x slower than the bracket design at 8K / 32K x 1 / 16
    (``results/bench_sparse_decode.json``, ``split_select``)."""

    sample: int = 4096
    candidates: int = 4096
    block: int = 1024
    radix_bits: int = 8
    num_warps: int = 8
    split_min_span: int = 2**62
    split_programs_per_sm: int = 8
    split_max: int = 64
    split_num_warps: int = 4


DEFAULT_SELECT = SelectTuning()


def check_bucket(span: int, rows: int, key_retention: float, k_bucket: int) -> None:
    """``k_bucket`` must hold the keys ``key_retention`` selects from ``span`` positions."""
    num, den = key_retention_fraction(key_retention)
    need = min(span, -(-span * num // den))
    if rows and k_bucket < need:
        raise ValueError(f"k_bucket={k_bucket} cannot hold the {need} keys selected from {span}")


def _logits_and_output(q, key_cache, value_cache, block_tables, context_lengths, scale, span):
    rows, num_q_heads, _ = q.shape
    logits = torch.empty((rows, num_q_heads, span), device=q.device, dtype=torch.float32)
    lse = torch.empty((rows, num_q_heads), device=q.device, dtype=torch.float32)
    output = paged_attention_triton(q, key_cache, value_cache, block_tables, context_lengths, scale,
                                    logits=logits, lse=lse, out_dtype=torch.float32)  # fmt: skip
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
    logits, lse, output = _logits_and_output(
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
    launch_selection(logits, lse, context_lengths, value_cache, block_tables, output, out,
                     indices, mass, contribution, scratch, key_retention, tuning,
                     contribute=True)  # fmt: skip
    return out, indices, mass, output, contribution


def launch_selection(logits, lse, context_lengths, value_cache, block_tables, output, out, indices,
                     mass, contribution, scratch, key_retention: float, tuning: SelectTuning,
                     contribute: bool) -> None:  # fmt: skip
    """The top-K selection (K = max(1, ceil(key_retention * T))) over ``logits`` [R, Hq, T]
    / ``lse`` [R, Hq]: writes ``indices`` [R, Hq, Kb], ``mass`` [R, Hq], ``out`` [R, Hq, D]
    (``output`` [R, Hq, D] FP32 in q's dtype) and, if ``contribute``, ``contribution``
    [R, Hq, D] from the value cache (packed KV sums it itself: its values are not in
    pages)."""
    from flashloop_backend.kernels.triton.select_jit import select_statistics_kernel

    rows, num_q_heads, k_bucket = indices.shape
    _, block_size, num_kv_heads, head_dim = value_cache.shape
    if logits.shape[-1] >= tuning.split_min_span:
        launch_split_selection(logits, lse, context_lengths, value_cache, block_tables, output,
                               out, indices, mass, contribution, key_retention, tuning,
                               contribute)  # fmt: skip
        return
    select_statistics_kernel[(rows, num_q_heads)](
        logits, lse, context_lengths, value_cache, block_tables, output,
        out, indices, mass, contribution, scratch,
        *key_retention_fraction(key_retention),
        logits.stride(0), logits.stride(1),
        lse.stride(0),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0),
        output.stride(0), output.stride(1),
        out.stride(0), out.stride(1),
        indices.stride(0), indices.stride(1),
        mass.stride(0),
        contribution.stride(0), contribution.stride(1),
        k_bucket,
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK=tuning.block, RADIX_BITS=tuning.radix_bits, SAMPLE=tuning.sample,
        CANDIDATES=tuning.candidates, CONTRIBUTE=contribute, num_warps=tuning.num_warps,
    )  # fmt: skip


def launch_split_selection(logits, lse, context_lengths, value_cache, block_tables, output, out,
                           indices, mass, contribution, key_retention: float,
                           tuning: SelectTuning, contribute: bool) -> None:  # fmt: skip
    """:func:`launch_selection`'s result from (row, head, split) programs: one launch per
    8-bit digit into shared histograms, one to count, one to compact in position order;
    the splits' mass and contribution are summed afterwards (deterministic)."""
    from flashloop_backend.kernels.triton.select_split_jit import (
        DIGIT_COUNT,
        select_compact_kernel,
        select_count_kernel,
        select_digit_kernel,
    )

    rows, num_q_heads, k_bucket = indices.shape
    _, block_size, num_kv_heads, head_dim = value_cache.shape
    span = logits.shape[-1]
    want = math.ceil(
        tuning.split_programs_per_sm * sm_count(logits.device) / max(1, rows * num_q_heads)
    )
    splits = max(1, min(tuning.split_max, want, math.ceil(span / tuning.block)))
    per_split = math.ceil(span / splits)
    device = logits.device
    hist = torch.zeros((rows, num_q_heads, DIGIT_COUNT, 256), dtype=torch.int32, device=device)
    counts = torch.empty((rows, num_q_heads, splits, 2), dtype=torch.int32, device=device)
    mass_parts = torch.empty((rows, num_q_heads, splits), dtype=torch.float32, device=device)
    contrib_parts = torch.empty(
        (rows, num_q_heads, splits, head_dim), dtype=torch.float32, device=device
    )
    key_retention_num, key_retention_den = key_retention_fraction(key_retention)
    grid = (rows, num_q_heads, splits)
    common = (key_retention_num, key_retention_den, logits.stride(0), logits.stride(1), per_split)
    for level in range(DIGIT_COUNT):
        select_digit_kernel[grid](logits, context_lengths, hist, *common, LEVEL=level,
                                  BLOCK=tuning.block, num_warps=tuning.split_num_warps)  # fmt: skip
    select_count_kernel[grid](logits, context_lengths, hist, counts, *common, BLOCK=tuning.block,
                              num_warps=tuning.split_num_warps)  # fmt: skip
    select_compact_kernel[grid](
        logits, lse, context_lengths, hist, counts, value_cache, block_tables, output,
        out, indices, mass_parts, contrib_parts,
        key_retention_num, key_retention_den,
        logits.stride(0), logits.stride(1), lse.stride(0),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        output.stride(0), output.stride(1), out.stride(0), out.stride(1),
        indices.stride(0), indices.stride(1),
        per_split, k_bucket,
        GROUP=num_q_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK=tuning.block, SPLITS_PAD=next_pow2(splits), CONTRIBUTE=contribute,
        num_warps=tuning.split_num_warps,
    )  # fmt: skip
    torch.sum(mass_parts, dim=2, out=mass)
    if contribute:
        torch.sum(contrib_parts, dim=2, out=contribution)


def order_key(logits: torch.Tensor) -> torch.Tensor:
    """int64 keys whose order is (logit descending, position ascending) under ``topk``.
    FP32 bit patterns map to signed ints with the same order (negative values flip their
    magnitude bits); the low 32 bits hold the inverted position."""
    bits = logits.contiguous().view(torch.int32).long()
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    positions = torch.arange(logits.shape[-1], device=logits.device)
    return (ordered << 32) | (LOW32 - positions)


def dense_source_torch_topk(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    key_retention: float,
    k_bucket: int,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """First design: Triton logits, then ``torch.topk`` over :func:`order_key` (indices by
    descending probability) and a torch gather for the contribution."""
    rows, num_q_heads, _ = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    span = block_tables.shape[1] * block_size
    check_bucket(span, block_tables.shape[0], key_retention, k_bucket)
    logits, lse, output = _logits_and_output(
        q, key_cache, value_cache, block_tables, context_lengths, scale, span
    )
    visible = torch.arange(span, device=q.device)[None, None, :] < context_lengths[:, None, None]
    logits = torch.where(visible, logits, float("-inf"))
    width = min(k_bucket, span)
    top = torch.topk(order_key(logits), width, dim=-1, sorted=True).indices  # [R, Hq, width]
    valid = (
        torch.arange(width, device=q.device)[None, None, :]
        < selected_counts(context_lengths, key_retention)[:, None, None]
    )
    chosen = torch.where(valid, torch.exp(torch.gather(logits, 2, top) - lse[..., None]), 0.0)
    page_col = (top // block_size).reshape(rows, -1)
    blocks = torch.gather(block_tables.long().clamp(min=0), 1, page_col).reshape(top.shape)
    kv_head = (torch.arange(num_q_heads, device=q.device) // (num_q_heads // num_kv_heads))[
        None, :, None
    ]
    values = value_cache[
        blocks.clamp(max=value_cache.shape[0] - 1), top % block_size, kv_head
    ].float()
    contribution = torch.einsum("rhk,rhkd->rhd", chosen, values)
    indices = torch.full((rows, num_q_heads, k_bucket), -1, dtype=torch.int32, device=q.device)
    indices[..., :width] = torch.where(valid, top, -1).to(torch.int32)
    return output.to(q.dtype), indices, chosen.sum(-1), output, contribution
