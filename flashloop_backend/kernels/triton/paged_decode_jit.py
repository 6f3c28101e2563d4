"""Triton code for per-row paged attention (split-K decode form). Wrappers live in
``paged_decode.py``; this module holds only ``@triton.jit`` functions."""

import triton
import triton.language as tl

from flashloop_backend.kernels.triton.specialization import (
    BLOCK_TABLE_ROWS,
    MERGE_SPLITS_METADATA,
    PAGED_PER_ROW,
    PAGED_SPLIT_METADATA,
)


@triton.jit(
    do_not_specialize=[*PAGED_SPLIT_METADATA, *BLOCK_TABLE_ROWS],
    do_not_specialize_on_alignment=PAGED_PER_ROW,
)
def paged_attention_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lengths_ptr,
    spans_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    logits_ptr,
    scale,
    stride_qr,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_tr,
    stride_pr,
    stride_ph,
    stride_ps,
    stride_mr,
    stride_mh,
    stride_lr,
    stride_lh,
    blocks_per_split,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PAGES: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    READ_VALUES: tl.constexpr,
    ROWS: tl.constexpr,
):
    """One (row, kv head, split): online softmax over this split's pages, FP32 state.

    ROWS > 1: the program of a row whose span (``spans_ptr``) is s >= 1 computes rows
    row .. row + s - 1 (s <= ROWS) from the leading row's block table, their query heads
    stacked in one tile of GROUP_PAD >= ROWS * GROUP rows, so the keys the rows share
    are read once; a row of span 0 lies inside an earlier span and its program stores
    nothing. Each row still sees only the keys before its own length.

    USE_DOT computes QK and PV with tensor-core dots (query heads padded to GROUP_PAD >= 16,
    P rounded to the KV dtype, FP32 accumulation); otherwise with FP32 broadcast-reduce.
    Without READ_VALUES only the keys are read: the partial max and sum (the LSE) and the
    logits, acc stays zero (a later pass over the values uses the LSE)."""
    row = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # ---- the query heads of this KV group, of every row the program computes:
    # [GROUP_PAD, HEAD_DIM] (tile row m is row + m // GROUP, query head m % GROUP)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    if ROWS == 1:
        q_heads = kv_head * GROUP + g
        q_mask = g < GROUP
        length = tl.load(lengths_ptr + row)
        q_row_off = row.to(tl.int64) * stride_qr
        part_row_off = row.to(tl.int64) * stride_pr
        stat_row_off = row.to(tl.int64) * stride_mr
    else:
        span = tl.load(spans_ptr + row)
        q_rows = row + g // GROUP
        q_heads = kv_head * GROUP + g % GROUP
        q_mask = (g < ROWS * GROUP) & (g // GROUP < span)
        row_lengths = tl.load(lengths_ptr + q_rows, mask=q_mask, other=0)
        length = tl.max(row_lengths, axis=0)
        q_row_off = q_rows.to(tl.int64)[:, None] * stride_qr
        part_row_off = q_rows.to(tl.int64)[:, None] * stride_pr
        stat_row_off = q_rows.to(tl.int64) * stride_mr
    num_pages = tl.cdiv(length, BLOCK_SIZE)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, num_pages)
    q = tl.load(
        q_ptr + q_row_off + q_heads[:, None] * stride_qh + d[None, :],
        mask=q_mask[:, None],
        other=0.0,
    )

    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    t = tl.arange(0, PAGES * BLOCK_SIZE)
    page_of_t = t // BLOCK_SIZE
    slot_of_t = t % BLOCK_SIZE

    # ---- sweep PAGES pages per iteration: gather ids, load K/V tiles, update softmax
    for page0 in range(first, last, PAGES):
        page = page0 + page_of_t
        in_range = page < last
        block = tl.load(tables_ptr + row.to(tl.int64) * stride_tr + page, mask=in_range, other=0)
        pos = page * BLOCK_SIZE + slot_of_t
        visible = in_range & (pos < length)
        base = block.to(tl.int64)
        k = tl.load(
            k_ptr
            + base[:, None] * stride_kb
            + slot_of_t[:, None] * stride_kt
            + kv_head * stride_kh
            + d[None, :],
            mask=visible[:, None],
            other=0.0,
        )
        if USE_DOT:
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [GROUP_PAD, N]
        else:
            s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2) * scale
        if ROWS == 1:
            s = tl.where(visible[None, :], s, float("-inf"))
        else:  # each row's own causal length
            s = tl.where(visible[None, :] & (pos[None, :] < row_lengths[:, None]), s, float("-inf"))
        if STORE_LOGITS:  # selection statistics: every visible key's scaled logit, once
            logits_row = logits_ptr + row.to(tl.int64) * stride_lr
            if GROUP == 1:
                # one query row: store it as a vector, not from the padded 2-D tile whose
                # other rows are masked (scattered 4-byte stores from the dot layout)
                s_row = tl.sum(tl.where(q_mask[:, None], s, 0.0), axis=0)
                tl.store(logits_row + kv_head * stride_lh + pos, s_row, mask=visible)
            else:
                tl.store(
                    logits_row + q_heads[:, None] * stride_lh + pos[None, :],
                    s,
                    mask=q_mask[:, None] & visible[None, :],
                )
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if READ_VALUES:
            v = tl.load(
                v_ptr
                + base[:, None] * stride_vb
                + slot_of_t[:, None] * stride_vt
                + kv_head * stride_vh
                + d[None, :],
                mask=visible[:, None],
                other=0.0,
            )
            if USE_DOT:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            else:
                acc = acc * alpha[:, None] + tl.sum(
                    p[:, :, None] * v.to(tl.float32)[None, :, :], axis=1
                )
        m_i = m_new

    # ---- store this split's unnormalised partial state
    out_off = part_row_off + q_heads[:, None] * stride_ph + split * stride_ps + d[None, :]
    tl.store(part_out_ptr + out_off, acc, mask=q_mask[:, None])
    stat_off = stat_row_off + q_heads * stride_mh + split
    tl.store(part_max_ptr + stat_off, m_i, mask=q_mask)
    tl.store(part_sum_ptr + stat_off, l_i, mask=q_mask)


