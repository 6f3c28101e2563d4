"""Triton code of one level's work on a group for the packed decode reader
(``packed_decode_jit.py``), encoding v3: a dense level's K logits and V sums read from its
page, a compact level's through its map's rows, and the per-column and per-row
parameters they fold.
"""

import triton
import triton.language as tl

from flashloop_backend.kernels.triton.packed_block_jit import nibbles, per_row_column, units


@triton.jit
def dense_logits(
    codes_ptr,
    halves_ptr,
    block,
    q_a,
    q_b,
    t,
    byte_col,
    column,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    HALF: tl.constexpr,
    ASM: tl.constexpr,
):
    """q . k [G] of the G rows of one dense block (``block``: its byte offset)."""
    kbytes = tl.load(codes_ptr + block + t[:, None] * (HEAD_DIM // 2) + byte_col[None, :])
    params = halves_ptr + block // 2 + GROUP * HEAD_DIM // 2 + column
    scale_a = tl.load(params).to(tl.float32)
    scale_b = tl.load(params + HEAD_DIM // 2).to(tl.float32)
    min_a = tl.load(params + HEAD_DIM).to(tl.float32)
    min_b = tl.load(params + HEAD_DIM + HEAD_DIM // 2).to(tl.float32)
    if HALF:  # FP16 products of exact codes and folded weights, summed in FP32
        a, b = nibbles(kbytes, ASM)
        fold_a = (q_a * scale_a).to(tl.float16)
        fold_b = (q_b * scale_b / 16.0).to(tl.float16)
        terms = (a * fold_a[None, :] + b * fold_b[None, :]).to(tl.float32)
        bias = tl.sum(q_a * min_a + q_b * min_b, axis=0)
    else:
        a, b = units(kbytes)
        terms = a * (16.0 * q_a * scale_a)[None, :] + b * (16.0 * q_b * scale_b)[None, :]
        bias = tl.sum(q_a * (min_a - 16.0 * scale_a) + q_b * (min_b - 16.0 * scale_b), axis=0)
    return bias + tl.sum(terms, axis=1)


@triton.jit
def compact_rows(maps, table, pos, kv_head, page_bytes, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """Byte offsets of the blocks holding a compact level's logical rows ``pos``, the
    rows within them, and their presence (absent rows inherit: they read nothing)."""
    rows = tl.load(maps + pos)
    present = rows >= 0
    page = tl.load(table + rows // GROUP, mask=present, other=0).to(tl.int64)
    return page * page_bytes + kv_head * BLOCK, rows % GROUP, present


@triton.jit
def compact_logits(
    codes_ptr,
    halves_ptr,
    blocks,
    within,
    present,
    q_a,
    q_b,
    perm_col,
    column,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
):
    """q . r [G] of residual rows gathered from a compact level (absent rows: 0), in FP32
    with each row's own page parameters."""
    mask = present[:, None]
    row = blocks + within * (HEAD_DIM // 2)
    kbytes = tl.load(codes_ptr + row[:, None] + perm_col[None, :], mask=mask, other=0)
    params = halves_ptr + (blocks // 2 + GROUP * HEAD_DIM // 2)[:, None] + column[None, :]
    scale_a = tl.load(params, mask=mask, other=0.0).to(tl.float32)
    scale_b = tl.load(params + HEAD_DIM // 2, mask=mask, other=0.0).to(tl.float32)
    min_a = tl.load(params + HEAD_DIM, mask=mask, other=0.0).to(tl.float32)
    min_b = tl.load(params + HEAD_DIM + HEAD_DIM // 2, mask=mask, other=0.0).to(tl.float32)
    a, b = units(kbytes)
    k_a = (min_a - 16.0 * scale_a) + 16.0 * scale_a * a
    k_b = (min_b - 16.0 * scale_b) + 16.0 * scale_b * b
    return tl.where(present, tl.sum(q_a[None, :] * k_a + q_b[None, :] * k_b, axis=1), 0.0)


@triton.jit
def per_column(per_group, owner, NG: tl.constexpr):
    """[NG] values per V group -> [D/2] per column ``owner``."""
    group = tl.arange(0, NG)
    out = tl.zeros(owner.shape, tl.float32)
    for g in tl.static_range(NG):
        out = tl.where(owner == g, tl.sum(tl.where(group == g, per_group, 0.0), 0), out)
    return out


@triton.jit
def dense_values(
    codes_ptr,
    halves_ptr,
    block,
    p,
    t,
    byte_col,
    owner_a,
    owner_b,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    HALF: tl.constexpr,
    ASM: tl.constexpr,
):
    """sum_t p_t v_t of one dense block as (A, B) [D/2] in code-column order (columns of
    A and B in V groups ``owner_a`` / ``owner_b``)."""
    NG: tl.constexpr = HEAD_DIM // GROUP
    row = t[:, None] * (HEAD_DIM // 2) + byte_col[None, :]
    vbytes = tl.load(codes_ptr + block + GROUP * (HEAD_DIM // 2) + row)  # [G, D/2]
    record = block // 2 + (GROUP * HEAD_DIM + 4 * HEAD_DIM) // 2
    record = halves_ptr + record + t[:, None] * (2 * NG) + 2 * tl.arange(0, NG)[None, :]
    v_min = tl.load(record).to(tl.float32)  # [G, D/G]
    weight = p[:, None] * tl.load(record + 1).to(tl.float32)
    offset = tl.sum(p[:, None] * v_min, axis=0)  # [D/G]
    if HALF:
        a, b = nibbles(vbytes, ASM)
        weight_a = per_row_column(weight, owner_a, NG).to(tl.float16)
        weight_b = (per_row_column(weight, owner_b, NG) / 16.0).to(tl.float16)
        sum_a = tl.sum((a * weight_a).to(tl.float32), axis=0)
        sum_b = tl.sum((b * weight_b).to(tl.float32), axis=0)
    else:
        a, b = units(vbytes)
        weight_a = 16.0 * per_row_column(weight, owner_a, NG)
        weight_b = 16.0 * per_row_column(weight, owner_b, NG)
        offset -= 16.0 * tl.sum(weight, axis=0)
        sum_a = tl.sum(a * weight_a, axis=0)
        sum_b = tl.sum(b * weight_b, axis=0)
    return per_column(offset, owner_a, NG) + sum_a, per_column(offset, owner_b, NG) + sum_b


@triton.jit
def compact_values(
    codes_ptr,
    halves_ptr,
    blocks,
    within,
    present,
    p,
    perm_col,
    owner_a,
    owner_b,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
):
    """sum_j p_j r_j over residual rows gathered from a compact level, as (A, B)."""
    NG: tl.constexpr = HEAD_DIM // GROUP
    row = blocks + GROUP * (HEAD_DIM // 2) + within * (HEAD_DIM // 2)
    mask = present[:, None]
    vbytes = tl.load(codes_ptr + row[:, None] + perm_col[None, :], mask=mask, other=0)
    record = blocks // 2 + (GROUP * HEAD_DIM + 4 * HEAD_DIM) // 2 + within * (2 * NG)
    record = halves_ptr + record[:, None] + 2 * tl.arange(0, NG)[None, :]
    v_min = tl.load(record, mask=mask, other=0.0).to(tl.float32)
    weight = p[:, None] * tl.load(record + 1, mask=mask, other=0.0).to(tl.float32)
    offset = tl.sum(p[:, None] * v_min - 16.0 * weight, axis=0)
    a, b = units(vbytes)
    sum_a = tl.sum(a * (16.0 * per_row_column(weight, owner_a, NG)), axis=0)
    sum_b = tl.sum(b * (16.0 * per_row_column(weight, owner_b, NG)), axis=0)
    return per_column(offset, owner_a, NG) + sum_a, per_column(offset, owner_b, NG) + sum_b


@triton.jit
def level_kind(kinds, level):
    """The scalar kind of ``level`` from the row's kinds vector."""
    return tl.sum(tl.where(tl.arange(0, kinds.shape[0]) == level, kinds, 0), axis=0)
