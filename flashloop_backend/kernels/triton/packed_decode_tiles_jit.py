"""Triton code for decode attention over packed INT4 KV (wrapper in ``packed_decode.py``).

Two codes share a byte (lower row / channel in the low nibble), so each group of GROUP
rows is handled as its even and odd rows (K: low and high nibbles of the same bytes) and
V as its even and odd channels; nothing is interleaved in registers. The output keeps the
even-channel and odd-channel halves apart until the store.
"""

import triton
import triton.language as tl

COMPACT = tl.constexpr(1)  # level kinds: 0 dense, 1 compact, 2 empty


@triton.jit
def _dense_level(kc_ptr, kmin_ptr, kscale_ptr, vc_ptr, vmin_ptr, vscale_ptr, page, kv_head,
                 skc_p, skc_h, skc_d, skm_p, skm_h, svc_p, svc_t, svc_h, svm_p, svm_t, svm_h,
                 HEAD_DIM: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """One dense level's page as FP32 tiles: K^T of even / odd rows [D, G/2] and V of
    (even, odd) rows x (even, odd) channels [G/2, D/2]. Parameters are loaded once per
    channel (K) or per row and channel group (V) and broadcast."""
    ch = tl.arange(0, HEAD_DIM)
    half = tl.arange(0, GROUP // 2)
    k_bytes = tl.load(kc_ptr + page * skc_p + kv_head * skc_h + ch[:, None] * skc_d + half[None, :])
    k_min = tl.load(kmin_ptr + page * skm_p + kv_head * skm_h + ch).to(tl.float32)[:, None]
    k_scale = tl.load(kscale_ptr + page * skm_p + kv_head * skm_h + ch).to(tl.float32)[:, None]
    k_even = k_min + k_scale * (k_bytes & 15).to(tl.float32)
    k_odd = k_min + k_scale * (k_bytes >> 4).to(tl.float32)
    v_ee, v_eo = _dense_v_rows(vc_ptr, vmin_ptr, vscale_ptr, page, kv_head, 0,
                               svc_p, svc_t, svc_h, svm_p, svm_t, svm_h, HEAD_DIM, GROUP)  # fmt: skip
    v_oe, v_oo = _dense_v_rows(vc_ptr, vmin_ptr, vscale_ptr, page, kv_head, 1,
                               svc_p, svc_t, svc_h, svm_p, svm_t, svm_h, HEAD_DIM, GROUP)  # fmt: skip
    return k_even, k_odd, v_ee, v_eo, v_oe, v_oo


@triton.jit
def _dense_v_rows(vc_ptr, vmin_ptr, vscale_ptr, page, kv_head, parity,
                  svc_p, svc_t, svc_h, svm_p, svm_t, svm_h,
                  HEAD_DIM: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """V of a dense page's even (parity 0) or odd rows: (even channels, odd channels)
    [G/2, D/2] FP32, parameters loaded per (row, channel group) and broadcast."""
    row = 2 * tl.arange(0, GROUP // 2) + parity
    pair = tl.arange(0, HEAD_DIM // 2)
    groups = tl.arange(0, HEAD_DIM // GROUP)
    v_bytes = tl.load(
        vc_ptr + page * svc_p + row[:, None] * svc_t + kv_head * svc_h + pair[None, :]
    )
    param = page * svm_p + row[:, None] * svm_t + kv_head * svm_h + groups[None, :]
    shape = (GROUP // 2, HEAD_DIM // GROUP, GROUP // 2)
    v_min = tl.reshape(tl.broadcast_to(tl.load(vmin_ptr + param).to(tl.float32)[:, :, None], shape),
                       (GROUP // 2, HEAD_DIM // 2))  # fmt: skip
    v_scale = tl.reshape(tl.broadcast_to(tl.load(vscale_ptr + param).to(tl.float32)[:, :, None], shape),
                         (GROUP // 2, HEAD_DIM // 2))  # fmt: skip
    return v_min + v_scale * (v_bytes & 15).to(tl.float32), v_min + v_scale * (v_bytes >> 4).to(
        tl.float32
    )


@triton.jit
def _bf16_rows(k_ptr, v_ptr, tables_ptr, row, group, length, kv_head, parity,
               stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_tr,
               HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """The BF16 paged rows of a group's even (parity 0) or odd positions: K^T [D, G/2] and
    V of even and odd channels [G/2, D/2], FP32 (zeros past the context)."""
    d = tl.arange(0, HEAD_DIM)
    pair = tl.arange(0, HEAD_DIM // 2)
    pos = group * GROUP + 2 * tl.arange(0, GROUP // 2) + parity
    visible = pos < length
    page = tl.load(tables_ptr + row * stride_tr + pos // BLOCK_SIZE, mask=visible, other=0).to(
        tl.int64
    )
    base_k = (
        k_ptr
        + page[:, None] * stride_kb
        + (pos % BLOCK_SIZE)[:, None] * stride_kt
        + kv_head * stride_kh
    )
    base_v = (
        v_ptr
        + page[:, None] * stride_vb
        + (pos % BLOCK_SIZE)[:, None] * stride_vt
        + kv_head * stride_vh
    )
    k = tl.load(base_k + d[None, :], mask=visible[:, None], other=0.0).to(tl.float32)
    v_even = tl.load(base_v + 2 * pair[None, :], mask=visible[:, None], other=0.0).to(tl.float32)
    v_odd = tl.load(base_v + 2 * pair[None, :] + 1, mask=visible[:, None], other=0.0).to(tl.float32)
    return tl.trans(k), v_even, v_odd


@triton.jit
def _gathered_level(kc_ptr, kmin_ptr, kscale_ptr, vc_ptr, vmin_ptr, vscale_ptr, table, rows, kv_head,
                    skc_p, skc_h, skc_d, skm_p, skm_h, svc_p, svc_t, svc_h, svm_p, svm_t, svm_h,
                    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """A compact level's rows ``rows`` [G/2] (-1 absent: zeros) gathered from its pages
    ``table``: K^T [D, G/2], V of even and odd channels [G/2, D/2], FP32."""
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
    pair = tl.arange(0, HEAD_DIM // 2)
    v_bytes = tl.load(vc_ptr + page[:, None] * svc_p + within[:, None] * svc_t + kv_head * svc_h + pair[None, :],
                      mask=present[:, None], other=0)  # fmt: skip
    v_param = (
        page[:, None] * svm_p
        + within[:, None] * svm_t
        + kv_head * svm_h
        + (2 * pair // GROUP)[None, :]
    )
    v_min = tl.load(vmin_ptr + v_param, mask=present[:, None], other=0.0).to(tl.float32)
    v_scale = tl.load(vscale_ptr + v_param, mask=present[:, None], other=0.0).to(tl.float32)
    return (
        k_min + k_scale * k_codes.to(tl.float32),
        v_min + v_scale * (v_bytes & 15).to(tl.float32),
        v_min + v_scale * (v_bytes >> 4).to(tl.float32),
    )


@triton.jit
def _row_logits(q16, k_t, first_row, DOT_PRECISION: tl.constexpr):
    """Row 0 of the 16-row broadcast dot: q . k for each key column of k_t [D, N]."""
    s16 = tl.dot(q16, k_t.to(q16.dtype), input_precision=DOT_PRECISION)
    return tl.sum(tl.where(first_row[:, None], s16, 0.0), axis=0)


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
    length are reconstructed in registers (base + the LEVELS - 1 residual levels, dense
    pages directly, compact levels through their map; nothing is written back), later
    rows come from the BF16 paged cache. FP32 online softmax; partial state per split."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP_Q
    d = tl.arange(0, HEAD_DIM)
    half = tl.arange(0, GROUP // 2)
    pair = tl.arange(0, HEAD_DIM // 2)
    q = tl.load(q_ptr + row * stride_qr + head * stride_qh + d)
    q16 = tl.broadcast_to(q[None, :], (16, HEAD_DIM))
    first_row = tl.arange(0, 16) == 0
    length = tl.load(lengths_ptr + row)
    packed = tl.load(packed_ptr + row)
    tables = level_tables_ptr + row * stride_lr
    maps = level_maps_ptr + row * stride_mr
    m_i = float("-inf")
    l_i = 0.0
    acc_even = tl.zeros([16, HEAD_DIM // 2], tl.float32)  # even output channels
    acc_odd = tl.zeros([16, HEAD_DIM // 2], tl.float32)
    first = split * groups_per_split
    for group in range(first, first + groups_per_split):
        pos_even = group * GROUP + 2 * half
        pos_odd = pos_even + 1
        if group * GROUP < packed:
            page = tl.load(tables + group).to(tl.int64)
            k_e, k_o, v_ee, v_eo, v_oe, v_oo = _dense_level(
                kc_ptr, kmin_ptr, kscale_ptr, vc_ptr, vmin_ptr, vscale_ptr, page, kv_head,
                skc_p, skc_h, skc_d, skm_p, skm_h, svc_p, svc_t, svc_h, svm_p, svm_t, svm_h, HEAD_DIM, GROUP,
            )  # fmt: skip
            for level in tl.static_range(1, LEVELS):
                kind = tl.load(level_kinds_ptr + row * stride_kr + level)
                level_table = tables + level * stride_ll
                if kind == 0:
                    page = tl.load(level_table + group).to(tl.int64)
                    r_ke, r_ko, r_ee, r_eo, r_oe, r_oo = _dense_level(
                        kc_ptr, kmin_ptr, kscale_ptr, vc_ptr, vmin_ptr, vscale_ptr, page, kv_head,
                        skc_p, skc_h, skc_d, skm_p, skm_h, svc_p, svc_t, svc_h, svm_p, svm_t, svm_h, HEAD_DIM, GROUP,
                    )  # fmt: skip
                    k_e, k_o = k_e + r_ke, k_o + r_ko
                    v_ee, v_eo, v_oe, v_oo = v_ee + r_ee, v_eo + r_eo, v_oe + r_oe, v_oo + r_oo
                elif kind == COMPACT:
                    rows_e = tl.load(maps + level * stride_ml + pos_even)
                    rows_o = tl.load(maps + level * stride_ml + pos_odd)
                    ge_k, ge_ve, ge_vo = _gathered_level(
                        kc_ptr, kmin_ptr, kscale_ptr, vc_ptr, vmin_ptr, vscale_ptr, level_table, rows_e, kv_head,
                        skc_p, skc_h, skc_d, skm_p, skm_h, svc_p, svc_t, svc_h, svm_p, svm_t, svm_h, HEAD_DIM, GROUP,
                    )  # fmt: skip
                    go_k, go_ve, go_vo = _gathered_level(
                        kc_ptr, kmin_ptr, kscale_ptr, vc_ptr, vmin_ptr, vscale_ptr, level_table, rows_o, kv_head,
                        skc_p, skc_h, skc_d, skm_p, skm_h, svc_p, svc_t, svc_h, svm_p, svm_t, svm_h, HEAD_DIM, GROUP,
                    )  # fmt: skip
                    k_e, k_o = k_e + ge_k, k_o + go_k
                    v_ee, v_eo, v_oe, v_oo = v_ee + ge_ve, v_eo + ge_vo, v_oe + go_ve, v_oo + go_vo
        else:
            k_e, v_ee, v_eo = _bf16_rows(
                k_ptr, v_ptr, tables_ptr, row, group, length, kv_head, 0,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_tr,
                HEAD_DIM, GROUP, BLOCK_SIZE,
            )  # fmt: skip
            k_o, v_oe, v_oo = _bf16_rows(
                k_ptr, v_ptr, tables_ptr, row, group, length, kv_head, 1,
                stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_tr,
                HEAD_DIM, GROUP, BLOCK_SIZE,
            )  # fmt: skip
        s_e = tl.where(
            pos_even < length,
            _row_logits(q16, k_e, first_row, DOT_PRECISION) * scale,
            float("-inf"),
        )
        s_o = tl.where(
            pos_odd < length, _row_logits(q16, k_o, first_row, DOT_PRECISION) * scale, float("-inf")
        )
        m_new = tl.maximum(m_i, tl.maximum(tl.max(s_e, axis=0), tl.max(s_o, axis=0)))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p_e = tl.exp(s_e - m_safe)
        p_o = tl.exp(s_o - m_safe)
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p_e, axis=0) + tl.sum(p_o, axis=0)
        p16_e = tl.where(
            first_row[:, None], tl.broadcast_to(p_e[None, :], (16, GROUP // 2)), 0.0
        ).to(q.dtype)
        p16_o = tl.where(
            first_row[:, None], tl.broadcast_to(p_o[None, :], (16, GROUP // 2)), 0.0
        ).to(q.dtype)
        acc_even = acc_even * alpha + tl.dot(p16_e, v_ee.to(q.dtype), input_precision=DOT_PRECISION)
        acc_even += tl.dot(p16_o, v_oe.to(q.dtype), input_precision=DOT_PRECISION)
        acc_odd = acc_odd * alpha + tl.dot(p16_e, v_eo.to(q.dtype), input_precision=DOT_PRECISION)
        acc_odd += tl.dot(p16_o, v_oo.to(q.dtype), input_precision=DOT_PRECISION)
        m_i = m_new
    out_even = tl.sum(tl.where(first_row[:, None], acc_even, 0.0), axis=0)
    out_odd = tl.sum(tl.where(first_row[:, None], acc_odd, 0.0), axis=0)
    base = part_out_ptr + row * stride_pr + head * stride_ph + split * stride_ps
    tl.store(base + 2 * pair, out_even)
    tl.store(base + 2 * pair + 1, out_odd)
    tl.store(part_max_ptr + row * stride_sr + head * stride_sh + split, m_i)
    tl.store(part_sum_ptr + row * stride_sr + head * stride_sh + split, l_i)