@triton.jit(do_not_specialize=MERGE_SPLITS_METADATA)
def merge_splits_kernel(
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,
    lse_ptr,
    ref_ptr,
    contrib_ptr,
    mass_ptr,
    serves_ptr,
    stride_pr,
    stride_ph,
    stride_ps,
    stride_mr,
    stride_mh,
    stride_or,
    stride_oh,
    stride_lr,
    stride_rr,
    stride_rh,
    stride_cr,
    stride_ch,
    stride_sr,
    num_splits,
    SPLIT_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    STORE_LSE: tl.constexpr,
    CORRECT: tl.constexpr,
    STORE_OUT: tl.constexpr = True,
    SERVES: tl.constexpr = False,
):
    """One (row, query head): combine split partial states; rows with no key give 0.
    With CORRECT the result is the sparse correction ref - contrib + mass * merged.
    Without STORE_OUT only the LSE: the states of a pass that sums no values. With SERVES
    the output is stored only for rows whose serves [R] int8 is nonzero (the others keep
    what out holds). The splits go SPLIT_BLOCK at a time, so one variant serves every
    split count."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, SPLIT_BLOCK)
    d = tl.arange(0, HEAD_DIM)
    stats = row * stride_mr + head * stride_mh
    total_max = tl.full((), float("-inf"), tl.float32)
    for start in range(0, num_splits, SPLIT_BLOCK):
        m = tl.load(
            part_max_ptr + stats + start + s, mask=start + s < num_splits, other=float("-inf")
        )
        total_max = tl.maximum(total_max, tl.max(m, axis=0))
    safe = tl.where(total_max == float("-inf"), 0.0, total_max)
    denom = tl.zeros((), tl.float32)
    numer = tl.zeros((HEAD_DIM,), tl.float32)
    parts = part_out_ptr + row * stride_pr + head * stride_ph
    for start in range(0, num_splits, SPLIT_BLOCK):
        s_mask = start + s < num_splits
        m = tl.load(part_max_ptr + stats + start + s, mask=s_mask, other=float("-inf"))
        weight = tl.where(s_mask, tl.exp(m - safe), 0.0)
        sums = tl.load(part_sum_ptr + stats + start + s, mask=s_mask, other=0.0)
        denom += tl.sum(sums * weight, axis=0)
        if STORE_OUT:
            acc = tl.load(
                parts + (start + s)[:, None] * stride_ps + d[None, :],
                mask=s_mask[:, None],
                other=0.0,
            )
            numer += tl.sum(acc * weight[:, None], axis=0)
    if STORE_OUT:
        out = tl.where(denom > 0, numer / tl.where(denom > 0, denom, 1.0), 0.0)
        if CORRECT:
            ref = tl.load(ref_ptr + row * stride_rr + head * stride_rh + d)
            contrib = tl.load(contrib_ptr + row * stride_cr + head * stride_ch + d)
            out = ref - contrib + tl.load(mass_ptr + row * stride_sr + head) * out
        out_row = out_ptr + row * stride_or + head * stride_oh
        if SERVES:
            keep = (d < HEAD_DIM) & (tl.load(serves_ptr + row) != 0)
            tl.store(out_row + d, out.to(out_ptr.dtype.element_ty), mask=keep)
        else:
            tl.store(out_row + d, out.to(out_ptr.dtype.element_ty))
    if STORE_LSE:  # natural-log log-sum-exp of the scaled logits (-inf for rows with no key)
        lse = tl.where(denom > 0, safe + tl.log(tl.where(denom > 0, denom, 1.0)), float("-inf"))
        tl.store(lse_ptr + row * stride_lr + head, lse)
