"""Triton code for decode attention over packed INT4 KV, encoding v3 (wrapper in
``packed_decode.py``; block layout and code columns in ``packed_block_jit.py``, one
level's work on a group in ``packed_level_jit.py``).

A program streams whole groups of one (row, query head): per group the K rows of every
level it reads (a dense level's page directly, a compact level's rows through its map),
an online softmax in FP32, then the V rows. K's per-channel scales are folded into the
query once per page, V's per-token scales into p. Plain reads (HALF) multiply exact FP16
codes by FP16 folded weights and sum the products in FP32; reads that feed the exact
top-K (STORE_LOGITS) stay in FP32 (``units``). The output keeps the code columns' channel
order (A and B, each [D/2]) until it is stored.
"""

import triton
import triton.language as tl

from flashloop_backend.kernels.triton.packed_block_jit import (
    channel_a,
    param_slot,
)
from flashloop_backend.kernels.triton.packed_level_jit import (
    compact_logits,
    compact_rows,
    compact_values,
    dense_logits,
    dense_values,
    level_kind,
)
from flashloop_backend.kernels.triton.specialization import (
    BLOCK_TABLE_ROWS,
    LEVEL_METADATA,
    PACKED_SPLIT_METADATA,
    SCALAR_PER_ROW,
)
from flashloop_backend.kv.levels import LevelKind

COMPACT = tl.constexpr(int(LevelKind.COMPACT))
EMPTY = tl.constexpr(int(LevelKind.EMPTY))


