"""Triton code for sparse-correction decode attention (wrappers in ``sparse_decode.py``)."""

import triton
import triton.language as tl

from flashloop_backend.kernels.triton.specialization import BLOCK_TABLE_ROWS


@triton.jit(do_not_specialize=BLOCK_TABLE_ROWS)
def sparse_correction_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    idx_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
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
    stride_ir,
    stride_ih,
    stride_pr,
    stride_ph,
    stride_ps,
    stride_mr,
    stride_mh,
    keys_per_split,
    num_keys,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (row, query head, split): softmax over this split's selected keys, gathered from
    the row's pages at absolute positions; FP32 partial state (acc, max, sum).

    QK and PV run as tensor-core dots with the query broadcast to 16 rows (only row 0 is
    used): the broadcast-reduce form spends its time in register shuffles, not memory."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + row * stride_qr + head * stride_qh + d)
    q16 = tl.broadcast_to(q[None, :], (16, HEAD_DIM))
    first_row = tl.arange(0, 16) == 0
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([16, HEAD_DIM], tl.float32)
    j = tl.arange(0, BLOCK_K)
    first = split * keys_per_split
    for start in range(first, first + keys_per_split, BLOCK_K):
        # ---- gather: selected positions -> (page, slot) -> K/V rows
        in_split = ((start + j) < first + keys_per_split) & ((start + j) < num_keys)
        pos = tl.load(
            idx_ptr + row * stride_ir + head * stride_ih + start + j, mask=in_split, other=-1
        )
        valid = pos >= 0
        page = tl.load(tables_ptr + row * stride_tr + pos // BLOCK_SIZE, mask=valid, other=0).to(
            tl.int64
        )
        slot = pos % BLOCK_SIZE
        k = tl.load(
            k_ptr
            + page[:, None] * stride_kb
            + slot[:, None] * stride_kt
            + kv_head * stride_kh
            + d[None, :],
            mask=valid[:, None],
            other=0.0,
        )
        v = tl.load(
            v_ptr
            + page[:, None] * stride_vb
            + slot[:, None] * stride_vt
            + kv_head * stride_vh
            + d[None, :],
            mask=valid[:, None],
            other=0.0,
        )
        # ---- online softmax over the selected keys (row 0 of the 16-row tiles is the query)
        s16 = tl.dot(q16, tl.trans(k), input_precision=DOT_PRECISION) * scale  # [16, BLOCK_K]
        s = tl.where(valid, tl.sum(tl.where(first_row[:, None], s16, 0.0), axis=0), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe)
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        p16 = tl.where(first_row[:, None], tl.broadcast_to(p[None, :], (16, BLOCK_K)), 0.0)
        acc = acc * alpha + tl.dot(p16.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    out = tl.sum(tl.where(first_row[:, None], acc, 0.0), axis=0)
    tl.store(part_out_ptr + row * stride_pr + head * stride_ph + split * stride_ps + d, out)
    tl.store(part_max_ptr + row * stride_mr + head * stride_mh + split, m_i)
    tl.store(part_sum_ptr + row * stride_mr + head * stride_mh + split, l_i)
