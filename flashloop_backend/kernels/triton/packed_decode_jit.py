"""Triton code for decode attention over packed INT4 KV (wrapper in ``packed_decode.py``).

No tensor-core dots and no int->float conversion instructions: a decode row is one query
vector, so QK and PV are FP32 multiply-adds with reductions, and each 4-bit code c
becomes the float 1 + c/16 by writing it into the mantissa of 1.0 (integer ops only;
`cvt` runs at a quarter of the FMA rate on Hopper). The affine map is folded around it:
min + scale * c = (min - 16 scale) + 16 scale * (1 + c/16). For K (parameters per
channel across a group) the scale is folded into the query once per group and level, so
a K code costs one multiply-add.

Two codes share a byte (the lower row / channel in the low nibble); nibbles are split
and re-interleaved with ``tl.join`` so every tile is in natural row / channel order.
"""

import triton
import triton.language as tl

COMPACT = tl.constexpr(1)  # level kinds: 0 dense, 1 compact, 2 empty
ONE_BITS = tl.constexpr(0x3F800000)  # float 1.0
NIBBLE_MANTISSA = tl.constexpr(0x00780000)  # a nibble at mantissa bits 19..22: c/16


@triton.jit
def _unit_codes(codes, N: tl.constexpr, M: tl.constexpr):
    """uint8 bytes [N, M/2] -> FP32 1 + c/16 for both nibbles, interleaved: [N, M]."""
    word = codes.to(tl.int32)
    low = (((word << 19) & NIBBLE_MANTISSA) | ONE_BITS).to(tl.float32, bitcast=True)
    high = (((word << 15) & NIBBLE_MANTISSA) | ONE_BITS).to(tl.float32, bitcast=True)
    return tl.reshape(tl.join(low, high), (N, M))


