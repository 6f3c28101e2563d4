"""Triton code for tiled prefill attention over nonconsecutive queries (wrapper in
``sparse_prefill.py``)."""

import triton
import triton.language as tl

from flashloop_backend.kernels.triton.specialization import BLOCK_TABLE_ROWS


@triton.jit
def _attend_block(
    q,
    m_i,
    l_i,
    acc,
    first,
    table,
    lengths,
    longest,
    k_ptr,
    v_ptr,
    kv_head,
    qk_scale,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One key block [first, first + BLOCK_N) folded into the online softmax state (m_i:
    the running max of the unscaled scores q . k). Unmasked blocks lie below every row's
    length, so they skip the visibility and bounds masks."""
    keys = first + tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    if MASKED:
        in_range = keys < longest
        page = tl.load(table + keys // BLOCK_SIZE, mask=in_range, other=0).to(tl.int64)
    else:
        page = tl.load(table + keys // BLOCK_SIZE).to(tl.int64)
    k_off = (
        page[:, None] * stride_kb + (keys % BLOCK_SIZE)[:, None] * stride_kt + kv_head * stride_kh
    )
    v_off = (
        page[:, None] * stride_vb + (keys % BLOCK_SIZE)[:, None] * stride_vt + kv_head * stride_vh
    )
    if MASKED:
        k = tl.load(k_ptr + k_off + d[None, :], mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + k_off + d[None, :])
    # raw scores and a raw running max: the scale enters once, in one multiply-add per score
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if MASKED:
        s = tl.where(keys[None, :] < lengths[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s * qk_scale - (m_safe * qk_scale)[:, None])
    alpha = tl.exp2((m_i - m_safe) * qk_scale)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptr + v_off + d[None, :], mask=in_range[:, None], other=0.0)
    else:
        v = tl.load(v_ptr + v_off + d[None, :])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=BLOCK_TABLE_ROWS)
def sparse_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lengths_ptr,
    tile_start_ptr,
    num_tiles_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    out_ptr,
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
    stride_or,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DIRECT: tl.constexpr,
):
    """Tiles for one (query head, key split), taken pid, pid + programs, ... from the last
    (longest contexts first, so the tail of the launch is short). A tile is up to BLOCK_M
    consecutive rows that share one block table (rows [tile_start[t], tile_start[t + 1]));
    row i sees keys [0, lengths[i]) of that table, so queries may sit at any absolute
    positions. Split s of S covers the s-th of S equal key ranges of the tile (few tiles
    still fill the GPU). FP32 online softmax; QK and PV on tensor cores; blocks below the
    tile's shortest row run unmasked; blocks past its longest row are never read. Writes
    the split's unnormalised partial state (acc, max, sum) per row, or with DIRECT (one
    split) the normalised output [R, Hq, D] itself, as merge_splits would (0 for a row
    with no key)."""
    head = tl.program_id(1)
    split = tl.program_id(2)
    splits = tl.num_programs(2)
    kv_head = head // GROUP
    num_tiles = tl.load(num_tiles_ptr)
    qk_scale = scale * 1.4426950408889634  # exp2 of scaled scores: e^(scale x)
    d = tl.arange(0, HEAD_DIM)
    taken = tl.program_id(0)
    while taken < num_tiles:
        tile = num_tiles - 1 - taken
        start = tl.load(tile_start_ptr + tile)
        end = tl.load(tile_start_ptr + tile + 1)
        rows = (start + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_mask = rows < end
        lengths = tl.load(lengths_ptr + rows, mask=row_mask, other=0)
        q = tl.load(
            q_ptr + rows[:, None] * stride_qr + head * stride_qh + d[None, :],
            mask=row_mask[:, None],
            other=0.0,
        )
        table = tables_ptr + start.to(tl.int64) * stride_tr
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        longest = tl.max(lengths, 0)
        shortest = tl.min(tl.where(row_mask, lengths, longest), 0)
        full_blocks_end = (shortest // BLOCK_N) * BLOCK_N
        span = tl.cdiv(tl.cdiv(longest, BLOCK_N), splits) * BLOCK_N
        lo = split * span
        hi = tl.minimum(lo + span, longest)
        for first in range(lo, tl.minimum(hi, full_blocks_end), BLOCK_N):
            m_i, l_i, acc = _attend_block(
                q,
                m_i,
                l_i,
                acc,
                first,
                table,
                lengths,
                longest,
                k_ptr,
                v_ptr,
                kv_head,
                qk_scale,
                stride_kb,
                stride_kt,
                stride_kh,
                stride_vb,
                stride_vt,
                stride_vh,
                HEAD_DIM,
                BLOCK_SIZE,
                BLOCK_N,
                False,
                DOT_PRECISION,
            )
        for first in range(tl.maximum(lo, full_blocks_end), hi, BLOCK_N):
            m_i, l_i, acc = _attend_block(
                q,
                m_i,
                l_i,
                acc,
                first,
                table,
                lengths,
                longest,
                k_ptr,
                v_ptr,
                kv_head,
                qk_scale,
                stride_kb,
                stride_kt,
                stride_kh,
                stride_vb,
                stride_vt,
                stride_vh,
                HEAD_DIM,
                BLOCK_SIZE,
                BLOCK_N,
                True,
                DOT_PRECISION,
            )
        if DIRECT:  # merge_splits of one split: acc / l, rows with no key 0
            l_safe = tl.where(l_i > 0, l_i, 1.0)
            result = tl.where((l_i > 0)[:, None], acc / l_safe[:, None], 0.0)
            tl.store(
                out_ptr + rows[:, None] * stride_or + head * stride_oh + d[None, :],
                result.to(out_ptr.dtype.element_ty),
                mask=row_mask[:, None],
            )
        else:  # partial state in natural-log units (merge_splits' convention)
            tl.store(
                part_out_ptr
                + rows[:, None] * stride_pr
                + head * stride_ph
                + split * stride_ps
                + d[None, :],
                acc,
                mask=row_mask[:, None],
            )
            stat = rows * stride_mr + head * stride_mh + split
            tl.store(part_max_ptr + stat, m_i * scale, mask=row_mask)
            tl.store(part_sum_ptr + stat, l_i, mask=row_mask)
        taken += tl.num_programs(0)
