"""Triton code for decode attention over packed INT4 KV (wrapper in ``packed_decode.py``).

A decode row is one query vector, so QK and PV are multiply-adds with reductions, and the
page layout (``kv.store``) pairs codes along the reduced axis: a K byte holds two channels
of a row, a V byte two rows of a channel. Each thread therefore sums its own bytes before
any shuffle. K's per-channel scale is folded into the query once per page, V's per-row
scale into p, and no code goes through an int-to-float convert (a quarter of the FMA rate
on Hopper). Plain reads (HALF) take exact FP16 codes c and 16 c from ``exact_nibbles`` and
multiply them by FP16 folded weights in packed-half products, each converted to FP32
before the sum. Reads feeding the exact top-K (selection statistics, selected marks) stay
in FP32: a code c becomes 1 + c/16 by writing it into the mantissa of 1.0, and the affine
map is folded around it: min + scale * c = (min - 16 scale) + 16 scale (1 + c/16).

Tiles: K of a page as its even and odd rows [G/2, D/2] (p comes out split the same way,
which is what V's row pairs need); V as [D/G, G, G/2] (channel group, channel, row pair);
the output as [D/G, G] (channel g * G + c).
"""

import triton
import triton.language as tl

from flashloop_backend.kernels.triton.nibbles_jit import exact_nibbles
from flashloop_backend.kernels.triton.specialization import (
    PACKED_SPLIT_METADATA,
    SCALAR_PER_ROW,
)
from flashloop_backend.kv.levels import LevelKind

COMPACT = tl.constexpr(int(LevelKind.COMPACT))
ONE_BITS = tl.constexpr(0x3F800000)  # float 1.0
NIBBLE_MANTISSA = tl.constexpr(0x00780000)  # a nibble at mantissa bits 19..22: c/16


