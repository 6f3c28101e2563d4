"""Triton code that attends over the selected keys of packed KV without materialising them
(wrappers in ``packed_sparse.py``): each block of selected positions is reconstructed in
registers (:func:`reconstruct_rows`, V as rows or by channel) and consumed at once."""

import triton
import triton.language as tl

from flashloop_backend.kernels.triton.packed_gather_jit import reconstruct_rows


@triton.jit
def packed_selected_split_kernel(
    q_ptr,
    idx_ptr,
    logits_ptr,
    lse_ptr,
    kc_ptr,
    kmin_ptr,
    kscale_ptr,
    vc_ptr,
    vmin_ptr,
    vscale_ptr,
    level_tables_ptr,
    level_maps_ptr,
    level_kinds_ptr,
    packed_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    scale,
    stride_qr,
    stride_qh,
    stride_ir,
    stride_ih,
    stride_gr,
    stride_gh,
    stride_er,
    skc_p,
    skc_t,
    skc_h,
    skm_p,
    skm_h,
    svc_p,
    svc_h,
    svc_d,
    svm_p,
    svm_t,
    svm_h,
    stride_lr,
    stride_ll,
    stride_mr,
    stride_ml,
    stride_kr,
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
    stride_mr_,
    stride_mh,
    keys_per_split,
    num_keys,
    GROUP_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    LEVELS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FROM_LOGITS: tl.constexpr,
    V_BY_CHANNEL: tl.constexpr,
):
    """One (row, query head, split) over its share of the selected positions ``idx``
    [R, Hq, Kb] (-1: none), FP32 throughout.

    FROM_LOGITS False (loop 3-4 correction): online softmax of q k^T * scale over the
    selected keys -> partial (acc [D], max, sum), merged like split-K decode.
    FROM_LOGITS True (loop-2 contribution): acc = sum exp(logit - lse) v over the selected
    keys, logits [R, Hq, T] and lse [R, Hq] from the packed reader; max/sum unused.
    V_BY_CHANNEL reads V with the positions along the fast axis, else as rows like K
    (:func:`reconstruct_rows`)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP_Q
    d = tl.arange(0, HEAD_DIM)
    j = tl.arange(0, BLOCK_N)
    tables = level_tables_ptr + row * stride_lr
    maps = level_maps_ptr + row * stride_mr
    if FROM_LOGITS:
        lse = tl.load(lse_ptr + row * stride_er + head)
    else:
        q = tl.load(q_ptr + row * stride_qr + head * stride_qh + d).to(tl.float32) * scale
    m_i = float("-inf")
    l_i = 0.0
    if V_BY_CHANNEL:  # p * v accumulated per element, reduced over positions once at the end
        acc = tl.zeros([HEAD_DIM, BLOCK_N], tl.float32)
    else:
        acc = tl.zeros([HEAD_DIM], tl.float32)
    first = split * keys_per_split
    for start in range(first, first + keys_per_split, BLOCK_N):
        # ---- this block's selected positions, reconstructed in registers
        in_split = ((start + j) < first + keys_per_split) & ((start + j) < num_keys)
        pos = tl.load(
            idx_ptr + row * stride_ir + head * stride_ih + start + j, mask=in_split, other=-1
        )
        valid = pos >= 0
        k, v = reconstruct_rows(
            pos,
            row,
            kv_head,
            d,
            kc_ptr,
            kmin_ptr,
            kscale_ptr,
            vc_ptr,
            vmin_ptr,
            vscale_ptr,
            tables,
            maps,
            level_kinds_ptr,
            packed_ptr,
            k_ptr,
            v_ptr,
            tables_ptr,
            skc_p,
            skc_t,
            skc_h,
            skm_p,
            skm_h,
            svc_p,
            svc_h,
            svc_d,
            svm_p,
            svm_t,
            svm_h,
            stride_ll,
            stride_ml,
            stride_kr,
            stride_kb,
            stride_kt,
            stride_kh,
            stride_vb,
            stride_vt,
            stride_vh,
            stride_tr,
            BLOCK_N,
            HEAD_DIM,
            GROUP,
            BLOCK_SIZE,
            LEVELS,
            not FROM_LOGITS,
            V_BY_CHANNEL,
        )
        if FROM_LOGITS:
            # ---- loop 2: the selected keys' share of the dense softmax, times their values
            logit = tl.load(
                logits_ptr + row * stride_gr + head * stride_gh + pos,
                mask=valid,
                other=float("-inf"),
            )
            p = tl.where(valid, tl.exp(logit - lse), 0.0)
            if V_BY_CHANNEL:
                acc += v * p[None, :]
            else:
                acc += tl.sum(p[:, None] * v, axis=0)
        else:
            # ---- loops 3-4: online softmax over the selected keys
            s = tl.where(valid, tl.sum(q[None, :] * k, axis=1), float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe)
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            if V_BY_CHANNEL:
                acc = acc * alpha + v * p[None, :]
            else:
                acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m_i = m_new
    if V_BY_CHANNEL:
        out = tl.sum(acc, 1)
    else:
        out = acc
    tl.store(part_out_ptr + row * stride_pr + head * stride_ph + split * stride_ps + d, out)
    if not FROM_LOGITS:
        tl.store(part_max_ptr + row * stride_mr_ + head * stride_mh + split, m_i)
        tl.store(part_sum_ptr + row * stride_mr_ + head * stride_mh + split, l_i)
