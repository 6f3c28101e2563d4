"""Triton code that attends over the selected keys of packed KV, encoding v3, without
materialising them (wrappers in ``packed_sparse.py``).

Selected positions come sorted. A program takes them in blocks of up to BLOCK_N keys
whose pages, at every level, lie within NPW consecutive pages of that level's list (a
dense level's pages follow the logical pages, a compact level's its compact rows, both
in position order). For a block, every level's K parameters are loaded once per touched
page and folded into the query, [NPW x levels, D/2] per code tile A and B; one
tensor-core product of that folded query against every (key, level)'s K row scores all
pairs, and a one-hot keeps each (key, level)'s own page row. The V side weighs every
(key, level) row by p times its V record's scale, one product per tile whose row g is V
group g. Positions past the row's packed length come after the packed ones and are read
from the BF16 pages. FP32 online softmax in base 2.
"""

import triton
import triton.language as tl

from flashloop_backend.kernels.triton.packed_block_jit import channel_a, nibbles, param_slot
from flashloop_backend.kernels.triton.specialization import BLOCK_TABLE_ROWS, LEVEL_METADATA
from flashloop_backend.kv.levels import LevelKind

COMPACT = tl.constexpr(int(LevelKind.COMPACT))
EMPTY = tl.constexpr(int(LevelKind.EMPTY))
LOG2E = tl.constexpr(1.4426950408889634)
FAR = tl.constexpr(1 << 30)


@triton.jit
def _level_rows(pos, valid, kind, maps, level, COMPACT_FROM: tl.constexpr):
    """Rows of the keys ``pos`` at ``level`` of kind ``kind`` (a compact level's through
    its map) and whether they are present there."""
    compact = (kind == COMPACT) & (level >= COMPACT_FROM)
    mapped = tl.load(maps + pos, mask=valid & compact, other=-1)
    rows = tl.where(compact, mapped, pos)
    return rows, valid & (kind != EMPTY) & (rows >= 0)


@triton.jit
def _block_keys(
    pos,
    valid,
    kinds,
    maps,
    stride_ml,
    LEVELS: tl.constexpr,
    LP: tl.constexpr,
    GROUP: tl.constexpr,
    NPW: tl.constexpr,
    COMPACT_FROM: tl.constexpr,
):
    """For candidate keys ``pos`` [N] (``valid``): how many the block takes (a prefix:
    every present (key, level) within NPW pages of the level's first) and, per level, the
    page index of its first present key ([LP], FAR where none is present)."""
    level = tl.arange(0, LP)
    firsts = tl.full([LP], FAR, tl.int32)
    outside = tl.zeros(pos.shape, tl.int32)
    for lv in tl.static_range(LEVELS):
        kind = tl.sum(tl.where(level == lv, kinds, 0), axis=0)
        rows, present = _level_rows(pos, valid, kind, maps + lv * stride_ml, lv, COMPACT_FROM)
        index = rows // GROUP
        first = tl.min(tl.where(present, index, FAR), axis=0)
        outside |= (present & (index - first >= NPW)).to(tl.int32)
        firsts = tl.where(level == lv, first, firsts)
    take = valid & (tl.cumsum(outside, axis=0) == 0)
    return tl.sum(take.to(tl.int32), axis=0), firsts


@triton.jit
def _pick(values, index, LP: tl.constexpr):
    """values[index] for a [LP] vector and a tensor of indices (a where chain)."""
    out = tl.zeros(index.shape, values.dtype)
    level = tl.arange(0, LP)
    for lv in tl.static_range(LP):
        out = tl.where(index == lv, tl.sum(tl.where(level == lv, values, 0), axis=0), out)
    return out


