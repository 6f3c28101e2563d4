"""Triton code for the loop-2 selection spread over splits of each row's keys (wrapper:
``dense_source.launch_selection``). The one-program-per-(row, head) kernel
(``select_jit.py``) leaves most SMs idle and sorts 4,096-key samples; here every digit of
an MSB-first radix select is one launch over (row, head, split) programs that add their
256-bin histogram into a shared one, and two more launches count and compact the keys
in position order. Same result as ``select_statistics_kernel``: exact top-K (K from
``ratio_num / ratio_den``, ``key_retention_fraction(key_retention)``), ties to the earlier
positions, indices in position order."""

import triton
import triton.language as tl

from flashloop_backend.kernels.triton.select_jit import _order_key, compact_selected

DIGIT_COUNT = 4  # 8-bit digits of a 32-bit key
DIGITS = tl.constexpr(DIGIT_COUNT)


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
def _row_setup(logits_ptr, lengths_ptr, hist_ptr, ratio_num, ratio_den, stride_lr, stride_lh,
               per_split):  # fmt: skip
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
    logits_ptr, lengths_ptr, hist_ptr, ratio_num, ratio_den, stride_lr, stride_lh, per_split,
    LEVEL: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
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
    logits_ptr, lengths_ptr, hist_ptr, counts_ptr, ratio_num, ratio_den, stride_lr, stride_lh,
    per_split, BLOCK: tl.constexpr,
):  # fmt: skip
    """One (row, head, split): its keys above the K-th largest and its ties at it, into
    counts [R, Hq, S, 2]."""
    row, head, split, _, count, hist_row, logits_row, first, last = _row_setup(
        logits_ptr, lengths_ptr, hist_ptr, ratio_num, ratio_den, stride_lr, stride_lh, per_split
    )
    threshold, _, _ = _selected(hist_row, count, DIGITS)
    offs = tl.arange(0, BLOCK)
    greater = tl.zeros([], tl.int32)
    ties = tl.zeros([], tl.int32)
    for start in range(first, last, BLOCK):
        pos = start + offs
        visible = pos < last
        key = _order_key(tl.load(logits_row + pos, mask=visible, other=0.0))
        greater += tl.sum((visible & (key > threshold)).to(tl.int32), 0)
        ties += tl.sum((visible & (key == threshold)).to(tl.int32), 0)
    at = counts_ptr + ((row * tl.num_programs(1) + head) * tl.num_programs(2) + split) * 2
    tl.store(at, greater)
    tl.store(at + 1, ties)


@triton.jit
def select_compact_kernel(
    logits_ptr, lse_ptr, lengths_ptr, hist_ptr, counts_ptr, v_ptr, tables_ptr, output_ptr,
    out_ptr, idx_ptr, mass_parts_ptr, contrib_parts_ptr,
    ratio_num, ratio_den,
    stride_lr, stride_lh, stride_er,
    stride_vb, stride_vt, stride_vh, stride_tr,
    stride_or, stride_oh, stride_qr, stride_qh, stride_ir, stride_ih,
    per_split, bucket,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK: tl.constexpr,
    SPLITS_PAD: tl.constexpr, CONTRIBUTE: tl.constexpr,
):  # fmt: skip
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
        logits_row, idx_ptr + row * stride_ir + head * stride_ih, first, last, threshold,
        remaining, written, ties_seen, lse, v_ptr + kv_head * stride_vh, tables_ptr + row * stride_tr,
        stride_vb, stride_vt, HEAD_DIM, BLOCK, BLOCK_SIZE, CONTRIBUTE,
    )  # fmt: skip
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
