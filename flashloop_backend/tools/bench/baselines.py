"""Dense-source designs the package does not select, kept as the baselines ``bench sparse``
times beside the registered ``dense_source_triton`` (``dense_source_designs_ms`` in its
record; results/README.md, "Sparse decode attention per layer call", says what each is and
how it compares):

- ``torch_topk``, :func:`dense_source_torch_topk`: the Triton logits, then one
  ``torch.topk`` over a composite int64 key and a torch gather for the contribution;
- ``split_select``, :func:`dense_source_split`: the exact radix select spread over
  (row, head, split) programs. Every 8-bit digit of an MSB-first radix select is one launch
  whose programs add their 256-bin histogram into a shared one; one more launch counts the
  keys above the K-th and its ties per split, and one compacts in position order at
  per-split offsets.

- ``sorted_bracket``, :func:`dense_source_sorted_bracket`: the design registered before
  the split threshold selection: one program per (row, head) sorts a 4096-key strided
  sample to bracket the K-th key, copies the keys inside the bracket, sorts them for the
  exact threshold (the radix select when the bracket misses) and compacts in position
  order with the contribution from the pages.

All keep the ``DenseSource`` contract (exact top-K, K from ``key_retention_fraction``,
ties to the earlier positions), so the benchmark compares like with like.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flashloop_backend.algorithms import key_retention_fraction
from flashloop_backend.kernels.torch_ref.sparse_decode import selected_counts
from flashloop_backend.kernels.triton.dense_source import (
    check_bucket,
    logits_and_output,
    source_buffers,
)
from flashloop_backend.kernels.triton.paged_decode import next_pow2, sm_count
from flashloop_backend.kernels.triton.select_jit import _order_key, compact_selected
from flashloop_backend.kernels.triton.threshold_select_jit import count_around

LOW32 = 0xFFFFFFFF
DIGIT_COUNT = 4  # 8-bit digits of a 32-bit key
DIGITS = tl.constexpr(DIGIT_COUNT)


# ------------------------------------------------------------------ torch.topk


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
    """``dense_source`` by Triton logits, then ``torch.topk`` over :func:`order_key`
    (indices by descending probability) and a torch gather for the contribution."""
    rows, num_q_heads, _ = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    span = block_tables.shape[1] * block_size
    check_bucket(span, block_tables.shape[0], key_retention, k_bucket)
    logits, lse, output = logits_and_output(
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


# ------------------------------------------------------------------ split radix select


@dataclass(frozen=True)
class SplitTuning:
    """Launch shape of the split selection: about ``programs_per_sm`` programs per SM, at
    most ``max_splits`` splits of a (row, head), each at least ``block`` keys, ``num_warps``
    warps a program."""

    block: int = 1024
    programs_per_sm: int = 8
    max_splits: int = 64
    num_warps: int = 4


DEFAULT_SPLIT = SplitTuning()


@triton.jit
def _selected(hist_row, count, LEVELS: tl.constexpr):
    """(prefix, prefix mask, rank within the prefix's keys) after ``LEVELS`` digits of the
    K-th largest key, read from the shared histograms [DIGITS, 256] of earlier launches.
    After all digits: (the K-th largest key, ties at it to take, full mask)."""
    bins = tl.arange(0, 256)
    prefix = tl.zeros([], tl.uint32)
    prefix_mask = tl.zeros([], tl.uint32)
    remaining = count.to(tl.int32)
    for level in tl.static_range(LEVELS):
        shift = 24 - 8 * level
        hist = tl.load(hist_row + level * 256 + bins)
        at_or_above = tl.cumsum(hist, 0, reverse=True)
        chosen = tl.max(tl.where(at_or_above >= remaining, bins, 0), 0)
        remaining -= tl.sum(tl.where(bins > chosen, hist, 0), 0)
        prefix |= chosen.to(tl.uint32) << shift
        prefix_mask |= tl.full([], 255, tl.uint32) << shift
    return prefix, prefix_mask, remaining


@triton.jit
def _row_setup(
    logits_ptr,
    lengths_ptr,
    hist_ptr,
    ratio_num,
    ratio_den,
    stride_lr,
    stride_lh,
    per_split,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lengths_ptr + row).to(tl.int64)
    count = tl.minimum((length * ratio_num + ratio_den - 1) // ratio_den, length)
    hist_row = hist_ptr + (row * tl.num_programs(1) + head) * (DIGITS * 256)
    logits_row = logits_ptr + row * stride_lr + head * stride_lh
    first = split * per_split
    last = tl.minimum(first + per_split, length)
    return row, head, split, length, count, hist_row, logits_row, first, last


@triton.jit
def select_digit_kernel(
    logits_ptr,
    lengths_ptr,
    hist_ptr,
    ratio_num,
    ratio_den,
    stride_lr,
    stride_lh,
    per_split,
    LEVEL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One (row, head, split): histogram of digit ``LEVEL`` over its keys that share the
    prefix chosen so far, added into the (row, head)'s shared histogram."""
    _, _, _, _, count, hist_row, logits_row, first, last = _row_setup(
        logits_ptr, lengths_ptr, hist_ptr, ratio_num, ratio_den, stride_lr, stride_lh, per_split
    )
    prefix, prefix_mask, _ = _selected(hist_row, count, LEVEL)
    shift = 24 - 8 * LEVEL
    offs = tl.arange(0, BLOCK)
    local = tl.zeros([256], tl.int32)
    for start in range(first, last, BLOCK):
        pos = start + offs
        visible = pos < last
        key = _order_key(tl.load(logits_row + pos, mask=visible, other=0.0))
        match = visible & ((key & prefix_mask) == prefix)
        local += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
    bins = tl.arange(0, 256)
    tl.atomic_add(hist_row + LEVEL * 256 + bins, local, mask=local > 0)


@triton.jit
def select_count_kernel(
    logits_ptr,
    lengths_ptr,
    hist_ptr,
    counts_ptr,
    ratio_num,
    ratio_den,
    stride_lr,
    stride_lh,
    per_split,
    BLOCK: tl.constexpr,
):
    """One (row, head, split): its keys above the K-th largest and its ties at it, into
    counts [R, Hq, S, 2]."""
    row, head, split, _, count, hist_row, logits_row, first, last = _row_setup(
        logits_ptr, lengths_ptr, hist_ptr, ratio_num, ratio_den, stride_lr, stride_lh, per_split
    )
    threshold, _, _ = _selected(hist_row, count, DIGITS)
    greater, ties = count_around(logits_row, first, last, threshold, BLOCK)
    at = counts_ptr + ((row * tl.num_programs(1) + head) * tl.num_programs(2) + split) * 2
    tl.store(at, greater)
    tl.store(at + 1, ties)


@triton.jit
def select_compact_kernel(
    logits_ptr,
    lse_ptr,
    lengths_ptr,
    hist_ptr,
    counts_ptr,
    v_ptr,
    tables_ptr,
    output_ptr,
    out_ptr,
    idx_ptr,
    mass_parts_ptr,
    contrib_parts_ptr,
    ratio_num,
    ratio_den,
    stride_lr,
    stride_lh,
    stride_er,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_tr,
    stride_or,
    stride_oh,
    stride_qr,
    stride_qh,
    stride_ir,
    stride_ih,
    per_split,
    bucket,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    CONTRIBUTE: tl.constexpr,
):
    """One (row, head, split): writes its selected positions at the offset the earlier
    splits leave (ties to the earlier positions across splits), its share of the mass and
    contribution into [R, Hq, S] / [R, Hq, S, D] parts, and -1 over its share of [K, Kb)."""
    row, head, split, _, count, hist_row, logits_row, first, last = _row_setup(
        logits_ptr, lengths_ptr, hist_ptr, ratio_num, ratio_den, stride_lr, stride_lh, per_split
    )
    threshold, _, remaining = _selected(hist_row, count, DIGITS)
    splits = tl.num_programs(2)
    s = tl.arange(0, SPLITS_PAD)
    at = counts_ptr + (row * tl.num_programs(1) + head) * splits * 2
    greater_each = tl.load(at + 2 * s, mask=s < splits, other=0)
    ties_each = tl.load(at + 2 * s + 1, mask=s < splits, other=0)
    ties_before_each = tl.cumsum(ties_each, 0) - ties_each
    taken_ties_each = tl.minimum(tl.maximum(remaining - ties_before_each, 0), ties_each)
    earlier = s < split
    written = tl.sum(tl.where(earlier, greater_each + taken_ties_each, 0), 0)
    ties_seen = tl.sum(tl.where(earlier, ties_each, 0), 0)
    lse = tl.load(lse_ptr + row * stride_er + head)
    kv_head = head // GROUP
    offs = tl.arange(0, BLOCK)
    d = tl.arange(0, HEAD_DIM)
    mass, contribution = compact_selected(
        logits_row,
        idx_ptr + row * stride_ir + head * stride_ih,
        first,
        last,
        threshold,
        remaining,
        written,
        ties_seen,
        lse,
        v_ptr + kv_head * stride_vh,
        tables_ptr + row * stride_tr,
        stride_vb,
        stride_vt,
        HEAD_DIM,
        BLOCK,
        BLOCK_SIZE,
        CONTRIBUTE,
    )
    part = (row * tl.num_programs(1) + head) * splits + split
    tl.store(mass_parts_ptr + part, mass)
    tl.store(contrib_parts_ptr + part * HEAD_DIM + d, contribution)
    # -1 past K: this split's share of [count, bucket)
    share = tl.cdiv(bucket - count, splits)
    for start in range(
        count + split * share, tl.minimum(count + (split + 1) * share, bucket), BLOCK
    ):
        pos = start + offs
        tl.store(
            idx_ptr + row * stride_ir + head * stride_ih + pos,
            -1,
            mask=pos < tl.minimum(count + (split + 1) * share, bucket),
        )
    if split == 0:
        dense = tl.load(output_ptr + row * stride_or + head * stride_oh + d)
        tl.store(
            out_ptr + row * stride_qr + head * stride_qh + d, dense.to(out_ptr.dtype.element_ty)
        )


def launch_split_selection(
    logits: torch.Tensor,
    lse: torch.Tensor,
    context_lengths: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    output: torch.Tensor,
    out: torch.Tensor,
    indices: torch.Tensor,
    mass: torch.Tensor,
    contribution: torch.Tensor,
    key_retention: float,
    tuning: SplitTuning = DEFAULT_SPLIT,
    contribute: bool = True,
) -> None:
    """``dense_source.launch_selection``'s result from (row, head, split) programs: one
    launch per 8-bit digit into shared histograms, one to count, one to compact in position
    order; the splits' mass and contribution are summed afterwards (deterministic)."""
    rows, num_q_heads, k_bucket = indices.shape
    _, block_size, num_kv_heads, head_dim = value_cache.shape
    span = logits.shape[-1]
    want = math.ceil(tuning.programs_per_sm * sm_count(logits.device) / max(1, rows * num_q_heads))
    splits = max(1, min(tuning.max_splits, want, math.ceil(span / tuning.block)))
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
        select_digit_kernel[grid](
            logits,
            context_lengths,
            hist,
            *common,
            LEVEL=level,
            BLOCK=tuning.block,
            num_warps=tuning.num_warps,
        )
    select_count_kernel[grid](
        logits,
        context_lengths,
        hist,
        counts,
        *common,
        BLOCK=tuning.block,
        num_warps=tuning.num_warps,
    )
    select_compact_kernel[grid](
        logits,
        lse,
        context_lengths,
        hist,
        counts,
        value_cache,
        block_tables,
        output,
        out,
        indices,
        mass_parts,
        contrib_parts,
        key_retention_num,
        key_retention_den,
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
        per_split,
        k_bucket,
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK=tuning.block,
        SPLITS_PAD=next_pow2(splits),
        CONTRIBUTE=contribute,
        num_warps=tuning.num_warps,
    )
    torch.sum(mass_parts, dim=2, out=mass)
    if contribute:
        torch.sum(contrib_parts, dim=2, out=contribution)


def dense_source_split(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    key_retention: float,
    k_bucket: int,
    scale: float | None = None,
    tuning: SplitTuning = DEFAULT_SPLIT,
) -> tuple[torch.Tensor, ...]:
    """``dense_source_triton``'s outputs with the selection by :func:`launch_split_selection`
    (indices in position order, -1 past K)."""
    logits, lse, block_tables, outputs = source_buffers(
        q, key_cache, value_cache, block_tables, context_lengths, key_retention, k_bucket, scale
    )
    out, indices, mass, output, contribution = outputs
    if q.shape[0] == 0:
        return outputs
    launch_split_selection(
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
    return out, indices, mass, output, contribution


# ------------------------------------------------------------------ sorted bracket


@dataclass(frozen=True)
class SortedTuning:
    """``select_statistics_kernel``'s shape: sample, candidate scratch, scan block, radix
    digit bits and warps, one program per (row, head)."""

    sample: int = 4096
    candidates: int = 4096
    block: int = 1024
    radix_bits: int = 8
    num_warps: int = 8


def dense_source_sorted_bracket(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    key_retention: float,
    k_bucket: int,
    scale: float | None = None,
    tuning: SortedTuning = SortedTuning(),
) -> tuple[torch.Tensor, ...]:
    """``dense_source_triton``'s outputs with the selection by one sorting program per
    (row, head) (``select_jit.select_statistics_kernel``)."""
    from flashloop_backend.kernels.triton.select_jit import select_statistics_kernel

    logits, lse, block_tables, outputs = source_buffers(
        q, key_cache, value_cache, block_tables, context_lengths, key_retention, k_bucket, scale
    )
    out, indices, mass, output, contribution = outputs
    rows, heads, _ = q.shape
    _, block_size, num_kv_heads, head_dim = value_cache.shape
    scratch = torch.empty((rows, heads, tuning.candidates), dtype=torch.int32, device=q.device)
    if rows == 0:
        return outputs
    select_statistics_kernel[(rows, heads)](
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
        GROUP=heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK=tuning.block,
        RADIX_BITS=tuning.radix_bits,
        SAMPLE=tuning.sample,
        CANDIDATES=tuning.candidates,
        CONTRIBUTE=True,
        num_warps=tuning.num_warps,
    )
    return out, indices, mass, output, contribution