@triton.jit(
    do_not_specialize=[
        *("keys_per_split", "bucket", "stride_er", "stride_sr", "stride_sh"),
        *LEVEL_METADATA,
        *BLOCK_TABLE_ROWS,
    ]
)
def packed_selected_split_kernel(
    q_ptr,
    idx_ptr,
    logits_ptr,
    lse_ptr,
    codes_ptr,
    halves_ptr,
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
    keys_per_split,
    bucket,
    GROUP_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    LEVELS: tl.constexpr,
    LP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NPW: tl.constexpr,
    COMPACT_FROM: tl.constexpr,
    FROM_LOGITS: tl.constexpr,
    ASM: tl.constexpr,
):
    """One (row, query head, split) over the split's ``keys_per_split`` of the row's
    selected positions ``idx`` [R, Hq, Kb] (sorted, -1 past the last): keys below the
    row's packed length reconstructed at its depth from layer blocks ``codes`` /
    ``halves`` (LEVELS levels, padded to LP; ``tables`` [R, Lv, P], ``maps`` [R, Lv, Tp],
    ``kinds`` [R, Lv]), later ones from the BF16 paged cache [NB, BS, Hkv, D]. Writes the
    split's softmax state (part_out [R, Hq, S, D], natural-log max and sum [R, Hq, S]), or
    with FROM_LOGITS only part_out = sum exp(logit - lse) v from ``logits`` [R, Hq, T] and
    ``lse`` [R, Hq] (the loop-2 contribution)."""
    BLOCK: tl.constexpr = HEAD_DIM * (GROUP + 8)
    NG: tl.constexpr = HEAD_DIM // GROUP
    HD2: tl.constexpr = HEAD_DIM // 2
    HI: tl.constexpr = 16 if HEAD_DIM >= 32 else HEAD_DIM // 2  # kv.layout.high_offset
    V_CODES: tl.constexpr = GROUP * HD2
    K_PARAMS: tl.constexpr = GROUP * HEAD_DIM // 2  # in halves
    V_PARAMS: tl.constexpr = (GROUP * HEAD_DIM + 4 * HEAD_DIM) // 2  # in halves
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    split = tl.program_id(2)
    kv_head = head // GROUP_Q
    column = tl.arange(0, HD2)
    ch_a = channel_a(column, HEAD_DIM)
    byte_col = column  # byte i of a row: its low nibble is A's column i, its high B's
    param_at = param_slot(column)
    group_row = tl.arange(0, 16)  # V group of each accumulator row (rows >= D/G stay 0)
    owner_a = ch_a // GROUP  # the V groups of columns i of A and B
    owner_b = (ch_a + HI) // GROUP
    query = q_ptr + row * stride_qr + head * stride_qh
    q_a = tl.load(query + ch_a).to(tl.float32) * (scale * LOG2E)
    q_b = tl.load(query + ch_a + HI).to(tl.float32) * (scale * LOG2E)
    indices = idx_ptr + row * stride_ir + head * stride_ih
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, bucket)
    packed = tl.load(packed_ptr + row)
    tables = level_tables_ptr + row * stride_lr
    maps = level_maps_ptr + row * stride_mr
    level = tl.arange(0, LP)
    kinds = tl.load(level_kinds_ptr + row * stride_kr + level, mask=level < LEVELS, other=EMPTY)
    if FROM_LOGITS:
        logits = logits_ptr + row * stride_gr + head * stride_gh
        lse = tl.load(lse_ptr + row * stride_er + head)
    key = tl.arange(0, BLOCK_N)
    m_i = float("-inf")
    l_i = 0.0
    acc_a = tl.zeros([16, HD2], tl.float32)
    acc_b = tl.zeros([16, HD2], tl.float32)
    mins = tl.zeros([16], tl.float32)
    i = start
    pos = tl.load(indices + i + key, mask=i + key < end, other=-1)
    lead = tl.load(indices + i, mask=i < end, other=-1)
    flat = tl.arange(0, BLOCK_N * LP)  # (key, level) pairs, key-major
    key_of, level_of = flat // LP, flat % LP
    owner_key = key_of[:, None] == key[None, :]  # [N x LP, N]
    param_row = tl.arange(0, NPW * LP)  # (page row, level) pairs, page-row-major
    while (lead >= 0) & (lead < packed):
        valid = (pos >= 0) & (pos < packed)
        taken, firsts = _block_keys(
            pos, valid, kinds, maps, stride_ml, LEVELS, LP, GROUP, NPW, COMPACT_FROM
        )
        take = key < taken
        i_next = i + taken
        # ---- per (key, level): its row at the level, the block holding it
        pos_f = tl.load(indices + i + key_of, mask=key_of < taken, other=-1)
        kind_f = _pick(kinds, level_of, LP)
        rows_f, here = _level_rows(
            pos_f, key_of < taken, kind_f, maps + level_of * stride_ml, level_of, COMPACT_FROM
        )
        here = here & (level_of < LEVELS)
        first_f = _pick(firsts, level_of, LP)
        relative = rows_f // GROUP - first_f
        page = tl.load(tables + level_of * stride_ll + rows_f // GROUP, mask=here, other=0)
        blocks = page.to(tl.int64) * page_bytes + kv_head * BLOCK
        within = rows_f % GROUP
        rows = blocks + within * HD2
        pos_next = tl.load(indices + i_next + key, mask=i_next + key < end, other=-1)
        lead = tl.load(indices + i_next, mask=i_next < end, other=-1)
        # ---- logits: folded query of every (page row, level) x every (key, level) K row
        if FROM_LOGITS:
            p = tl.exp(tl.load(logits + pos, mask=take, other=float("-inf")) - lse)
            p = tl.where(take, p, 0.0)
        else:
            kbytes = tl.load(
                codes_ptr + rows[:, None] + byte_col[None, :], mask=here[:, None], other=0
            )
            level_r = param_row % LP
            last = tl.max(
                tl.where(
                    here[None, :] & (level_of[None, :] == level_r[:, None]), relative[None, :], -1
                ),
                axis=1,
            )
            touched = (param_row // LP <= last) & (_pick(kinds, level_r, LP) != EMPTY)
            touched = touched & (level_r < LEVELS)
            rows_page = tl.load(
                tables + level_r * stride_ll + _pick(firsts, level_r, LP) + param_row // LP,
                mask=touched,
                other=0,
            )
            params = rows_page.to(tl.int64) * page_bytes + kv_head * BLOCK
            where = halves_ptr + (params // 2 + K_PARAMS)[:, None] + param_at[None, :]
            scale_a = tl.load(where, mask=touched[:, None], other=0.0)
            scale_b = tl.load(where + HD2, mask=touched[:, None], other=0.0)
            fold_a = (q_a[None, :] * scale_a.to(tl.float32)).to(tl.float16)
            fold_b = (q_b[None, :] * scale_b.to(tl.float32) / 16.0).to(tl.float16)
            min_a = tl.load(where + HEAD_DIM, mask=touched[:, None], other=0.0)
            min_b = tl.load(where + HEAD_DIM + HD2, mask=touched[:, None], other=0.0)
            bias = tl.sum(q_a[None, :] * min_a.to(tl.float32) + q_b[None, :] * min_b, axis=1)
            a, b = nibbles(kbytes, ASM)
            scores = tl.dot(fold_a, tl.trans(a))
            scores = tl.dot(fold_b, tl.trans(b), scores) + bias[:, None]
            hit = param_row[:, None] == (relative * LP + level_of)[None, :]
            own = tl.sum(tl.where(hit & here[None, :], scores, 0.0), axis=0)  # [N x LP]
            logit = tl.sum(tl.where(owner_key, own[:, None], 0.0), axis=0)  # [N]
            logit = tl.where(take, logit, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(logit, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(logit - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc_a *= alpha
            acc_b *= alpha
            mins *= alpha
            m_i = m_new
        vbytes = tl.load(
            codes_ptr + V_CODES + rows[:, None] + byte_col[None, :], mask=here[:, None], other=0
        )
        record = halves_ptr + blocks // 2 + V_PARAMS + within * (2 * NG)
        record = record[None, :] + 2 * group_row[:, None]  # [16, N x LP]: row g = V group g
        in_group = here[None, :] & (group_row < NG)[:, None]
        v_min = tl.load(record, mask=in_group, other=0.0).to(tl.float32)
        v_scale = tl.load(record + 1, mask=in_group, other=0.0).to(tl.float32)
        # ---- values: row g of the weights is p times V group g's scale, per (key, level)
        weight = tl.sum(tl.where(owner_key, p[None, :], 0.0), axis=1)  # p of each pair's key
        a, b = nibbles(vbytes, ASM)
        acc_a = tl.dot((weight[None, :] * v_scale).to(tl.float16), a, acc_a)
        acc_b = tl.dot((weight[None, :] * v_scale / 16.0).to(tl.float16), b, acc_b)
        mins += tl.sum(weight[None, :] * v_min, axis=1)
        i, pos = i_next, pos_next
    # the BF16 positions (after the packed ones; -1 ends the selection)
    while lead >= 0:
        valid = (i + key < end) & (pos >= 0)
        page = tl.load(tables_ptr + row * stride_tr + pos // BLOCK_SIZE, mask=valid, other=0)
        slot = page.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        if FROM_LOGITS:
            p = tl.exp(tl.load(logits + pos, mask=valid, other=float("-inf")) - lse)
            p = tl.where(valid, p, 0.0)
        else:
            k_a = tl.load(k_ptr + slot[:, None] + ch_a[None, :], mask=valid[:, None], other=0.0)
            k_b = tl.load(
                k_ptr + slot[:, None] + ch_a[None, :] + HI, mask=valid[:, None], other=0.0
            )
            logit = tl.sum(q_a[None, :] * k_a.to(tl.float32) + q_b[None, :] * k_b.to(tl.float32), 1)
            logit = tl.where(valid, logit, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(logit, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(logit - m_safe)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc_a *= alpha
            acc_b *= alpha
            mins *= alpha
            m_i = m_new
        vslot = page.to(tl.int64) * stride_vb + (pos % BLOCK_SIZE) * stride_vt + kv_head * stride_vh
        v_a = tl.load(v_ptr + vslot[:, None] + ch_a[None, :], mask=valid[:, None], other=0.0)
        v_b = tl.load(v_ptr + vslot[:, None] + ch_a[None, :] + HI, mask=valid[:, None], other=0.0)
        # every accumulator row gets it: the output takes one row per column
        acc_a += tl.sum(p[:, None] * v_a.to(tl.float32), axis=0)[None, :]
        acc_b += tl.sum(p[:, None] * v_b.to(tl.float32), axis=0)[None, :]
        i += BLOCK_N
        pos = tl.load(indices + i + key, mask=i + key < end, other=-1)
        lead = tl.load(indices + i, mask=i < end, other=-1)
    # column i belongs to a V group: its accumulator row, plus that group's minima
    out_a = tl.sum(tl.where(group_row[:, None] == owner_a[None, :], acc_a + mins[:, None], 0.0), 0)
    out_b = tl.sum(tl.where(group_row[:, None] == owner_b[None, :], acc_b + mins[:, None], 0.0), 0)
    out = part_out_ptr + row * stride_pr + head * stride_ph + split * stride_ps
    tl.store(out + ch_a, out_a)
    tl.store(out + ch_a + HI, out_b)
    if not FROM_LOGITS:
        # the merge takes natural-log maxima
        tl.store(part_max_ptr + row * stride_sr + head * stride_sh + split, m_i / LOG2E)
        tl.store(part_sum_ptr + row * stride_sr + head * stride_sh + split, l_i)
