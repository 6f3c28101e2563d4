"""Triton code of the split top-K selection (wrapper in ``threshold_select.py``).

Launches over each (row, head)'s logits: a strided sample brackets the K-th key by rank;
split programs count the keys above the bracket and copy those inside it to a candidate
list; one program per (row, head) finds the exact K-th key among the candidates (one
histogram per radix digit, as for both bracket ranks; no sort) and every split's output
offset; split programs compact in position order (ties to the earlier positions) with
mass partials. The value pass and the finish are in ``source_values_jit.py``.
"""

import triton
import triton.language as tl

from flashloop_backend.kernels.triton.select_jit import (
    _order_key,
    _radix_threshold,
    compact_selected,
)
from flashloop_backend.kernels.triton.specialization import SCALAR_PER_ROW


@triton.jit
def _selected_count(length, ratio_num, ratio_den):
    """K = min(ceil(length * num / den), length) in integer arithmetic."""
    return tl.minimum((length * ratio_num + ratio_den - 1) // ratio_den, length)


@triton.jit
def _digit_round(keys, valid, rank, answer, greater, bit, RADIX_BITS: tl.constexpr):
    """One radix digit of the rank-th largest (0-based) of the ``valid`` keys: ``answer``
    holds its bits above ``bit`` (zeros below) and ``greater`` counts the valid keys whose
    bits above ``bit`` exceed them; returns both extended by the RADIX_BITS bits below
    ``bit``. One histogram counts every trial digit at once, so a digit costs one
    reduction round rather than one per bit."""
    ones = tl.full([], 0xFFFFFFFF, tl.uint32)
    bit = (tl.zeros([], tl.int32) + bit).to(tl.uint32)
    high = ones ^ (ones >> bit)
    shift = 32 - RADIX_BITS - bit
    match = valid & ((keys & high) == answer)
    digit = ((keys >> shift) & ((1 << RADIX_BITS) - 1)).to(tl.int32)
    hist = tl.histogram(digit, 1 << RADIX_BITS, mask=match)
    at_or_above = greater + tl.cumsum(hist, 0, reverse=True)
    bins = tl.arange(0, 1 << RADIX_BITS)
    chosen = tl.max(tl.where(at_or_above > rank, bins, 0), 0)
    greater += tl.sum(tl.where(bins > chosen, hist, 0), 0)
    return answer | (chosen.to(tl.uint32) << shift), greater


@triton.jit
def _kth_largest(keys, valid, rank_a, rank_b, BITS: tl.constexpr, RADIX_BITS: tl.constexpr):
    """Lower bounds of the rank_a-th and rank_b-th largest (0-based) of the ``valid`` keys
    to their top BITS bits rounded up to whole digits: each the key itself with the bits
    below cleared (0 when fewer keys are valid), by radix digits from the top (the two
    ranks' rounds are independent, so their reductions overlap)."""
    answer_a = tl.zeros([], tl.uint32)
    answer_b = tl.zeros([], tl.uint32)
    greater_a = tl.zeros([], tl.int32)
    greater_b = tl.zeros([], tl.int32)
    for digit in tl.static_range((BITS + RADIX_BITS - 1) // RADIX_BITS):
        bit = digit * RADIX_BITS
        answer_a, greater_a = _digit_round(
            keys, valid, rank_a, answer_a, greater_a, bit, RADIX_BITS
        )
        answer_b, greater_b = _digit_round(
            keys, valid, rank_b, answer_b, greater_b, bit, RADIX_BITS
        )
    return answer_a, answer_b


@triton.jit
def _common_prefix(lowest, highest):
    """(the high bits ``lowest`` and ``highest`` share, zeros below; how many, at most 31)."""
    diff = lowest ^ highest
    shared = tl.zeros([], tl.int32)
    for b in tl.static_range(31):
        shared += ((diff >> (31 - b)) == 0).to(tl.int32)
    ones = tl.full([], 0xFFFFFFFF, tl.uint32)
    return lowest & (ones ^ (ones >> shared.to(tl.uint32))), shared


@triton.jit
def _kth_largest_from(keys, valid, rank, prefix, shared, RADIX_BITS: tl.constexpr):
    """(the rank-th largest (0-based) of the ``valid`` keys, which all carry ``prefix``'s
    ``shared`` high bits; how many valid keys exceed it): radix digits from the digit
    holding the first bit they do not share."""
    start = (shared // RADIX_BITS) * RADIX_BITS
    ones = tl.full([], 0xFFFFFFFF, tl.uint32)
    answer = prefix & (ones ^ (ones >> start.to(tl.uint32)))
    greater = tl.zeros([], tl.int32)
    for bit in range(start, 32, RADIX_BITS):
        answer, greater = _digit_round(keys, valid, rank, answer, greater, bit, RADIX_BITS)
    return answer, greater


@triton.jit(do_not_specialize_on_alignment=SCALAR_PER_ROW)
def select_bracket_kernel(
    logits_ptr,
    lengths_ptr,
    bracket_ptr,
    counter_ptr,
    ratio_num,
    ratio_den,
    stride_lr,
    stride_lh,
    SAMPLE: tl.constexpr,
    BITS: tl.constexpr,
    RADIX_BITS: tl.constexpr,
):
    """One (row, head): bracket [lowest, highest] of the K-th largest key from a strided
    sample of SAMPLE logits (its rank +- 3 sigma + 16 sample ranks, each to its top BITS
    bits, widened outwards), written to ``bracket`` [R, H, 2]; zeroes the candidate counter
    [R, H]."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pair = row * tl.num_programs(1) + head
    length = tl.load(lengths_ptr + row).to(tl.int64)
    count = _selected_count(length, ratio_num, ratio_den)
    stride = (length + SAMPLE - 1) // SAMPLE
    sample_pos = tl.arange(0, SAMPLE) * stride
    in_sample = sample_pos < length
    logits_row = logits_ptr + row * stride_lr + head * stride_lh
    keys = tl.where(
        in_sample, _order_key(tl.load(logits_row + sample_pos, mask=in_sample, other=0.0)), 0
    )
    taken = tl.sum(in_sample.to(tl.int32), 0)
    fraction = count.to(tl.float32) / tl.maximum(length, 1).to(tl.float32)
    margin = (3.0 * tl.sqrt(taken * fraction * (1.0 - fraction)) + 16.0).to(tl.int32)
    rank = (count * taken // tl.maximum(length, 1)).to(tl.int32)
    low_key, high_key = _kth_largest(
        keys, in_sample, rank + margin, rank - margin, BITS, RADIX_BITS
    )
    lowest = tl.where(rank + margin < taken, low_key, 0)
    # the bits below BITS widen the bracket upwards: it still holds the K-th key
    if BITS < 32:
        high_key = high_key | (tl.full([], 0xFFFFFFFF, tl.uint32) >> BITS)
    highest = tl.where(rank >= margin, high_key, 0xFFFFFFFF).to(tl.uint32)
    tl.store(bracket_ptr + pair * 2, lowest.to(tl.int32, bitcast=True))
    tl.store(bracket_ptr + pair * 2 + 1, highest.to(tl.int32, bitcast=True))
    tl.store(counter_ptr + pair, 0)


@triton.jit(do_not_specialize_on_alignment=SCALAR_PER_ROW)
def select_candidates_kernel(
    logits_ptr,
    lengths_ptr,
    bracket_ptr,
    counter_ptr,
    above_ptr,
    cand_key_ptr,
    cand_pos_ptr,
    stride_lr,
    stride_lh,
    chunk,
    num_splits,
    BLOCK: tl.constexpr,
    CANDIDATES: tl.constexpr,
):
    """One (row, head, split) over positions [split * chunk, +chunk): counts the keys above
    the bracket (``above`` [R, H, S]) and appends those inside it, key and position, to the
    (row, head)'s candidate list [R, H, CANDIDATES] at slots taken from ``counter``."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    pair = row * tl.num_programs(1) + head
    length = tl.load(lengths_ptr + row).to(tl.int64)
    lowest = tl.load(bracket_ptr + pair * 2).to(tl.uint32, bitcast=True)
    highest = tl.load(bracket_ptr + pair * 2 + 1).to(tl.uint32, bitcast=True)
    logits_row = logits_ptr + row * stride_lr + head * stride_lh
    first = split * chunk
    last = tl.minimum(first + chunk, length)
    offs = tl.arange(0, BLOCK)
    above = tl.zeros([], tl.int32)
    for start in range(first, last, BLOCK):
        pos = start + offs
        visible = pos < last
        key = _order_key(tl.load(logits_row + pos, mask=visible, other=0.0))
        above += tl.sum((visible & (key > highest)).to(tl.int32), 0)
        inside = visible & (key >= lowest) & (key <= highest)
        base = tl.atomic_add(counter_ptr + pair, tl.sum(inside.to(tl.int32), 0))
        slot = base + tl.cumsum(inside.to(tl.int32), 0) - 1
        keep = inside & (slot < CANDIDATES)
        tl.store(cand_key_ptr + pair * CANDIDATES + slot, key.to(tl.int32, bitcast=True), keep)
        tl.store(cand_pos_ptr + pair * CANDIDATES + slot, pos.to(tl.int32), keep)
    tl.store(above_ptr + pair * num_splits + split, above)


@triton.jit
def count_around(logits_row, first, last, threshold, BLOCK: tl.constexpr):
    """(keys above ``threshold``, ties at it) among positions [first, last)."""
    offs = tl.arange(0, BLOCK)
    above = tl.zeros([], tl.int32)
    equal = tl.zeros([], tl.int32)
    for start in range(first, last, BLOCK):
        pos = start + offs
        visible = pos < last
        key = _order_key(tl.load(logits_row + pos, mask=visible, other=0.0))
        above += tl.sum((visible & (key > threshold)).to(tl.int32), 0)
        equal += tl.sum((visible & (key == threshold)).to(tl.int32), 0)
    return above, equal


@triton.jit
def _split_counts(logits_row, length, chunk, num_splits, threshold, SPLITS_PAD, BLOCK):
    """Keys above ``threshold`` and ties at it, per split [SPLITS_PAD], by a full pass."""
    s = tl.arange(0, SPLITS_PAD)
    greater = tl.zeros([SPLITS_PAD], tl.int32)
    ties = tl.zeros([SPLITS_PAD], tl.int32)
    for split in range(0, num_splits):
        first = split * chunk
        last = tl.minimum(first + chunk, length)
        above, equal = count_around(logits_row, first, last, threshold, BLOCK)
        greater = tl.where(s == split, above, greater)
        ties = tl.where(s == split, equal, ties)
    return greater, ties


@triton.jit(do_not_specialize_on_alignment=SCALAR_PER_ROW)
def select_threshold_kernel(
    logits_ptr,
    lengths_ptr,
    bracket_ptr,
    counter_ptr,
    above_ptr,
    cand_key_ptr,
    cand_pos_ptr,
    plan_ptr,
    offsets_ptr,
    ratio_num,
    ratio_den,
    stride_lr,
    stride_lh,
    chunk,
    num_splits,
    BLOCK: tl.constexpr,
    RADIX_BITS: tl.constexpr,
    CANDIDATES: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """One (row, head): the exact K-th largest key (from the candidates; by radix select
    over the row when the bracket missed it or overflowed the list), the ties at it to
    take, and per split the output offset and the ties in earlier splits (the candidates
    lie in the ``bracket`` [R, H, 2]: the search skips the bits its ends share). Writes ``plan``
    [R, H, 3] (threshold key, ties to take, -1 for the compaction's last tie taken) and
    ``offsets`` [R, H, S, 2]."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pair = row * tl.num_programs(1) + head
    length = tl.load(lengths_ptr + row).to(tl.int64)
    count = _selected_count(length, ratio_num, ratio_den).to(tl.int32)
    s = tl.arange(0, SPLITS_PAD)
    above_s = tl.load(above_ptr + pair * num_splits + s, mask=s < num_splits, other=0)
    above = tl.sum(above_s, 0)
    inside = tl.load(counter_ptr + pair)
    ok = (above < count) & (count <= above + inside) & (inside <= CANDIDATES)
    c = tl.arange(0, CANDIDATES)
    valid = ok & (c < inside)
    keys = tl.load(cand_key_ptr + pair * CANDIDATES + c, mask=valid, other=0).to(
        tl.uint32, bitcast=True
    )
    split_of = tl.load(cand_pos_ptr + pair * CANDIDATES + c, mask=valid, other=0) // chunk
    need = count - above
    lowest = tl.load(bracket_ptr + pair * 2).to(tl.uint32, bitcast=True)
    highest = tl.load(bracket_ptr + pair * 2 + 1).to(tl.uint32, bitcast=True)
    prefix, shared = _common_prefix(lowest, highest)
    threshold, above_threshold = _kth_largest_from(
        keys, valid, need - 1, prefix, shared, RADIX_BITS
    )
    remaining = need - above_threshold
    greater = above_s + tl.histogram(split_of, SPLITS_PAD, mask=valid & (keys > threshold))
    ties = tl.histogram(split_of, SPLITS_PAD, mask=valid & (keys == threshold))
    if (not ok) & (count > 0):
        logits_row = logits_ptr + row * stride_lr + head * stride_lh
        threshold, remaining = _radix_threshold(logits_row, length, count, BLOCK, RADIX_BITS)
        greater, ties = _split_counts(
            logits_row, length, chunk, num_splits, threshold, SPLITS_PAD, BLOCK
        )
    empty = count == 0
    threshold = tl.where(empty, 0xFFFFFFFF, threshold).to(tl.uint32)
    remaining = tl.where(empty, 0, remaining).to(tl.int32)
    greater = tl.where(empty, 0, greater)
    ties = tl.where(empty, 0, ties)
    ties_before = tl.cumsum(ties, 0) - ties
    taken = greater + tl.minimum(tl.maximum(remaining - ties_before, 0), ties)
    offsets = tl.cumsum(taken, 0) - taken
    tl.store(plan_ptr + pair * 3, threshold.to(tl.int32, bitcast=True))
    tl.store(plan_ptr + pair * 3 + 1, remaining)
    tl.store(plan_ptr + pair * 3 + 2, -1)  # the compaction's last tie taken (atomic max)
    in_range = s < num_splits
    tl.store(offsets_ptr + (pair * num_splits + s) * 2, offsets, mask=in_range)
    tl.store(offsets_ptr + (pair * num_splits + s) * 2 + 1, ties_before, mask=in_range)


@triton.jit(do_not_specialize_on_alignment=SCALAR_PER_ROW)
def select_compact_kernel(
    logits_ptr,
    lse_ptr,
    lengths_ptr,
    plan_ptr,
    offsets_ptr,
    idx_ptr,
    part_mass_ptr,
    ratio_num,
    ratio_den,
    stride_lr,
    stride_lh,
    stride_er,
    stride_ir,
    stride_ih,
    chunk,
    num_splits,
    bucket,
    BLOCK: tl.constexpr,
):
    """One (row, head, split): writes its selected positions in order at its offset in
    ``idx`` [R, H, Kb] (ties taken while the earlier ties number fewer than the plan's),
    -1 over its share of [K, Kb), its partial [R, H, S] of the mass sum exp(logit - lse),
    and raises the plan's last tie taken to its own."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    pair = row * tl.num_programs(1) + head
    length = tl.load(lengths_ptr + row).to(tl.int64)
    threshold = tl.load(plan_ptr + pair * 3).to(tl.uint32, bitcast=True)
    remaining = tl.load(plan_ptr + pair * 3 + 1)
    written = tl.load(offsets_ptr + (pair * num_splits + split) * 2)
    ties_seen = tl.load(offsets_ptr + (pair * num_splits + split) * 2 + 1)
    lse = tl.load(lse_ptr + row * stride_er + head)
    logits_row = logits_ptr + row * stride_lr + head * stride_lh
    idx_row = idx_ptr + row * stride_ir + head * stride_ih
    offs = tl.arange(0, BLOCK)
    first = split * chunk
    last = tl.minimum(first + chunk, length)
    # no values read here (CONTRIBUTE off): the pointer and strides are never used
    mass, _, last_tie = compact_selected(
        logits_row,
        idx_row,
        first,
        last,
        threshold,
        remaining,
        written,
        ties_seen,
        lse,
        logits_row,
        logits_row,
        0,
        0,
        16,
        BLOCK,
        1,
        False,
    )
    tl.store(part_mass_ptr + pair * num_splits + split, mass)
    # the last tie any split took: a value pass takes the ties at or before it
    tl.atomic_max(plan_ptr + pair * 3 + 2, last_tie, mask=last_tie >= 0)
    # -1 past K: each split fills its share of [K, Kb)
    count = _selected_count(length, ratio_num, ratio_den)
    share = (bucket + num_splits - 1) // num_splits
    fill_first = count + split * share
    fill_last = tl.minimum(fill_first + share, bucket)
    for start in range(fill_first, fill_last, BLOCK):
        pos = start + offs
        tl.store(idx_row + pos, -1, mask=pos < fill_last)