@triton.jit(
    do_not_specialize=[*PACKED_SPLIT_METADATA, *LEVEL_METADATA, *BLOCK_TABLE_ROWS],
    do_not_specialize_on_alignment=SCALAR_PER_ROW,
)
def packed_decode_split_kernel(
    q_ptr,
    codes_ptr,
    halves_ptr,
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
    scale,
    stride_qr,
    stride_qh,
    page_bytes,
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
    groups_per_split,
    GROUP_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    LEVELS: tl.constexpr,
    LEVELS_PAD: tl.constexpr,
    COMPACT_FROM: tl.constexpr,
    TAIL: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
    HALF: tl.constexpr,
    ASM: tl.constexpr,
):
    """One (row, query head, split) over groups of G positions: groups below the row's
    packed length from the levels of ``codes`` / ``halves`` (one layer's v3 blocks, byte
    and FP16 views; ``page_bytes`` between pages), level 0 and every level its ``kinds``
    mark dense or compact (``tables`` [R, Lv, P] page ids, ``maps`` [R, Lv, Tp] compact
    rows; levels below COMPACT_FROM are never compact), later groups from the BF16 paged
    cache [NB, BS, Hkv, D], TAIL positions a step. FP32 online softmax;
    the partial state of the split goes to part_out [R, Hq, S, D], part_max / part_sum
    [R, Hq, S]. STORE_LOGITS: every visible key's scaled logit goes to ``logits`` [R, Hq,
    T] too."""
    BLOCK: tl.constexpr = HEAD_DIM * (GROUP + 8)
    HI: tl.constexpr = 16 if HEAD_DIM >= 32 else HEAD_DIM // 2  # kv.layout.high_offset
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP_Q
    column = tl.arange(0, HEAD_DIM // 2)
    ch_a = channel_a(column, HEAD_DIM)
    owner_a = ch_a // GROUP  # the V groups of the columns of A and B
    owner_b = (ch_a + HI) // GROUP
    byte_col = column  # byte i of a row: its low nibble is A's column i, its high B's
    perm_col = column
    param_at = param_slot(column)
    query = q_ptr + row * stride_qr + head * stride_qh
    q_a = tl.load(query + ch_a).to(tl.float32) * scale
    q_b = tl.load(query + ch_a + HI).to(tl.float32) * scale
    length = tl.load(lengths_ptr + row)
    packed_groups = tl.load(packed_ptr + row) // GROUP
    tables = level_tables_ptr + row * stride_lr
    maps = level_maps_ptr + row * stride_mr
    lv = tl.arange(0, LEVELS_PAD)
    kinds = tl.load(level_kinds_ptr + row * stride_kr + lv, mask=lv < LEVELS, other=EMPTY)
    t = tl.arange(0, GROUP)
    m_i = float("-inf")
    l_i = 0.0
    acc_a = tl.zeros([HEAD_DIM // 2], tl.float32)
    acc_b = tl.zeros([HEAD_DIM // 2], tl.float32)
    first = split * groups_per_split
    # groups past the row's length hold no visible key: a row routed to another op (length
    # 0) costs its programs nothing
    last = tl.minimum(first + groups_per_split, tl.cdiv(length, GROUP))
    for group in range(first, tl.minimum(last, packed_groups)):
        pos = group * GROUP + t
        s = tl.zeros([GROUP], tl.float32)
        for level in tl.static_range(LEVELS):
            table = tables + level * stride_ll
            kind = level_kind(kinds, level)
            if level == 0 or kind == 0:  # the base is dense
                page = tl.load(table + group).to(tl.int64)
                block = page * page_bytes + kv_head * BLOCK
                s += dense_logits(
                    codes_ptr,
                    halves_ptr,
                    block,
                    q_a,
                    q_b,
                    t,
                    byte_col,
                    param_at,
                    HEAD_DIM,
                    GROUP,
                    HALF,
                    ASM,
                )
            elif level >= COMPACT_FROM and kind == COMPACT:
                blocks, within, present = compact_rows(
                    maps + level * stride_ml, table, pos, kv_head, page_bytes, GROUP, BLOCK
                )
                s += compact_logits(
                    codes_ptr,
                    halves_ptr,
                    blocks,
                    within,
                    present,
                    q_a,
                    q_b,
                    perm_col,
                    param_at,
                    HEAD_DIM,
                    GROUP,
                )
        s = tl.where(pos < length, s, float("-inf"))
        if STORE_LOGITS:
            tl.store(logits_ptr + row * stride_gr + head * stride_gh + pos, s, mask=pos < length)
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe)
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc_a *= alpha
        acc_b *= alpha
        for level in tl.static_range(LEVELS):
            table = tables + level * stride_ll
            kind = level_kind(kinds, level)
            if level == 0 or kind == 0:
                page = tl.load(table + group).to(tl.int64)
                block = page * page_bytes + kv_head * BLOCK
                add_a, add_b = dense_values(
                    codes_ptr,
                    halves_ptr,
                    block,
                    p,
                    t,
                    byte_col,
                    owner_a,
                    owner_b,
                    HEAD_DIM,
                    GROUP,
                    HALF,
                    ASM,
                )
                acc_a += add_a
                acc_b += add_b
            elif level >= COMPACT_FROM and kind == COMPACT:
                blocks, within, present = compact_rows(
                    maps + level * stride_ml, table, pos, kv_head, page_bytes, GROUP, BLOCK
                )
                add_a, add_b = compact_values(
                    codes_ptr,
                    halves_ptr,
                    blocks,
                    within,
                    present,
                    p,
                    perm_col,
                    owner_a,
                    owner_b,
                    HEAD_DIM,
                    GROUP,
                )
                acc_a += add_a
                acc_b += add_b
        m_i = m_new
    # the BF16 pages above the packed length, TAIL positions a step
    tail = tl.arange(0, TAIL)
    for step in range(tl.maximum(first, packed_groups) * (GROUP // TAIL), last * (GROUP // TAIL)):
        pos = step * TAIL + tail
        visible = pos < length
        page = tl.load(tables_ptr + row * stride_tr + pos // BLOCK_SIZE, mask=visible, other=0)
        slot = page.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        k_a = tl.load(k_ptr + slot[:, None] + ch_a[None, :], mask=visible[:, None], other=0.0)
        k_b = tl.load(k_ptr + slot[:, None] + ch_a[None, :] + HI, mask=visible[:, None], other=0.0)
        s = tl.sum(q_a[None, :] * k_a.to(tl.float32) + q_b[None, :] * k_b.to(tl.float32), axis=1)
        s = tl.where(visible, s, float("-inf"))
        if STORE_LOGITS:
            tl.store(logits_ptr + row * stride_gr + head * stride_gh + pos, s, mask=visible)
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe)
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        vslot = page.to(tl.int64) * stride_vb + (pos % BLOCK_SIZE) * stride_vt + kv_head * stride_vh
        where = v_ptr + vslot[:, None] + ch_a[None, :]
        v_a = tl.load(where, mask=visible[:, None], other=0.0).to(tl.float32)
        v_b = tl.load(where + HI, mask=visible[:, None], other=0.0).to(tl.float32)
        acc_a = acc_a * alpha + tl.sum(p[:, None] * v_a, axis=0)
        acc_b = acc_b * alpha + tl.sum(p[:, None] * v_b, axis=0)
        m_i = m_new
    out = part_out_ptr + row * stride_pr + head * stride_ph + split * stride_ps
    tl.store(out + ch_a, acc_a)
    tl.store(out + ch_a + HI, acc_b)
    tl.store(part_max_ptr + row * stride_sr + head * stride_sh + split, m_i)
    tl.store(part_sum_ptr + row * stride_sr + head * stride_sh + split, l_i)
