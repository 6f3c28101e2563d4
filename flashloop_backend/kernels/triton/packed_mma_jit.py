"""Triton code for decode attention over packed INT4 KV on tensor cores (wrapper in
``packed_decode.py``, which picks it for plain decode reads).

A code never becomes a float on its own: one ``lop3`` writes a nibble pair into the
mantissa of FP16 1024 (``0x6400``), giving 1024 + c for a low nibble and 1024 + 16 c for a
high one, and the dot does the rest. Everything affine is folded into the other operand
(FP16, one row per mma row): q . dequant(K) over a page is sum_d (q_d scale_d / f_d) codes_d
+ sum_d q_d min_d with f_d = 16 on the odd (high-nibble) channels, and the 1024 of every
code is taken back as 1024 times the sum of the FP16 operand it met (exact: each FP16
product is exact in the FP32 accumulator). V folds its per-row scale into p the same way.

The mma tile has 16 rows and a decode row needs one, so the rows are put to use: every row
holds the same query (the logits, max and sum agree row for row) and row g of the P operand
carries V's channel group g (its per-row scale differs by group); row g of the output is
read for the channels of group g (at most 16 groups).

Tiles: K codes of a page [G, D/2] (byte: channels 2j, 2j + 1 of a row) become [G, D]; V
codes [D, G/2] (byte: rows 2r, 2r + 1 of a channel) become [D, G].
"""

import triton
import triton.language as tl

from flashloop_backend.kv.levels import LevelKind

COMPACT = tl.constexpr(int(LevelKind.COMPACT))
MMA_ROWS = tl.constexpr(16)
MAGIC = tl.constexpr(1024.0)

# Four bytes -> eight FP16 values 1024 + code (low nibbles, $0-$1) and 1024 + 16 code
# (high nibbles, $2-$3), element i from byte i: a prmt spreads bytes 0-1 and 2-3 over the
# two halves of a word first, so that no element depends on how Triton groups them.
NIBBLES_ASM = tl.constexpr("""
{
.reg .b32 pair01, pair23, zero;
mov.b32 zero, 0;
prmt.b32 pair01, $4, zero, 0x4140;
prmt.b32 pair23, $4, zero, 0x4342;
lop3.b32 $0, pair01, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $1, pair23, 0x000F000F, 0x64006400, 0xEA;
lop3.b32 $2, pair01, 0x00F000F0, 0x64006400, 0xEA;
lop3.b32 $3, pair23, 0x00F000F0, 0x64006400, 0xEA;
}
""")


