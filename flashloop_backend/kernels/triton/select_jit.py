"""Triton code for the loop-2 selection statistics (wrapper in ``dense_source.py``)."""

import triton
import triton.language as tl

from flashloop_backend.kernels.triton.specialization import BLOCK_TABLE_ROWS, SCALAR_PER_ROW


@triton.jit
def _order_key(logit):
    """FP32 -> uint32 with the same order (larger logit, larger key); -0.0 is +0.0, as
    torch compares them."""
    logit = tl.where(logit == 0.0, 0.0, logit)
    bits = logit.to(tl.int32, bitcast=True)
    raw = logit.to(tl.uint32, bitcast=True)
    return tl.where(bits >= 0, raw | 0x80000000, raw ^ 0xFFFFFFFF)


@triton.jit
def take_selected(key, visible, threshold, remaining, ties_seen, AXIS: tl.constexpr):
    """The selection's rule over order keys laid out in position order along AXIS: every
    visible key above ``threshold`` and the ties at it whose rank (after ``ties_seen``
    earlier ones) is below ``remaining`` (threshold, remaining and ties_seen broadcast
    against ``key``). Returns (taken mask, ties counted along AXIS)."""
    tie = visible & (key == threshold)
    tie_rank = ties_seen + tl.cumsum(tie.to(tl.int32), AXIS) - 1
    take = visible & ((key > threshold) | (tie & (tie_rank < remaining)))
    return take, tl.sum(tie.to(tl.int32), AXIS)


