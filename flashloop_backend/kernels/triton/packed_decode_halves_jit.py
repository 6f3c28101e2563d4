"""Design 4 of the packed reader (wrapper in ``packed_decode.py``): like design 3
(``packed_decode_jit``: FP32 multiply-adds, codes through the mantissa of 1.0, K scale
folded into the query) but without ``tl.join`` / ``tl.reshape``: keys are kept as even and
odd rows (the low and high nibbles of K's bytes), V as 3-D tiles [rows, channel groups,
channel pairs] whose parameters broadcast along the last axis, and the output as even and
odd channels [D/G, G/2] until the store.
"""

import triton
import triton.language as tl

COMPACT = tl.constexpr(1)  # level kinds: 0 dense, 1 compact, 2 empty
ONE_BITS = tl.constexpr(0x3F800000)  # float 1.0
NIBBLE_MANTISSA = tl.constexpr(0x00780000)  # a nibble at mantissa bits 19..22: c/16


@triton.jit
def _units(word, SHIFT: tl.constexpr):
    """int32 bytes -> FP32 1 + c/16 of the nibble at bit SHIFT (0 low, 4 high)."""
    return (((word << (19 - SHIFT)) & NIBBLE_MANTISSA) | ONE_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _dense_logits(q, kc_ptr, kmin_ptr, kscale_ptr, page, kv_head, skc_p, skc_h, skc_d, skm_p, skm_h,
                  HEAD_DIM: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """q . k of a dense page's even and odd rows, [G/2] each (q [D] FP32, pre-scaled)."""
    ch = tl.arange(0, HEAD_DIM)
    word = tl.load(kc_ptr + page * skc_p + kv_head * skc_h + ch[:, None] * skc_d
                   + tl.arange(0, GROUP // 2)[None, :]).to(tl.int32)  # fmt: skip
    k_min = tl.load(kmin_ptr + page * skm_p + kv_head * skm_h + ch).to(tl.float32)
    k_scale = tl.load(kscale_ptr + page * skm_p + kv_head * skm_h + ch).to(tl.float32)
    folded = (q * (16.0 * k_scale))[:, None]
    offset = tl.sum(q * (k_min - 16.0 * k_scale), axis=0)
    even = offset + tl.sum(folded * _units(word, 0), axis=0)
    return even, offset + tl.sum(folded * _units(word, 4), axis=0)


@triton.jit
def _value_tiles(vc_ptr, vmin_ptr, vscale_ptr, page, within, present, kv_head, svc_p, svc_t, svc_h,
                 svm_p, svm_t, svm_h, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """V bytes of G/2 rows (page, within [G/2]) as int32 [G/2, D/G, G/2] and their
    parameters [G/2, D/G] (absent rows: zero bytes and parameters)."""
    groups = tl.arange(0, HEAD_DIM // GROUP)
    pairs = tl.arange(0, GROUP // 2)
    row = page * svc_p + within * svc_t + kv_head * svc_h
    byte = groups[None, :, None] * (GROUP // 2) + pairs[None, None, :]
    word = tl.load(vc_ptr + row[:, None, None] + byte, mask=present[:, None, None], other=0)
    param = (page * svm_p + within * svm_t + kv_head * svm_h)[:, None] + groups[None, :]
    v_min = tl.load(vmin_ptr + param, mask=present[:, None], other=0.0).to(tl.float32)
    v_scale = tl.load(vscale_ptr + param, mask=present[:, None], other=0.0).to(tl.float32)
    return word.to(tl.int32), v_min, v_scale


@triton.jit
def _weighted_values(p, word, v_min, v_scale):
    """sum_j p_j v_j of G/2 rows as (even channels, odd channels) [D/G, G/2]."""
    weight = (p[:, None] * 16.0 * v_scale)[:, :, None]
    offset = tl.sum(p[:, None] * (v_min - 16.0 * v_scale), axis=0)[:, None]
    even = offset + tl.sum(weight * _units(word, 0), axis=0)
    return even, offset + tl.sum(weight * _units(word, 4), axis=0)


@triton.jit
def _compact_rows(maps, table, pos, GROUP: tl.constexpr):
    """Pages, rows within the page and presence of a compact level's logical rows pos."""
    rows = tl.load(maps + pos)
    present = rows >= 0
    page = tl.load(table + rows // GROUP, mask=present, other=0).to(tl.int64)
    return page, rows % GROUP, present


@triton.jit
def _compact_logits(q, kc_ptr, kmin_ptr, kscale_ptr, page, within, present, kv_head,
                    skc_p, skc_h, skc_d, skm_p, skm_h, HEAD_DIM: tl.constexpr):  # fmt: skip
    """q . r for residual rows gathered from a compact level (absent rows: 0)."""
    ch = tl.arange(0, HEAD_DIM)
    where = page[None, :] * skc_p + kv_head * skc_h + ch[:, None] * skc_d
    byte = tl.load(kc_ptr + where + (within // 2)[None, :], mask=present[None, :], other=0)
    codes = ((byte.to(tl.int32) >> ((within % 2) * 4)[None, :]) & 15).to(tl.float32)
    param = page[None, :] * skm_p + kv_head * skm_h + ch[:, None]
    k_min = tl.load(kmin_ptr + param, mask=present[None, :], other=0.0).to(tl.float32)
    k_scale = tl.load(kscale_ptr + param, mask=present[None, :], other=0.0).to(tl.float32)
    return tl.sum(q[:, None] * (k_min + k_scale * codes), axis=0)


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
    LEVELS: tl.constexpr,
):  # fmt: skip
    """One (row, query head, split) over groups of GROUP rows, as in design 3: packed
    groups from base + residual levels, later groups from the BF16 paged cache."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP_Q
    d = tl.arange(0, HEAD_DIM)
    half = tl.arange(0, GROUP // 2)
    all_rows = half >= 0
    q = tl.load(q_ptr + row * stride_qr + head * stride_qh + d).to(tl.float32) * scale
    length = tl.load(lengths_ptr + row)
    packed_groups = tl.load(packed_ptr + row) // GROUP
    tables = level_tables_ptr + row * stride_lr
    maps = level_maps_ptr + row * stride_mr
    kinds = level_kinds_ptr + row * stride_kr
    m_i = float("-inf")
    l_i = 0.0
    acc_even = tl.zeros([HEAD_DIM // GROUP, GROUP // 2], tl.float32)
    acc_odd = tl.zeros([HEAD_DIM // GROUP, GROUP // 2], tl.float32)
    first = split * groups_per_split
    last = first + groups_per_split
    for group in range(first, tl.minimum(last, packed_groups)):
        pos_e = group * GROUP + 2 * half
        page = tl.load(tables + group).to(tl.int64)
        s_e, s_o = _dense_logits(q, kc_ptr, kmin_ptr, kscale_ptr, page, kv_head,
                                 skc_p, skc_h, skc_d, skm_p, skm_h, HEAD_DIM, GROUP)  # fmt: skip
        for level in tl.static_range(1, LEVELS):
            kind = tl.load(kinds + level)
            if kind == 0:
                level_page = tl.load(tables + level * stride_ll + group).to(tl.int64)
                r_e, r_o = _dense_logits(q, kc_ptr, kmin_ptr, kscale_ptr, level_page, kv_head,
                                         skc_p, skc_h, skc_d, skm_p, skm_h, HEAD_DIM, GROUP)  # fmt: skip
                s_e += r_e
                s_o += r_o
            elif kind == COMPACT:
                for parity in tl.static_range(2):
                    cpage, within, present = _compact_rows(
                        maps + level * stride_ml, tables + level * stride_ll, pos_e + parity, GROUP
                    )
                    r = _compact_logits(q, kc_ptr, kmin_ptr, kscale_ptr, cpage, within, present, kv_head,
                                        skc_p, skc_h, skc_d, skm_p, skm_h, HEAD_DIM)  # fmt: skip
                    if parity == 0:
                        s_e += r
                    else:
                        s_o += r
        s_e = tl.where(pos_e < length, s_e, float("-inf"))
        s_o = tl.where(pos_e + 1 < length, s_o, float("-inf"))
        m_new = tl.maximum(m_i, tl.maximum(tl.max(s_e, axis=0), tl.max(s_o, axis=0)))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p_e = tl.exp(s_e - m_safe)
        p_o = tl.exp(s_o - m_safe)
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p_e, axis=0) + tl.sum(p_o, axis=0)
        acc_even *= alpha
        acc_odd *= alpha
        for level in tl.static_range(LEVELS):
            kind = tl.load(kinds + level) if level > 0 else 0
            if kind != 2:
                level_table = tables + level * stride_ll
                for parity in tl.static_range(2):
                    p = p_e if parity == 0 else p_o
                    if kind == 0:
                        # as tensors like the compact branch's: the branches must agree
                        vpage = tl.load(level_table + group + 0 * half).to(tl.int64)
                        within, present = 2 * half + parity, all_rows
                    else:
                        vpage, within, present = _compact_rows(
                            maps + level * stride_ml, level_table, pos_e + parity, GROUP
                        )
                    word, v_min, v_scale = _value_tiles(
                        vc_ptr, vmin_ptr, vscale_ptr, vpage, within, present, kv_head,
                        svc_p, svc_t, svc_h, svm_p, svm_t, svm_h, HEAD_DIM, GROUP,
                    )  # fmt: skip
                    even, odd = _weighted_values(p, word, v_min, v_scale)
                    acc_even += even
                    acc_odd += odd
        m_i = m_new
    channel = 2 * (tl.arange(0, HEAD_DIM // GROUP)[:, None] * (GROUP // 2) + half[None, :])
    for group in range(tl.maximum(first, packed_groups), last):
        pos = group * GROUP + tl.arange(0, GROUP)
        visible = pos < length
        page = tl.load(tables_ptr + row * stride_tr + pos // BLOCK_SIZE, mask=visible, other=0)
        slot = page.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        k = tl.load(k_ptr + slot[:, None] + d[None, :], mask=visible[:, None], other=0.0)
        s = tl.where(visible, tl.sum(q[None, :] * k.to(tl.float32), axis=1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe)
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        vslot = page.to(tl.int64) * stride_vb + (pos % BLOCK_SIZE) * stride_vt + kv_head * stride_vh
        v_ptrs = v_ptr + vslot[:, None, None] + channel[None, :, :]
        v_even = tl.load(v_ptrs, mask=visible[:, None, None], other=0.0).to(tl.float32)
        v_odd = tl.load(v_ptrs + 1, mask=visible[:, None, None], other=0.0).to(tl.float32)
        acc_even = acc_even * alpha + tl.sum(p[:, None, None] * v_even, axis=0)
        acc_odd = acc_odd * alpha + tl.sum(p[:, None, None] * v_odd, axis=0)
        m_i = m_new
    base = part_out_ptr + row * stride_pr + head * stride_ph + split * stride_ps
    tl.store(base + channel, acc_even)
    tl.store(base + channel + 1, acc_odd)
    tl.store(part_max_ptr + row * stride_sr + head * stride_sh + split, m_i)
    tl.store(part_sum_ptr + row * stride_sr + head * stride_sh + split, l_i)