@triton.jit
def _nibbles(byte, ASM: tl.constexpr):
    """uint8 codes -> FP16 (1024 + low nibble, 1024 + 16 high nibble), same shape."""
    if ASM:
        low, high = tl.inline_asm_elementwise(
            NIBBLES_ASM,
            "=r,=r,=r,=r,r",
            [byte],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
    else:  # the interpreter runs no PTX; the same exact values
        low = (byte & 15).to(tl.float16) + MAGIC
        high = (byte >> 4).to(tl.float16) * 16.0 + MAGIC
    return low, high


@triton.jit
def _halves(x, M: tl.constexpr, N: tl.constexpr):
    """[M, N] -> its even and odd columns [M, N/2]."""
    return tl.split(tl.reshape(x, (M, N // 2, 2)))


@triton.jit
def _key_dot(q, low, high, kmin_ptr, kscale_ptr, page, kv_head, skm_p, skm_h, HEAD_DIM: tl.constexpr):
    """q . dequant(K) [16, G] (every row the same) of magic-form K codes of a page, even
    channels ``low`` and odd channels ``high`` [G, D/2], with ``page``'s K parameters."""
    d = tl.arange(0, HEAD_DIM)
    where = page * skm_p + kv_head * skm_h + d
    k_scale = tl.load(kscale_ptr + where).to(tl.float32)
    k_min = tl.load(kmin_ptr + where).to(tl.float32)
    folded = (q * k_scale * tl.where(d % 2 == 1, 1.0 / 16.0, 1.0)).to(tl.float16)
    offset = tl.sum(q * k_min - MAGIC * folded.to(tl.float32), axis=0)
    a = tl.broadcast_to(folded[None, :], (MMA_ROWS, HEAD_DIM))
    a_even, a_odd = _halves(a, MMA_ROWS, HEAD_DIM)
    return tl.dot(a_even, tl.trans(low), tl.dot(a_odd, tl.trans(high))) + offset


@triton.jit
def _dense_logits(
    q, kc_ptr, kmin_ptr, kscale_ptr, page, kv_head, skc_p, skc_t, skc_h, skm_p, skm_h,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """q . k [16, G] over a dense page's rows."""
    byte = tl.load(
        kc_ptr
        + page * skc_p
        + kv_head * skc_h
        + tl.arange(0, GROUP)[:, None] * skc_t
        + tl.arange(0, HEAD_DIM // 2)[None, :]
    )
    low, high = _nibbles(byte, ASM)
    return _key_dot(q, low, high, kmin_ptr, kscale_ptr, page, kv_head, skm_p, skm_h, HEAD_DIM)


@triton.jit
def _compact_logits(
    q, kc_ptr, kmin_ptr, kscale_ptr, table, rows, kv_head, skc_p, skc_t, skc_h, skm_p, skm_h,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """q . r [16, G] of residual rows gathered from a compact level (rows [G]: compact row
    per logical row, -1 absent: 0). A group's compact rows are consecutive, so they lie on
    at most two pages: both pages' parameters are folded, each column keeps its page's."""
    present = rows >= 0
    first = tl.min(tl.where(present, rows, 2147483647), axis=0) // GROUP
    last = tl.max(rows, axis=0) // GROUP
    some = last >= 0
    page_a = tl.load(table + first, mask=some, other=0).to(tl.int64)
    page_b = tl.load(table + last, mask=some, other=0).to(tl.int64)
    on_a = rows // GROUP == first
    page = tl.where(on_a, page_a, page_b)
    byte = tl.load(
        kc_ptr
        + (page * skc_p + (rows % GROUP) * skc_t + kv_head * skc_h)[:, None]
        + tl.arange(0, HEAD_DIM // 2)[None, :],
        mask=present[:, None],
        other=0,
    )
    low, high = _nibbles(byte, ASM)
    s_a = _key_dot(q, low, high, kmin_ptr, kscale_ptr, page_a, kv_head, skm_p, skm_h, HEAD_DIM)
    s_b = _key_dot(q, low, high, kmin_ptr, kscale_ptr, page_b, kv_head, skm_p, skm_h, HEAD_DIM)
    return tl.where(present[None, :], tl.where(on_a[None, :], s_a, s_b), 0.0)


@triton.jit
def _value_params(vmin_ptr, vscale_ptr, where, take):
    """V's (min, scale) [16, G] FP32 at offsets ``where`` (row g: channel group g)."""
    v_min = tl.load(vmin_ptr + where, mask=take, other=0.0).to(tl.float32)
    v_scale = tl.load(vscale_ptr + where, mask=take, other=0.0).to(tl.float32)
    return v_min, v_scale


@triton.jit
def _dense_values(
    p, vc_ptr, vmin_ptr, vscale_ptr, page, kv_head, svc_p, svc_h, svc_d, svm_p, svm_t, svm_h,
    HEAD_DIM: tl.constexpr, GROUP: tl.constexpr, ASM: tl.constexpr,
):  # fmt: skip
    """p V [16, D] over a dense page's rows (row g right for channel group g)."""
    byte = tl.load(
        vc_ptr
        + page * svc_p
        + kv_head * svc_h
        + tl.arange(0, HEAD_DIM)[:, None] * svc_d
        + tl.arange(0, GROUP // 2)[None, :]
    )
    low, high = _nibbles(byte, ASM)  # [D, G/2]: rows 2r and 2r + 1
    t = tl.arange(0, GROUP)
    lane = tl.arange(0, MMA_ROWS)[:, None]
    v_min = tl.zeros([MMA_ROWS, GROUP], tl.float32)
    v_scale = tl.zeros([MMA_ROWS, GROUP], tl.float32)
    for g in tl.static_range(HEAD_DIM // GROUP):  # one row per channel group
        where = page * svm_p + t * svm_t + kv_head * svm_h + g
        v_min = tl.where(lane == g, tl.load(vmin_ptr + where).to(tl.float32)[None, :], v_min)
        v_scale = tl.where(lane == g, tl.load(vscale_ptr + where).to(tl.float32)[None, :], v_scale)
    a = (p * v_scale * tl.where(t % 2 == 1, 1.0 / 16.0, 1.0)[None, :]).to(tl.float16)
    offset = tl.sum(p * v_min - MAGIC * a.to(tl.float32), axis=1)
    a_even, a_odd = _halves(a, MMA_ROWS, GROUP)
    return tl.dot(a_even, tl.trans(low), tl.dot(a_odd, tl.trans(high))) + offset[:, None]


@triton.jit
def _compact_values(
    p, vc_ptr, vmin_ptr, vscale_ptr, table, rows, kv_head, svc_p, svc_h, svc_d, svm_p, svm_t,
    svm_h, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """p R [16, D] over residual rows gathered from a compact level (rows as in
    :func:`_compact_logits`); a gathered row's code is a nibble of its own byte."""
    present = rows >= 0
    page = tl.load(table + rows // GROUP, mask=present, other=0).to(tl.int64)
    within = rows % GROUP
    byte = tl.load(
        vc_ptr
        + (page * svc_p + kv_head * svc_h + within // 2)[None, :]
        + tl.arange(0, HEAD_DIM)[:, None] * svc_d,
        mask=present[None, :],
        other=0,
    )
    codes = ((byte.to(tl.int32) >> ((within % 2) * 4)[None, :]) & 15).to(tl.float16)
    lane = tl.arange(0, MMA_ROWS)[:, None]
    where = (page * svm_p + within * svm_t + kv_head * svm_h)[None, :] + lane
    take = (lane < HEAD_DIM // GROUP) & present[None, :]
    v_min, v_scale = _value_params(vmin_ptr, vscale_ptr, where, take)
    a = (p * v_scale).to(tl.float16)
    return tl.dot(a, tl.trans(codes)) + tl.sum(p * v_min, axis=1)[:, None]


@triton.jit
def packed_mma_split_kernel(
    q_ptr, kc_ptr, kmin_ptr, kscale_ptr, vc_ptr, vmin_ptr, vscale_ptr,
    level_tables_ptr, level_maps_ptr, level_kinds_ptr, packed_ptr,
    k_ptr, v_ptr, tables_ptr, lengths_ptr, part_out_ptr, part_max_ptr, part_sum_ptr,
    scale, stride_qr, stride_qh,
    skc_p, skc_t, skc_h, skm_p, skm_h, svc_p, svc_h, svc_d, svm_p, svm_t, svm_h,
    stride_lr, stride_ll, stride_mr, stride_ml, stride_kr,
    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_tr,
    stride_pr, stride_ph, stride_ps, stride_sr, stride_sh, groups_per_split,
    GROUP_Q: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, LEVELS: tl.constexpr, ASM: tl.constexpr,
    TAIL_PRECISION: tl.constexpr,
):  # fmt: skip
    """One (row, query head, split) over groups of G rows, a group per step: groups below
    the row's packed length from the levels (base + LEVELS - 1 residual levels, dense
    pages directly, compact levels through their map), later groups from the BF16 paged
    cache. FP32 online softmax; partial state per split (``merge_splits``)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP_Q
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, GROUP)
    lane = tl.arange(0, MMA_ROWS)
    query = q_ptr + row * stride_qr + head * stride_qh
    q = tl.load(query + d).to(tl.float32) * scale
    length = tl.load(lengths_ptr + row)
    packed_groups = tl.load(packed_ptr + row) // GROUP
    tables = level_tables_ptr + row * stride_lr
    maps = level_maps_ptr + row * stride_mr
    kinds = level_kinds_ptr + row * stride_kr
    m_i = tl.full([MMA_ROWS], float("-inf"), tl.float32)
    l_i = tl.zeros([MMA_ROWS], tl.float32)
    acc = tl.zeros([MMA_ROWS, HEAD_DIM], tl.float32)
    first = split * groups_per_split
    # a row routed to another op (length 0) costs its programs nothing
    last = tl.minimum(first + groups_per_split, tl.cdiv(length, GROUP))
    for group in range(first, tl.minimum(last, packed_groups)):
        pos = group * GROUP + t
        page = tl.load(tables + group).to(tl.int64)
        s = _dense_logits(
            q, kc_ptr, kmin_ptr, kscale_ptr, page, kv_head, skc_p, skc_t, skc_h, skm_p, skm_h,
            HEAD_DIM, GROUP, ASM,
        )  # fmt: skip
        for level in tl.static_range(1, LEVELS):
            kind = tl.load(kinds + level)
            table = tables + level * stride_ll
            if kind == 0:
                s += _dense_logits(
                    q, kc_ptr, kmin_ptr, kscale_ptr, tl.load(table + group).to(tl.int64),
                    kv_head, skc_p, skc_t, skc_h, skm_p, skm_h, HEAD_DIM, GROUP, ASM,
                )  # fmt: skip
            elif kind == COMPACT:
                s += _compact_logits(
                    q, kc_ptr, kmin_ptr, kscale_ptr, table, tl.load(maps + level * stride_ml + pos),
                    kv_head, skc_p, skc_t, skc_h, skm_p, skm_h, HEAD_DIM, GROUP, ASM,
                )  # fmt: skip
        s = tl.where((pos < length)[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + _dense_values(
            p, vc_ptr, vmin_ptr, vscale_ptr, page, kv_head, svc_p, svc_h, svc_d, svm_p, svm_t,
            svm_h, HEAD_DIM, GROUP, ASM,
        )  # fmt: skip
        for level in tl.static_range(1, LEVELS):
            kind = tl.load(kinds + level)
            table = tables + level * stride_ll
            if kind == 0:
                acc += _dense_values(
                    p, vc_ptr, vmin_ptr, vscale_ptr, tl.load(table + group).to(tl.int64),
                    kv_head, svc_p, svc_h, svc_d, svm_p, svm_t, svm_h, HEAD_DIM, GROUP, ASM,
                )  # fmt: skip
            elif kind == COMPACT:
                acc += _compact_values(
                    p, vc_ptr, vmin_ptr, vscale_ptr, table, tl.load(maps + level * stride_ml + pos),
                    kv_head, svc_p, svc_h, svc_d, svm_p, svm_t, svm_h, HEAD_DIM, GROUP,
                )  # fmt: skip
        m_i = m_new
    q_rows = tl.broadcast_to(q[None, :], (MMA_ROWS, HEAD_DIM)).to(k_ptr.dtype.element_ty)
    for group in range(tl.maximum(first, packed_groups), last):
        pos = group * GROUP + t
        visible = pos < length
        block = tl.load(tables_ptr + row * stride_tr + pos // BLOCK_SIZE, mask=visible, other=0)
        slot = block.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        k = tl.load(k_ptr + slot[:, None] + d[None, :], mask=visible[:, None], other=0.0)
        s = tl.dot(q_rows, tl.trans(k), input_precision=TAIL_PRECISION)
        s = tl.where(visible[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vslot = block.to(tl.int64) * stride_vb + (pos % BLOCK_SIZE) * stride_vt + kv_head * stride_vh
        v = tl.load(v_ptr + vslot[:, None] + d[None, :], mask=visible[:, None], other=0.0)
        pv = tl.dot(p.to(v.dtype), v, input_precision=TAIL_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    # row g of acc is right for channel group g; every row's max and sum are the same
    out = tl.sum(tl.where(lane[:, None] == (d // GROUP)[None, :], acc, 0.0), axis=0)
    tl.store(part_out_ptr + row * stride_pr + head * stride_ph + split * stride_ps + d, out)
    tl.store(part_max_ptr + row * stride_sr + head * stride_sh + split, tl.max(m_i, axis=0))
    first_row = lane == 0
    tl.store(
        part_sum_ptr + row * stride_sr + head * stride_sh + split,
        tl.sum(tl.where(first_row, l_i, 0.0), axis=0),
    )
