"""Triton code for decode attention over packed INT4 KV (wrapper in ``packed_decode.py``)."""

import triton
import triton.language as tl

COMPACT = tl.constexpr(1)  # level kinds: 0 dense, 1 compact, 2 empty


@triton.jit
def _base_group(kc_ptr, kmin_ptr, kscale_ptr, vc_ptr, vmin_ptr, vscale_ptr, page, kv_head,
                skc_p, skc_h, skc_d, skm_p, skm_h, svc_p, svc_t, svc_h, svm_p, svm_t, svm_h,
                HEAD_DIM: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """A dense level's page: K^T [D, GROUP] and V [GROUP, D] in FP32 from contiguous bytes."""
    ch = tl.arange(0, HEAD_DIM)
    half = tl.arange(0, GROUP // 2)
    t = tl.arange(0, GROUP)
    k_bytes = tl.load(kc_ptr + page * skc_p + kv_head * skc_h + ch[:, None] * skc_d + half[None, :])
    k_codes = tl.reshape(tl.join(k_bytes & 15, k_bytes >> 4), (HEAD_DIM, GROUP))
    k_min = tl.load(kmin_ptr + page * skm_p + kv_head * skm_h + ch).to(tl.float32)
    k_scale = tl.load(kscale_ptr + page * skm_p + kv_head * skm_h + ch).to(tl.float32)
    k_t = k_min[:, None] + k_scale[:, None] * k_codes.to(tl.float32)
    pair = tl.arange(0, HEAD_DIM // 2)
    v_bytes = tl.load(vc_ptr + page * svc_p + t[:, None] * svc_t + kv_head * svc_h + pair[None, :])
    v_codes = tl.reshape(tl.join(v_bytes & 15, v_bytes >> 4), (GROUP, HEAD_DIM))
    param = page * svm_p + t[:, None] * svm_t + kv_head * svm_h + (ch // GROUP)[None, :]
    v = tl.load(vmin_ptr + param).to(tl.float32) + tl.load(vscale_ptr + param).to(
        tl.float32
    ) * v_codes.to(tl.float32)
    return k_t, v


@triton.jit
def _gathered_rows(kc_ptr, kmin_ptr, kscale_ptr, vc_ptr, vmin_ptr, vscale_ptr, table, rows, kv_head,
                   skc_p, skc_h, skc_d, skm_p, skm_h, svc_p, svc_t, svc_h, svm_p, svm_t, svm_h,
                   HEAD_DIM: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """A level's rows ``rows`` [GROUP] (-1 absent: contributes 0) gathered from its pages
    ``table``: K^T [D, GROUP] and V [GROUP, D] in FP32."""
    ch = tl.arange(0, HEAD_DIM)
    present = rows >= 0
    page = tl.load(table + rows // GROUP, mask=present, other=0).to(tl.int64)
    within = rows % GROUP
    k_bytes = tl.load(kc_ptr + page[None, :] * skc_p + kv_head * skc_h + ch[:, None] * skc_d + (within // 2)[None, :],
                      mask=present[None, :], other=0)  # fmt: skip
    k_codes = (k_bytes >> ((within % 2) * 4).to(tl.uint8)[None, :]) & 15
    k_param = page[None, :] * skm_p + kv_head * skm_h + ch[:, None]
    k_min = tl.load(kmin_ptr + k_param, mask=present[None, :], other=0.0).to(tl.float32)
    k_scale = tl.load(kscale_ptr + k_param, mask=present[None, :], other=0.0).to(tl.float32)
    k_t = k_min + k_scale * k_codes.to(tl.float32)
    v_bytes = tl.load(vc_ptr + page[:, None] * svc_p + within[:, None] * svc_t + kv_head * svc_h + (ch // 2)[None, :],
                      mask=present[:, None], other=0)  # fmt: skip
    v_codes = (v_bytes >> ((ch % 2) * 4).to(tl.uint8)[None, :]) & 15
    v_param = (
        page[:, None] * svm_p + within[:, None] * svm_t + kv_head * svm_h + (ch // GROUP)[None, :]
    )
    v_min = tl.load(vmin_ptr + v_param, mask=present[:, None], other=0.0).to(tl.float32)
    v_scale = tl.load(vscale_ptr + v_param, mask=present[:, None], other=0.0).to(tl.float32)
    return k_t, v_min + v_scale * v_codes.to(tl.float32)


@triton.jit
def packed_decode_split_kernel(
    q_ptr, kc_ptr, kmin_ptr, kscale_ptr, vc_ptr, vmin_ptr, vscale_ptr,
    level_tables_ptr, level_maps_ptr, level_kinds_ptr, packed_ptr,
    k_ptr, v_ptr, tables_ptr, lengths_ptr,
    part_out_ptr, part_max_ptr, part_sum_ptr,
    scale,
    stride_qr, stride_qh,
    skc_p, skc_h, skc_d, skm_p, skm_h, svc_p, svc_t, svc_h, svm_p, svm_t, svm_h,
    stride_lr, stride_ll, stride_mr, stride_ml, stride_kr,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_tr,
    stride_pr, stride_ph, stride_ps, stride_sr, stride_sh,
    groups_per_split,
    GROUP_Q: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    LEVELS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """One (row, query head, split) over groups of GROUP rows: rows below the row's packed
    length are reconstructed in registers (base + the LEVELS - 1 residual levels, dense or
    through the compact map; nothing is written back), later rows come from the BF16
    paged cache. FP32 online softmax; partial state (acc, max, sum) per split."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP_Q
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, GROUP)
    q = tl.load(q_ptr + row * stride_qr + head * stride_qh + d)
    q16 = tl.broadcast_to(q[None, :], (16, HEAD_DIM))
    first_row = tl.arange(0, 16) == 0
    length = tl.load(lengths_ptr + row)
    packed = tl.load(packed_ptr + row)
    tables = level_tables_ptr + row * stride_lr
    maps = level_maps_ptr + row * stride_mr
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([16, HEAD_DIM], tl.float32)
    first = split * groups_per_split
    for group in range(first, first + groups_per_split):
        pos = group * GROUP + t
        if group * GROUP < packed:
            page = tl.load(tables + group).to(tl.int64)
            k_t, v = _base_group(kc_ptr, kmin_ptr, kscale_ptr, vc_ptr, vmin_ptr, vscale_ptr, page, kv_head,
                                 skc_p, skc_h, skc_d, skm_p, skm_h, svc_p, svc_t, svc_h, svm_p, svm_t, svm_h,
                                 HEAD_DIM, GROUP)  # fmt: skip
            for level in tl.static_range(1, LEVELS):
                kind = tl.load(level_kinds_ptr + row * stride_kr + level)
                rows = tl.where(kind == COMPACT, tl.load(maps + level * stride_ml + pos), pos)
                rows = tl.where(kind > COMPACT, -1, rows)  # a level no row recomputed
                k_r, v_r = _gathered_rows(kc_ptr, kmin_ptr, kscale_ptr, vc_ptr, vmin_ptr, vscale_ptr,
                                          tables + level * stride_ll, rows, kv_head,
                                          skc_p, skc_h, skc_d, skm_p, skm_h, svc_p, svc_t, svc_h, svm_p, svm_t, svm_h,
                                          HEAD_DIM, GROUP)  # fmt: skip
                k_t += k_r
                v += v_r
        else:
            visible = pos < length
            bf_page = tl.load(
                tables_ptr + row * stride_tr + pos // BLOCK_SIZE, mask=visible, other=0
            ).to(tl.int64)
            slot = pos % BLOCK_SIZE
            k = tl.load(k_ptr + bf_page[:, None] * stride_kb + slot[:, None] * stride_kt + kv_head * stride_kh + d[None, :],
                        mask=visible[:, None], other=0.0).to(tl.float32)  # fmt: skip
            k_t = tl.trans(k)
            v = tl.load(v_ptr + bf_page[:, None] * stride_vb + slot[:, None] * stride_vt + kv_head * stride_vh + d[None, :],
                        mask=visible[:, None], other=0.0).to(tl.float32)  # fmt: skip
        s16 = tl.dot(q16, k_t.to(q.dtype), input_precision=DOT_PRECISION) * scale
        s = tl.sum(tl.where(first_row[:, None], s16, 0.0), axis=0)
        s = tl.where(pos < length, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe)
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        p16 = tl.where(first_row[:, None], tl.broadcast_to(p[None, :], (16, GROUP)), 0.0)
        acc = acc * alpha + tl.dot(p16.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    out = tl.sum(tl.where(first_row[:, None], acc, 0.0), axis=0)
    tl.store(part_out_ptr + row * stride_pr + head * stride_ph + split * stride_ps + d, out)
    tl.store(part_max_ptr + row * stride_sr + head * stride_sh + split, m_i)
    tl.store(part_sum_ptr + row * stride_sr + head * stride_sh + split, l_i)