@triton.jit
def _per_channel_group(params, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr):
    """[ROWS, D/G] parameters of V's channel groups broadcast to every channel: [ROWS, D]."""
    spread = tl.broadcast_to(params[:, :, None], (ROWS, HEAD_DIM // GROUP, GROUP))
    return tl.reshape(spread, (ROWS, HEAD_DIM))


@triton.jit
def _dense_logits(q, kc_ptr, kmin_ptr, kscale_ptr, page, kv_head, skc_p, skc_h, skc_d, skm_p, skm_h,
                  HEAD_DIM: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """q . k [G] for the G rows of one dense level page (q [D] FP32, pre-scaled)."""
    ch = tl.arange(0, HEAD_DIM)
    codes = tl.load(kc_ptr + page * skc_p + kv_head * skc_h + ch[:, None] * skc_d
                    + tl.arange(0, GROUP // 2)[None, :])  # fmt: skip
    k_min = tl.load(kmin_ptr + page * skm_p + kv_head * skm_h + ch).to(tl.float32)
    k_scale = tl.load(kscale_ptr + page * skm_p + kv_head * skm_h + ch).to(tl.float32)
    folded = q * (16.0 * k_scale)
    offset = tl.sum(q * (k_min - 16.0 * k_scale), axis=0)
    return offset + tl.sum(folded[:, None] * _unit_codes(codes, HEAD_DIM, GROUP), axis=0)


@triton.jit
def _dense_values(p, vc_ptr, vmin_ptr, vscale_ptr, page, kv_head, svc_p, svc_t, svc_h, svm_p, svm_t, svm_h,
                  HEAD_DIM: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """sum_j p_j v_j [D] over the G rows of one dense level page (p [G] FP32)."""
    rows = tl.arange(0, GROUP)
    codes = tl.load(vc_ptr + page * svc_p + rows[:, None] * svc_t + kv_head * svc_h
                    + tl.arange(0, HEAD_DIM // 2)[None, :])  # fmt: skip
    param = (
        page * svm_p
        + rows[:, None] * svm_t
        + kv_head * svm_h
        + tl.arange(0, HEAD_DIM // GROUP)[None, :]
    )
    v_min = tl.load(vmin_ptr + param).to(tl.float32)
    v_scale = tl.load(vscale_ptr + param).to(tl.float32)
    weight = p[:, None] * 16.0 * v_scale  # [G, D/G]
    offset = p[:, None] * (v_min - 16.0 * v_scale)
    units = _unit_codes(codes, GROUP, HEAD_DIM)
    spread = _per_channel_group(weight, GROUP, HEAD_DIM, GROUP)
    return tl.sum(spread * units + _per_channel_group(offset, GROUP, HEAD_DIM, GROUP), axis=0)


@triton.jit
def _compact_rows(maps, table, pos, GROUP: tl.constexpr):
    """Pages, rows within the page and presence [G] of a compact level's logical rows."""
    rows = tl.load(maps + pos)
    present = rows >= 0
    page = tl.load(table + rows // GROUP, mask=present, other=0).to(tl.int64)
    return page, rows % GROUP, present


@triton.jit
def _compact_logits(q, kc_ptr, kmin_ptr, kscale_ptr, page, within, present, kv_head,
                    skc_p, skc_h, skc_d, skm_p, skm_h, HEAD_DIM: tl.constexpr):  # fmt: skip
    """q . r [G] for residual rows gathered from a compact level (absent rows: 0)."""
    ch = tl.arange(0, HEAD_DIM)
    where = page[None, :] * skc_p + kv_head * skc_h + ch[:, None] * skc_d
    byte = tl.load(kc_ptr + where + (within // 2)[None, :], mask=present[None, :], other=0)
    codes = ((byte.to(tl.int32) >> ((within % 2) * 4)[None, :]) & 15).to(tl.float32)
    param = page[None, :] * skm_p + kv_head * skm_h + ch[:, None]
    k_min = tl.load(kmin_ptr + param, mask=present[None, :], other=0.0).to(tl.float32)
    k_scale = tl.load(kscale_ptr + param, mask=present[None, :], other=0.0).to(tl.float32)
    return tl.sum(q[:, None] * (k_min + k_scale * codes), axis=0)


@triton.jit
def _compact_values(p, vc_ptr, vmin_ptr, vscale_ptr, page, within, present, kv_head,
                    svc_p, svc_t, svc_h, svm_p, svm_t, svm_h,
                    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """sum_j p_j r_j [D] over residual rows gathered from a compact level."""
    row = page[:, None] * svc_p + within[:, None] * svc_t + kv_head * svc_h
    codes = tl.load(
        vc_ptr + row + tl.arange(0, HEAD_DIM // 2)[None, :], mask=present[:, None], other=0
    )
    param = (page[:, None] * svm_p + within[:, None] * svm_t + kv_head * svm_h
             + tl.arange(0, HEAD_DIM // GROUP)[None, :])  # fmt: skip
    v_min = tl.load(vmin_ptr + param, mask=present[:, None], other=0.0).to(tl.float32)
    v_scale = tl.load(vscale_ptr + param, mask=present[:, None], other=0.0).to(tl.float32)
    weight = p[:, None] * 16.0 * v_scale
    offset = p[:, None] * (v_min - 16.0 * v_scale)
    units = _unit_codes(codes, GROUP, HEAD_DIM)  # absent rows: zero parameters, no term
    spread = _per_channel_group(weight, GROUP, HEAD_DIM, GROUP)
    return tl.sum(spread * units + _per_channel_group(offset, GROUP, HEAD_DIM, GROUP), axis=0)


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
    """One (row, query head, split) over groups of GROUP rows: groups below the row's
    packed length are read from the levels (base + the LEVELS - 1 residual levels; dense
    pages directly, compact levels through their map; nothing is written back), later
    groups from the BF16 paged cache. FP32 online softmax; partial state per split."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP_Q
    d = tl.arange(0, HEAD_DIM)
    offs = tl.arange(0, GROUP)
    q = tl.load(q_ptr + row * stride_qr + head * stride_qh + d).to(tl.float32) * scale
    length = tl.load(lengths_ptr + row)
    packed_groups = tl.load(packed_ptr + row) // GROUP
    tables = level_tables_ptr + row * stride_lr
    maps = level_maps_ptr + row * stride_mr
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([HEAD_DIM], tl.float32)
    first = split * groups_per_split
    last = first + groups_per_split
    for group in range(first, tl.minimum(last, packed_groups)):
        pos = group * GROUP + offs
        page = tl.load(tables + group).to(tl.int64)
        s = _dense_logits(q, kc_ptr, kmin_ptr, kscale_ptr, page, kv_head,
                          skc_p, skc_h, skc_d, skm_p, skm_h, HEAD_DIM, GROUP)  # fmt: skip
        for level in tl.static_range(1, LEVELS):
            kind = tl.load(level_kinds_ptr + row * stride_kr + level)
            if kind == 0:
                level_page = tl.load(tables + level * stride_ll + group).to(tl.int64)
                s += _dense_logits(q, kc_ptr, kmin_ptr, kscale_ptr, level_page, kv_head,
                                   skc_p, skc_h, skc_d, skm_p, skm_h, HEAD_DIM, GROUP)  # fmt: skip
            elif kind == COMPACT:
                cpage, within, present = _compact_rows(
                    maps + level * stride_ml, tables + level * stride_ll, pos, GROUP
                )
                s += _compact_logits(q, kc_ptr, kmin_ptr, kscale_ptr, cpage, within, present, kv_head,
                                     skc_p, skc_h, skc_d, skm_p, skm_h, HEAD_DIM)  # fmt: skip
        s = tl.where(pos < length, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe)
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + _dense_values(p, vc_ptr, vmin_ptr, vscale_ptr, page, kv_head,
                                          svc_p, svc_t, svc_h, svm_p, svm_t, svm_h, HEAD_DIM, GROUP)  # fmt: skip
        for level in tl.static_range(1, LEVELS):
            kind = tl.load(level_kinds_ptr + row * stride_kr + level)
            if kind == 0:
                level_page = tl.load(tables + level * stride_ll + group).to(tl.int64)
                acc += _dense_values(p, vc_ptr, vmin_ptr, vscale_ptr, level_page, kv_head,
                                     svc_p, svc_t, svc_h, svm_p, svm_t, svm_h, HEAD_DIM, GROUP)  # fmt: skip
            elif kind == COMPACT:
                cpage, within, present = _compact_rows(
                    maps + level * stride_ml, tables + level * stride_ll, pos, GROUP
                )
                acc += _compact_values(p, vc_ptr, vmin_ptr, vscale_ptr, cpage, within, present, kv_head,
                                       svc_p, svc_t, svc_h, svm_p, svm_t, svm_h, HEAD_DIM, GROUP)  # fmt: skip
        m_i = m_new
    for group in range(tl.maximum(first, packed_groups), last):
        pos = group * GROUP + offs
        visible = pos < length
        page = tl.load(tables_ptr + row * stride_tr + pos // BLOCK_SIZE, mask=visible, other=0)
        slot = page.to(tl.int64)[:, None] * stride_kb + (pos % BLOCK_SIZE)[:, None] * stride_kt
        k = tl.load(
            k_ptr + slot + kv_head * stride_kh + d[None, :], mask=visible[:, None], other=0.0
        )
        s = tl.where(visible, tl.sum(q[None, :] * k.to(tl.float32), axis=1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe)
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        vslot = page.to(tl.int64)[:, None] * stride_vb + (pos % BLOCK_SIZE)[:, None] * stride_vt
        v = tl.load(
            v_ptr + vslot + kv_head * stride_vh + d[None, :], mask=visible[:, None], other=0.0
        )
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m_i = m_new
    base = part_out_ptr + row * stride_pr + head * stride_ph + split * stride_ps
    tl.store(base + d, acc)
    tl.store(part_max_ptr + row * stride_sr + head * stride_sh + split, m_i)
    tl.store(part_sum_ptr + row * stride_sr + head * stride_sh + split, l_i)
