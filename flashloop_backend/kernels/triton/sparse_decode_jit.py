"""Triton code for sparse-correction decode attention (wrappers in ``sparse_decode.py``)."""

import triton
import triton.language as tl


@triton.jit
def sparse_correction_split_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, idx_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    scale,
    stride_qr, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_tr,
    stride_ir, stride_ih,
    stride_pr, stride_ph, stride_ps,
    stride_mr, stride_mh,
    keys_per_split,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One (row, query head, split): softmax over this split's selected keys, gathered from
    the row's pages at absolute positions; FP32 partial state (acc, max, sum)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + row * stride_qr + head * stride_qh + d).to(tl.float32)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([HEAD_DIM], tl.float32)
    j = tl.arange(0, BLOCK_K)
    first = split * keys_per_split
    for start in range(first, first + keys_per_split, BLOCK_K):
        # ---- gather: selected positions -> (page, slot) -> K/V rows
        in_split = (start + j) < first + keys_per_split
        pos = tl.load(
            idx_ptr + row * stride_ir + head * stride_ih + start + j, mask=in_split, other=-1
        )
        valid = pos >= 0
        page = tl.load(tables_ptr + row * stride_tr + pos // BLOCK_SIZE, mask=valid, other=0).to(
            tl.int64
        )
        slot = pos % BLOCK_SIZE
        k = tl.load(k_ptr + page[:, None] * stride_kb + slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                    mask=valid[:, None], other=0.0).to(tl.float32)  # fmt: skip
        v = tl.load(v_ptr + page[:, None] * stride_vb + slot[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                    mask=valid[:, None], other=0.0).to(tl.float32)  # fmt: skip
        # ---- online softmax over the selected keys
        s = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe)
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        m_i = m_new
    tl.store(part_out_ptr + row * stride_pr + head * stride_ph + split * stride_ps + d, acc)
    tl.store(part_max_ptr + row * stride_mr + head * stride_mh + split, m_i)
    tl.store(part_sum_ptr + row * stride_mr + head * stride_mh + split, l_i)