@triton.jit
def _units(word, SHIFT: tl.constexpr):
    """int32 bytes -> FP32 1 + c/16 of the nibble at bit SHIFT (0 low, 4 high)."""
    return (((word << (19 - SHIFT)) & NIBBLE_MANTISSA) | ONE_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _folded_query(
    q_e, q_o, kmin_ptr, kscale_ptr, page, kv_head, skm_p, skm_h, HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
):  # fmt: skip
    """K's parameters of one page folded into the query, for even and odd channels [D/2]
    and a constant: FP32 16 q scale and sum q (min - 16 scale) (the 1 + c/16 form), or
    (HALF) FP16 q scale and q scale / 16 and sum q min (exact codes c and 16 c)."""
    pair = tl.arange(0, HEAD_DIM // 2)
    where = page * skm_p + kv_head * skm_h + 2 * pair
    min_e = tl.load(kmin_ptr + where).to(tl.float32)
    min_o = tl.load(kmin_ptr + where + 1).to(tl.float32)
    scale_e = tl.load(kscale_ptr + where).to(tl.float32)
    scale_o = tl.load(kscale_ptr + where + 1).to(tl.float32)
    if HALF:
        offset = tl.sum(q_e * min_e + q_o * min_o, axis=0)
        fold_e = (q_e * scale_e).to(tl.float16)
        fold_o = (q_o * scale_o / 16.0).to(tl.float16)
    else:
        offset = tl.sum(q_e * (min_e - 16.0 * scale_e) + q_o * (min_o - 16.0 * scale_o), axis=0)
        fold_e = 16.0 * q_e * scale_e
        fold_o = 16.0 * q_o * scale_o
    return fold_e, fold_o, offset


@triton.jit
def _dense_logits(
    fold_e,
    fold_o,
    offset,
    kc_ptr,
    page,
    kv_head,
    first,
    parity,
    skc_p,
    skc_t,
    skc_h,
    HEAD_DIM: tl.constexpr,
    ROWS: tl.constexpr,
    HALF: tl.constexpr,
    ASM: tl.constexpr,
):
    """q . k [ROWS/2] of a dense page's rows first + 2 r + parity (``fold_*`` and
    ``offset`` from :func:`_folded_query` with the same HALF)."""
    rows = first + 2 * tl.arange(0, ROWS // 2) + parity
    byte = tl.load(
        kc_ptr
        + page * skc_p
        + rows[:, None] * skc_t
        + kv_head * skc_h
        + tl.arange(0, HEAD_DIM // 2)[None, :]
    )
    if HALF:  # FP16 products q scale c and q scale / 16 * 16 c, summed in FP32
        low, high = exact_nibbles(byte, ASM)
        terms = (low * fold_e[None, :] + high * fold_o[None, :]).to(tl.float32)
    else:
        word = byte.to(tl.int32)
        terms = fold_e[None, :] * _units(word, 0) + fold_o[None, :] * _units(word, 4)
    return offset + tl.sum(terms, axis=1)


@triton.jit
def _dense_values(
    p_e,
    p_o,
    vc_ptr,
    vmin_ptr,
    vscale_ptr,
    page,
    kv_head,
    first,
    svc_p,
    svc_h,
    svc_d,
    svm_p,
    svm_t,
    svm_h,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,
    HALF: tl.constexpr,
    ASM: tl.constexpr,
):
    """sum_t p_t v_t [D/G, G] over a dense page's rows first .. first + ROWS (p_e, p_o
    [ROWS/2]: even, odd rows; ``first`` even)."""
    groups = tl.arange(0, HEAD_DIM // GROUP)
    pairs = first // 2 + tl.arange(0, ROWS // 2)
    channel = groups[:, None, None] * GROUP + tl.arange(0, GROUP)[None, :, None]
    byte = tl.load(vc_ptr + page * svc_p + kv_head * svc_h + channel * svc_d + pairs[None, None, :])
    param = page * svm_p + (2 * pairs)[None, :] * svm_t + kv_head * svm_h + groups[:, None]
    min_e = tl.load(vmin_ptr + param).to(tl.float32)  # [D/G, G/2]
    min_o = tl.load(vmin_ptr + param + svm_t).to(tl.float32)
    scale_e = tl.load(vscale_ptr + param).to(tl.float32)
    scale_o = tl.load(vscale_ptr + param + svm_t).to(tl.float32)
    if HALF:  # FP16 products p scale c and p scale / 16 * 16 c, summed in FP32
        low, high = exact_nibbles(byte, ASM)
        weight_e = (p_e[None, :] * scale_e).to(tl.float16)[:, None, :]
        weight_o = (p_o[None, :] * scale_o / 16.0).to(tl.float16)[:, None, :]
        offset = tl.sum(p_e[None, :] * min_e + p_o[None, :] * min_o, axis=1)
        terms = (low * weight_e + high * weight_o).to(tl.float32)
    else:
        word = byte.to(tl.int32)
        weight_e = (16.0 * p_e[None, :] * scale_e)[:, None, :]
        weight_o = (16.0 * p_o[None, :] * scale_o)[:, None, :]
        offset = tl.sum(
            p_e[None, :] * (min_e - 16.0 * scale_e) + p_o[None, :] * (min_o - 16.0 * scale_o),
            axis=1,
        )
        terms = weight_e * _units(word, 0) + weight_o * _units(word, 4)
    return offset[:, None] + tl.sum(terms, axis=2)


@triton.jit
def _compact_rows(maps, table, pos, GROUP: tl.constexpr):
    """Pages, rows within the page and presence of a compact level's logical rows pos."""
    rows = tl.load(maps + pos)
    present = rows >= 0
    page = tl.load(table + rows // GROUP, mask=present, other=0).to(tl.int64)
    return page, rows % GROUP, present


@triton.jit
def _compact_logits(
    q_e,
    q_o,
    kc_ptr,
    kmin_ptr,
    kscale_ptr,
    page,
    within,
    present,
    kv_head,
    skc_p,
    skc_t,
    skc_h,
    skm_p,
    skm_h,
    HEAD_DIM: tl.constexpr,
):
    """q . r for residual rows gathered from a compact level (absent rows: 0)."""
    pair = tl.arange(0, HEAD_DIM // 2)[None, :]
    word = tl.load(
        kc_ptr + (page * skc_p + within * skc_t + kv_head * skc_h)[:, None] + pair,
        mask=present[:, None],
        other=0,
    ).to(tl.int32)
    param = (page * skm_p + kv_head * skm_h)[:, None] + 2 * pair
    min_e = tl.load(kmin_ptr + param, mask=present[:, None], other=0.0).to(tl.float32)
    min_o = tl.load(kmin_ptr + param + 1, mask=present[:, None], other=0.0).to(tl.float32)
    scale_e = tl.load(kscale_ptr + param, mask=present[:, None], other=0.0).to(tl.float32)
    scale_o = tl.load(kscale_ptr + param + 1, mask=present[:, None], other=0.0).to(tl.float32)
    k_e = min_e + scale_e * (word & 15).to(tl.float32)
    k_o = min_o + scale_o * (word >> 4).to(tl.float32)
    return tl.sum(q_e[None, :] * k_e + q_o[None, :] * k_o, axis=1)


@triton.jit
def _compact_values(
    p,
    vc_ptr,
    vmin_ptr,
    vscale_ptr,
    page,
    within,
    present,
    kv_head,
    svc_p,
    svc_h,
    svc_d,
    svm_p,
    svm_t,
    svm_h,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
):
    """sum_j p_j r_j [D/G, G] over residual rows gathered from a compact level."""
    groups = tl.arange(0, HEAD_DIM // GROUP)
    channel = groups[:, None, None] * GROUP + tl.arange(0, GROUP)[None, :, None]
    row = (page * svc_p + kv_head * svc_h + within // 2)[None, None, :]
    word = tl.load(vc_ptr + row + channel * svc_d, mask=present[None, None, :], other=0)
    codes = ((word.to(tl.int32) >> ((within % 2) * 4)[None, None, :]) & 15).to(tl.float32)
    param = (page * svm_p + within * svm_t + kv_head * svm_h)[None, :] + groups[:, None]
    v_min = tl.load(vmin_ptr + param, mask=present[None, :], other=0.0).to(tl.float32)
    v_scale = tl.load(vscale_ptr + param, mask=present[None, :], other=0.0).to(tl.float32)
    values = v_min[:, None, :] + v_scale[:, None, :] * codes
    return tl.sum(p[None, None, :] * values, axis=2)


@triton.jit(do_not_specialize=PACKED_SPLIT_METADATA, do_not_specialize_on_alignment=SCALAR_PER_ROW)
def packed_decode_split_kernel(
    q_ptr,
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
    lengths_ptr,
    part_out_ptr,
    part_max_ptr,
    part_sum_ptr,
    logits_ptr,
    selected_ptr,
    scale,
    stride_qr,
    stride_qh,
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
    stride_sr,
    stride_sh,
    stride_gr,
    stride_gh,
    stride_xr,
    stride_xh,
    groups_per_split,
    GROUP_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    LEVELS: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    ROWS: tl.constexpr,
    SELECTED: tl.constexpr,
    HALF: tl.constexpr,
    ASM: tl.constexpr,
):
    """One (row, query head, split) over groups of GROUP rows, ROWS rows per step (fewer
    rows per step: smaller tiles, fewer registers per thread): groups below the row's
    packed length are read from the levels (base + the LEVELS - 1 residual levels; dense
    pages directly, compact levels through their map; nothing is written back), later
    groups from the BF16 paged cache. FP32 online softmax; partial state per split.
    STORE_LOGITS: every visible key's scaled logit goes to ``logits`` [R, Hq, T] too.
    SELECTED: only positions marked in ``selected`` [R, Hq, T] uint8 take part (the loop
    3-4 correction streamed over whole pages instead of gathered per selected key)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP_Q
    query = q_ptr + row * stride_qr + head * stride_qh
    pair = tl.arange(0, HEAD_DIM // 2)
    q_e = tl.load(query + 2 * pair).to(tl.float32) * scale
    q_o = tl.load(query + 2 * pair + 1).to(tl.float32) * scale
    length = tl.load(lengths_ptr + row)
    packed_groups = tl.load(packed_ptr + row) // GROUP
    tables = level_tables_ptr + row * stride_lr
    maps = level_maps_ptr + row * stride_mr
    kinds = level_kinds_ptr + row * stride_kr
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([HEAD_DIM // GROUP, GROUP], tl.float32)
    first = split * groups_per_split
    # groups past the row's length hold no visible key: a row routed to another op (length
    # 0) costs its programs nothing instead of a read of its whole packed history
    last = tl.minimum(first + groups_per_split, tl.cdiv(length, GROUP))
    for step in range(first * (GROUP // ROWS), tl.minimum(last, packed_groups) * (GROUP // ROWS)):
        group = step // (GROUP // ROWS)
        row0 = (step % (GROUP // ROWS)) * ROWS  # the step's first row in its group
        pos_e = group * GROUP + row0 + 2 * tl.arange(0, ROWS // 2)
        page = tl.load(tables + group).to(tl.int64)
        fold_e, fold_o, offset = _folded_query(
            q_e, q_o, kmin_ptr, kscale_ptr, page, kv_head, skm_p, skm_h, HEAD_DIM, HALF
        )
        s_e = _dense_logits(
            fold_e,
            fold_o,
            offset,
            kc_ptr,
            page,
            kv_head,
            row0,
            0,
            skc_p,
            skc_t,
            skc_h,
            HEAD_DIM,
            ROWS,
            HALF,
            ASM,
        )
        s_o = _dense_logits(
            fold_e,
            fold_o,
            offset,
            kc_ptr,
            page,
            kv_head,
            row0,
            1,
            skc_p,
            skc_t,
            skc_h,
            HEAD_DIM,
            ROWS,
            HALF,
            ASM,
        )
        for level in tl.static_range(1, LEVELS):
            kind = tl.load(kinds + level)
            table = tables + level * stride_ll
            if kind == 0:
                lpage = tl.load(table + group).to(tl.int64)
                fold_e, fold_o, offset = _folded_query(
                    q_e, q_o, kmin_ptr, kscale_ptr, lpage, kv_head, skm_p, skm_h, HEAD_DIM, HALF
                )
                s_e += _dense_logits(
                    fold_e,
                    fold_o,
                    offset,
                    kc_ptr,
                    lpage,
                    kv_head,
                    row0,
                    0,
                    skc_p,
                    skc_t,
                    skc_h,
                    HEAD_DIM,
                    ROWS,
                    HALF,
                    ASM,
                )
                s_o += _dense_logits(
                    fold_e,
                    fold_o,
                    offset,
                    kc_ptr,
                    lpage,
                    kv_head,
                    row0,
                    1,
                    skc_p,
                    skc_t,
                    skc_h,
                    HEAD_DIM,
                    ROWS,
                    HALF,
                    ASM,
                )
            elif kind == COMPACT:
                cpage, within, present = _compact_rows(
                    maps + level * stride_ml, table, pos_e, GROUP
                )
                s_e += _compact_logits(
                    q_e,
                    q_o,
                    kc_ptr,
                    kmin_ptr,
                    kscale_ptr,
                    cpage,
                    within,
                    present,
                    kv_head,
                    skc_p,
                    skc_t,
                    skc_h,
                    skm_p,
                    skm_h,
                    HEAD_DIM,
                )
                cpage, within, present = _compact_rows(
                    maps + level * stride_ml, table, pos_e + 1, GROUP
                )
                s_o += _compact_logits(
                    q_e,
                    q_o,
                    kc_ptr,
                    kmin_ptr,
                    kscale_ptr,
                    cpage,
                    within,
                    present,
                    kv_head,
                    skc_p,
                    skc_t,
                    skc_h,
                    skm_p,
                    skm_h,
                    HEAD_DIM,
                )
        s_e = tl.where(pos_e < length, s_e, float("-inf"))
        s_o = tl.where(pos_e + 1 < length, s_o, float("-inf"))
        if SELECTED:
            marks = selected_ptr + row * stride_xr + head * stride_xh + pos_e
            s_e = tl.where(tl.load(marks, mask=pos_e < length, other=0) != 0, s_e, float("-inf"))
            s_o = tl.where(
                tl.load(marks + 1, mask=pos_e + 1 < length, other=0) != 0, s_o, float("-inf")
            )
        if STORE_LOGITS:
            logits_row = logits_ptr + row * stride_gr + head * stride_gh
            tl.store(logits_row + pos_e, s_e, mask=pos_e < length)
            tl.store(logits_row + pos_e + 1, s_o, mask=pos_e + 1 < length)
        m_new = tl.maximum(m_i, tl.maximum(tl.max(s_e, axis=0), tl.max(s_o, axis=0)))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p_e = tl.exp(s_e - m_safe)
        p_o = tl.exp(s_o - m_safe)
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p_e, axis=0) + tl.sum(p_o, axis=0)
        acc = acc * alpha + _dense_values(
            p_e,
            p_o,
            vc_ptr,
            vmin_ptr,
            vscale_ptr,
            page,
            kv_head,
            row0,
            svc_p,
            svc_h,
            svc_d,
            svm_p,
            svm_t,
            svm_h,
            HEAD_DIM,
            GROUP,
            ROWS,
            HALF,
            ASM,
        )
        for level in tl.static_range(1, LEVELS):
            kind = tl.load(kinds + level)
            table = tables + level * stride_ll
            if kind == 0:
                lpage = tl.load(table + group).to(tl.int64)
                acc += _dense_values(
                    p_e,
                    p_o,
                    vc_ptr,
                    vmin_ptr,
                    vscale_ptr,
                    lpage,
                    kv_head,
                    row0,
                    svc_p,
                    svc_h,
                    svc_d,
                    svm_p,
                    svm_t,
                    svm_h,
                    HEAD_DIM,
                    GROUP,
                    ROWS,
                    HALF,
                    ASM,
                )
            elif kind == COMPACT:
                cpage, within, present = _compact_rows(
                    maps + level * stride_ml, table, pos_e, GROUP
                )
                acc += _compact_values(
                    p_e,
                    vc_ptr,
                    vmin_ptr,
                    vscale_ptr,
                    cpage,
                    within,
                    present,
                    kv_head,
                    svc_p,
                    svc_h,
                    svc_d,
                    svm_p,
                    svm_t,
                    svm_h,
                    HEAD_DIM,
                    GROUP,
                )
                cpage, within, present = _compact_rows(
                    maps + level * stride_ml, table, pos_e + 1, GROUP
                )
                acc += _compact_values(
                    p_o,
                    vc_ptr,
                    vmin_ptr,
                    vscale_ptr,
                    cpage,
                    within,
                    present,
                    kv_head,
                    svc_p,
                    svc_h,
                    svc_d,
                    svm_p,
                    svm_t,
                    svm_h,
                    HEAD_DIM,
                    GROUP,
                )
        m_i = m_new
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(query + d).to(tl.float32) * scale
    channel = tl.arange(0, HEAD_DIM // GROUP)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    for step in range(tl.maximum(first, packed_groups) * (GROUP // ROWS), last * (GROUP // ROWS)):
        pos = step * ROWS + tl.arange(0, ROWS)
        visible = pos < length
        page = tl.load(tables_ptr + row * stride_tr + pos // BLOCK_SIZE, mask=visible, other=0).to(
            tl.int64
        )
        slot = page * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        k = tl.load(k_ptr + slot[:, None] + d[None, :], mask=visible[:, None], other=0.0)
        s = tl.where(visible, tl.sum(q[None, :] * k.to(tl.float32), axis=1), float("-inf"))
        if SELECTED:
            mark = tl.load(
                selected_ptr + row * stride_xr + head * stride_xh + pos, mask=visible, other=0
            )
            s = tl.where(mark != 0, s, float("-inf"))
        if STORE_LOGITS:
            tl.store(logits_ptr + row * stride_gr + head * stride_gh + pos, s, mask=visible)
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe)
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        vslot = page * stride_vb + (pos % BLOCK_SIZE) * stride_vt + kv_head * stride_vh
        v = tl.load(
            v_ptr + vslot[:, None, None] + channel[None, :, :],
            mask=visible[:, None, None],
            other=0.0,
        )
        acc = acc * alpha + tl.sum(p[:, None, None] * v.to(tl.float32), axis=0)
        m_i = m_new
    tl.store(part_out_ptr + row * stride_pr + head * stride_ph + split * stride_ps + channel, acc)
    tl.store(part_max_ptr + row * stride_sr + head * stride_sh + split, m_i)
    tl.store(part_sum_ptr + row * stride_sr + head * stride_sh + split, l_i)