@triton.jit
def compact_selected(
    logits_row,
    idx_row,
    first,
    last,
    threshold,
    remaining,
    written,
    ties_seen,
    lse,
    v_head,
    tables_row,
    stride_vb,
    stride_vt,
    HEAD_DIM: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    CONTRIBUTE: tl.constexpr,
):
    """Positions [first, last) of one (row, head) in order: the keys above ``threshold`` and
    the ties at it whose rank (after ``ties_seen`` earlier ones) is below ``remaining`` are
    written to ``idx_row`` from slot ``written``. Returns their probability mass and, with
    CONTRIBUTE, sum p * v from the paged values ([D] zeros otherwise: packed KV sums it),
    and the position of the last tie taken (-1: none)."""
    offs = tl.arange(0, BLOCK)
    d = tl.arange(0, HEAD_DIM)
    mass = tl.zeros([], tl.float32)
    contribution = tl.zeros([HEAD_DIM], tl.float32)
    last_tie = tl.full([], -1, tl.int32)
    for start in range(first, last, BLOCK):
        pos = start + offs
        visible = pos < last
        logit = tl.load(logits_row + pos, mask=visible, other=float("-inf"))
        key = _order_key(logit)
        take, ties = take_selected(key, visible, threshold, remaining, ties_seen, 0)
        tie_taken = take & (key == threshold)
        last_tie = tl.maximum(last_tie, tl.max(tl.where(tie_taken, pos, -1), 0).to(tl.int32))
        slot = written + tl.cumsum(take.to(tl.int32), 0) - 1
        tl.store(idx_row + slot, pos.to(tl.int32), mask=take)
        p = tl.where(take, tl.exp(logit - lse), 0.0)
        if CONTRIBUTE:
            page = tl.load(tables_row + pos // BLOCK_SIZE, mask=take, other=0).to(tl.int64)
            v = tl.load(
                v_head
                + page[:, None] * stride_vb
                + (pos % BLOCK_SIZE)[:, None] * stride_vt
                + d[None, :],
                mask=take[:, None],
                other=0.0,
            ).to(tl.float32)
            contribution += tl.sum(p[:, None] * v, 0)
        mass += tl.sum(p, 0)
        written += tl.sum(take.to(tl.int32), 0)
        ties_seen += ties
    return mass, contribution, last_tie


@triton.jit
def _radix_threshold(logits_row, length, count, BLOCK: tl.constexpr, RADIX_BITS: tl.constexpr):
    """The K-th largest key by radix select, most significant digit first (exact for any
    input; one histogram pass per digit). Returns (threshold key, ties to take at it)."""
    offs = tl.arange(0, BLOCK)
    bins = tl.arange(0, 1 << RADIX_BITS)
    prefix = tl.zeros([], tl.uint32)
    prefix_mask = tl.zeros([], tl.uint32)
    remaining = count.to(tl.int32)
    for level in tl.static_range(32 // RADIX_BITS):
        shift = 32 - RADIX_BITS * (level + 1)
        hist = tl.zeros([1 << RADIX_BITS], tl.int32)
        for start in range(0, length, BLOCK):
            pos = start + offs
            key = _order_key(tl.load(logits_row + pos, mask=pos < length, other=0.0))
            match = (pos < length) & ((key & prefix_mask) == prefix)
            digit = ((key >> shift) & ((1 << RADIX_BITS) - 1)).to(tl.int32)
            hist += tl.histogram(digit, 1 << RADIX_BITS, mask=match)
        at_or_above = tl.cumsum(hist, 0, reverse=True)
        chosen = tl.max(tl.where(at_or_above >= remaining, bins, 0), 0)
        above = tl.sum(tl.where(bins > chosen, hist, 0), 0)
        remaining -= above
        prefix |= chosen.to(tl.uint32) << shift
        prefix_mask |= tl.full([], (1 << RADIX_BITS) - 1, tl.uint32) << shift
    return prefix, remaining


@triton.jit
def _pick(sorted_keys, index, WIDTH: tl.constexpr):
    """sorted_keys[index] for a run-time index (0 past the end)."""
    return tl.max(tl.where(tl.arange(0, WIDTH) == index, sorted_keys, 0), 0)


@triton.jit
def _bracket_threshold(
    logits_row,
    scratch_row,
    length,
    count,
    BLOCK: tl.constexpr,
    SAMPLE: tl.constexpr,
    CANDIDATES: tl.constexpr,
):
    """The K-th largest key from a strided sample: its sorted sample brackets the K-th key
    by rank (+-3 sigma + 16); one pass counts keys above the bracket and copies those inside
    to scratch; sorting them gives the exact key. Returns (threshold, ties to take, ok); ok
    is false when the bracket missed or overflowed the scratch (the caller falls back)."""
    offs = tl.arange(0, BLOCK)
    stride = (length + SAMPLE - 1) // SAMPLE
    sample_pos = tl.arange(0, SAMPLE) * stride
    in_sample = sample_pos < length
    sample = tl.where(
        in_sample, _order_key(tl.load(logits_row + sample_pos, mask=in_sample, other=0.0)), 0
    )
    sample = tl.sort(sample, descending=True)
    taken = tl.sum(in_sample.to(tl.int32), 0)
    fraction = count.to(tl.float32) / tl.maximum(length, 1).to(tl.float32)
    margin = (3.0 * tl.sqrt(taken * fraction * (1.0 - fraction)) + 16.0).to(tl.int32)
    rank = (count * taken // tl.maximum(length, 1)).to(tl.int32)
    lowest = tl.where(rank + margin < taken, _pick(sample, rank + margin, SAMPLE), 0)
    highest = tl.where(rank >= margin, _pick(sample, rank - margin, SAMPLE), 0xFFFFFFFF)
    above = tl.zeros([], tl.int32)
    inside = tl.zeros([], tl.int32)
    for start in range(0, length, BLOCK):
        pos = start + offs
        key = _order_key(tl.load(logits_row + pos, mask=pos < length, other=0.0))
        above += tl.sum(((pos < length) & (key > highest)).to(tl.int32), 0)
        candidate = (pos < length) & (key >= lowest) & (key <= highest)
        slot = inside + tl.cumsum(candidate.to(tl.int32), 0) - 1
        tl.store(
            scratch_row + slot, key.to(tl.int32, bitcast=True), mask=candidate & (slot < CANDIDATES)
        )
        inside += tl.sum(candidate.to(tl.int32), 0)
    ok = (above < count) & (count <= above + inside) & (inside <= CANDIDATES)
    c = tl.arange(0, CANDIDATES)
    candidates = tl.load(scratch_row + c, mask=ok & (c < inside), other=0).to(
        tl.uint32, bitcast=True
    )
    candidates = tl.sort(candidates, descending=True)
    threshold = _pick(candidates, count - above - 1, CANDIDATES)
    higher = above + tl.sum((candidates > threshold).to(tl.int32), 0)
    return threshold, (count - higher).to(tl.int32), ok


@triton.jit(do_not_specialize=BLOCK_TABLE_ROWS, do_not_specialize_on_alignment=SCALAR_PER_ROW)
def select_statistics_kernel(
    logits_ptr,
    lse_ptr,
    lengths_ptr,
    v_ptr,
    tables_ptr,
    output_ptr,
    out_ptr,
    idx_ptr,
    mass_ptr,
    contrib_ptr,
    scratch_ptr,
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
    stride_mr,
    stride_cr,
    stride_ch,
    bucket,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    SAMPLE: tl.constexpr,
    CANDIDATES: tl.constexpr,
    CONTRIBUTE: tl.constexpr,
):
    """One (row, query head): exact top-K of the row's scaled logits (ties to the earlier
    position) on order-preserving keys, then one pass in position order that writes the
    K indices, their probability mass and contribution sum p * v.

    K = ceil(T * ratio_num / ratio_den) in integer arithmetic, (ratio_num, ratio_den) being
    ``key_retention_fraction(key_retention)``; indices past K are -1; the dense output [D]
    FP32 is also written in the output dtype (``out``)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    kv_head = head // GROUP
    length = tl.load(lengths_ptr + row).to(tl.int64)
    count = tl.minimum((length * ratio_num + ratio_den - 1) // ratio_den, length)
    lse = tl.load(lse_ptr + row * stride_er + head)
    logits_row = logits_ptr + row * stride_lr + head * stride_lh
    offs = tl.arange(0, BLOCK)

    # ---- the K-th largest key: sampled bracket, exact radix select if the bracket misses
    threshold, remaining, ok = _bracket_threshold(
        logits_row,
        scratch_ptr + (row * tl.num_programs(1) + head) * CANDIDATES,
        length,
        count,
        BLOCK,
        SAMPLE,
        CANDIDATES,
    )
    if not ok:
        threshold, remaining = _radix_threshold(logits_row, length, count, BLOCK, RADIX_BITS)

    # ---- compaction in position order: indices, mass, contribution
    d = tl.arange(0, HEAD_DIM)
    zero = tl.zeros([], tl.int32)
    mass, contribution, _ = compact_selected(
        logits_row,
        idx_ptr + row * stride_ir + head * stride_ih,
        0,
        length,
        threshold,
        remaining,
        zero,
        zero,
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
    for start in range(count, bucket, BLOCK):
        pos = start + offs
        tl.store(idx_ptr + row * stride_ir + head * stride_ih + pos, -1, mask=pos < bucket)
    tl.store(mass_ptr + row * stride_mr + head, mass)
    tl.store(contrib_ptr + row * stride_cr + head * stride_ch + d, contribution)
    dense = tl.load(output_ptr + row * stride_or + head * stride_oh + d)
    tl.store(out_ptr + row * stride_qr + head * stride_qh + d, dense.to(out_ptr.dtype.element_ty))
