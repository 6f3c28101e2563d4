"""Triton code that encodes one level of a packed append straight into the store's pages
(wrapper in ``encode.py``): each program reconstructs its rows from the levels already
written, quantizes the residual and writes codes and parameters in the page layout, so no
FP32 copy of the history exists outside registers.

The arithmetic is ``kv.store``'s chain, operation for operation (the oracle, bit for bit):
the reconstruction adds each earlier level's minimum + scale * code in level order, and
the GPU path (EXACT) rounds every product and sum on its own (``mul_rn`` / ``add_rn``) so
no fused multiply-add changes a last bit; the interpreter has no FMA to avoid.
"""

import triton
import triton.language as tl
from triton.language.extra import libdevice

from flashloop_backend.kernels.triton.packed_block_jit import (
    channel_a,
    param_slot,
    per_row_column,
)
from flashloop_backend.kernels.triton.quantize_jit import int4_codes
from flashloop_backend.kernels.triton.specialization import APPEND_METADATA


@triton.jit
def _affine(low, scale, code, EXACT: tl.constexpr):
    """low + scale * code, the product and the sum each rounded."""
    if EXACT:
        return libdevice.add_rn(low, libdevice.mul_rn(scale, code))
    return low + scale * code


@triton.jit
def _level_slots(slots_row, pages_row, rows, GROUP: tl.constexpr):
    """Page, row within the page and presence [G] of the append's ``rows`` at one earlier
    level (``slots_row``: a row's slot in that level's pages, -1 absent)."""
    slot = tl.load(slots_row + rows)
    present = slot >= 0
    page = tl.load(pages_row + slot // GROUP, mask=present, other=0).to(tl.int64)
    return page, (slot % GROUP).to(tl.int64), present


@triton.jit
def _accumulate(recon, level_value, mask, earlier, EXACT: tl.constexpr):
    """The chain's running reconstruction: the first level is the value itself, later ones
    add to it; rows absent from the level keep theirs."""
    if EXACT:
        total = libdevice.add_rn(recon, level_value)
    else:
        total = recon + level_value
    return tl.where(mask, tl.where(earlier == 0, level_value, total), recon)


@triton.jit
def _minmax_by_group(x, owner, NG: tl.constexpr):
    """Per row and V group (columns ``owner``): [G, NG] minima and maxima of x [G, D/2]."""
    group = tl.arange(0, NG)
    low = tl.zeros([x.shape[0], NG], tl.float32)
    high = tl.zeros([x.shape[0], NG], tl.float32)
    for g in tl.static_range(NG):
        mine = owner[None, :] == g
        low = tl.where(
            group[None, :] == g, tl.min(tl.where(mine, x, float("inf")), 1)[:, None], low
        )
        high = tl.where(
            group[None, :] == g, tl.max(tl.where(mine, x, float("-inf")), 1)[:, None], high
        )
    return low, high


@triton.jit
def _earlier_codes(codes_ptr, row, byte, mask):
    """The low and high nibbles (FP32) of bytes ``byte`` of rows ``row``."""
    value = tl.load(codes_ptr + row[:, None] + byte[None, :], mask=mask, other=0).to(tl.int32)
    return (value & 15).to(tl.float32), (value >> 4).to(tl.float32)


@triton.jit(do_not_specialize=APPEND_METADATA)
def encode_level_kernel(
    k_ptr,
    v_ptr,
    blocks_ptr,
    rows_ptr,
    slots_ptr,
    pages_ptr,
    codes_ptr,
    halves_ptr,
    level,
    block_rows,
    stride_st,
    stride_pl,
    stride_xb,
    stride_xt,
    stride_xl,
    stride_xh,
    page_bytes,
    layer_bytes,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    EXACT: tl.constexpr,
):
    """One (page of this level, layer, KV head): the page's G rows ``rows`` [Pd * G] (row
    of the append for each slot; a compact level's last page repeats its last row) of K
    and V [NB, L, BS, Hkv, D] (row r is row r % BS, BS = ``block_rows``, of block
    ``blocks[r // BS]``: paged pools read in place) minus their reconstruction from
    levels 0 .. level - 1 (``slots`` [Lv, T] int32: a row's slot in that level's pages, -1
    where absent; ``pages`` [Lv, P] int32 page ids), quantized as the store's chain does:
    K per channel across the G rows, V per row across G channels; codes and FP16
    parameters written into the v3 block of page ``pages[level, index]`` (``codes`` /
    ``halves``: byte and FP16 views of the store's blocks [pages, L, Hkv, bytes]). The
    program works in code columns (``packed_block_jit``): A's column i is the low nibble
    of byte i, B's its high nibble, so each byte is one A and one B code, and K's
    parameters go to their column's slot."""
    BLOCK: tl.constexpr = HEAD_DIM * (GROUP + 8)
    NG: tl.constexpr = HEAD_DIM // GROUP
    HD2: tl.constexpr = HEAD_DIM // 2
    HI: tl.constexpr = 16 if HEAD_DIM >= 32 else HEAD_DIM // 2  # kv.layout.high_offset
    V_CODES: tl.constexpr = GROUP * HD2
    K_PARAMS: tl.constexpr = GROUP * HEAD_DIM // 2  # in halves
    V_PARAMS: tl.constexpr = (GROUP * HEAD_DIM + 4 * HEAD_DIM) // 2  # in halves
    index = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    r = tl.arange(0, GROUP)
    column = tl.arange(0, HD2)  # byte i of a row: its low nibble in A, high nibble in B
    ch_a = channel_a(column, HEAD_DIM)
    byte = column
    slot = param_slot(column)
    owner_a = ch_a // GROUP
    owner_b = (ch_a + HI) // GROUP
    rows = tl.load(rows_ptr + index * GROUP + r).to(tl.int64)
    block = tl.load(blocks_ptr + rows // block_rows)
    source = block * stride_xb + (rows % block_rows) * stride_xt + layer * stride_xl
    source = (source + head * stride_xh)[:, None]
    # K first, then V: one pair of reconstruction tiles live at a time
    recon_a = tl.zeros([GROUP, HD2], tl.float32)
    recon_b = tl.zeros([GROUP, HD2], tl.float32)
    for earlier in range(level):
        page, within, present = _level_slots(
            slots_ptr + earlier * stride_st, pages_ptr + earlier * stride_pl, rows, GROUP
        )
        mask = present[:, None]
        at = page * page_bytes + layer * layer_bytes + head * BLOCK
        code_a, code_b = _earlier_codes(codes_ptr, at + within * HD2, byte, mask)
        param = halves_ptr + (at // 2 + K_PARAMS)[:, None] + slot[None, :]
        step_a = tl.load(param, mask=mask, other=0.0).to(tl.float32)
        step_b = tl.load(param + HD2, mask=mask, other=0.0).to(tl.float32)
        low_a = tl.load(param + HEAD_DIM, mask=mask, other=0.0).to(tl.float32)
        low_b = tl.load(param + HEAD_DIM + HD2, mask=mask, other=0.0).to(tl.float32)
        recon_a = _accumulate(recon_a, _affine(low_a, step_a, code_a, EXACT), mask, earlier, EXACT)
        recon_b = _accumulate(recon_b, _affine(low_b, step_b, code_b, EXACT), mask, earlier, EXACT)
    # x - (+0) is x: the base level takes its values as they are
    k_a = tl.load(k_ptr + source + ch_a[None, :]).to(tl.float32) - recon_a
    k_b = tl.load(k_ptr + source + ch_a[None, :] + HI).to(tl.float32) - recon_b
    # ---- K: one group per channel (column) across the page's rows
    target = tl.load(pages_ptr + level * stride_pl + index).to(tl.int64)
    out = target * page_bytes + layer * layer_bytes + head * BLOCK
    min_a = tl.min(k_a, axis=0).to(tl.float16)
    min_b = tl.min(k_b, axis=0).to(tl.float16)
    scale_a = tl.math.div_rn(tl.max(k_a, axis=0) - tl.min(k_a, axis=0), 15.0).to(tl.float16)
    scale_b = tl.math.div_rn(tl.max(k_b, axis=0) - tl.min(k_b, axis=0), 15.0).to(tl.float16)
    code_a = int4_codes(k_a, min_a.to(tl.float32)[None, :], scale_a.to(tl.float32)[None, :])
    code_b = int4_codes(k_b, min_b.to(tl.float32)[None, :], scale_b.to(tl.float32)[None, :])
    packed = code_a.to(tl.uint8) | (code_b.to(tl.uint8) << 4)
    row_bytes = r[:, None] * HD2 + byte[None, :]
    tl.store(codes_ptr + out + row_bytes, packed)
    params = halves_ptr + out // 2 + K_PARAMS + slot
    tl.store(params, scale_a)
    tl.store(params + HD2, scale_b)
    tl.store(params + HEAD_DIM, min_a)
    tl.store(params + HEAD_DIM + HD2, min_b)

    # ---- V: one group per row across each run of G channels
    recon_a = tl.zeros([GROUP, HD2], tl.float32)
    recon_b = tl.zeros([GROUP, HD2], tl.float32)
    for earlier in range(level):
        page, within, present = _level_slots(
            slots_ptr + earlier * stride_st, pages_ptr + earlier * stride_pl, rows, GROUP
        )
        mask = present[:, None]
        at = page * page_bytes + layer * layer_bytes + head * BLOCK
        code_a, code_b = _earlier_codes(codes_ptr, at + V_CODES + within * HD2, byte, mask)
        record = halves_ptr + (at // 2 + V_PARAMS + within * (2 * NG))[:, None]
        low_a = tl.load(record + 2 * owner_a[None, :], mask=mask, other=0.0).to(tl.float32)
        step_a = tl.load(record + 2 * owner_a[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
        low_b = tl.load(record + 2 * owner_b[None, :], mask=mask, other=0.0).to(tl.float32)
        step_b = tl.load(record + 2 * owner_b[None, :] + 1, mask=mask, other=0.0).to(tl.float32)
        recon_a = _accumulate(recon_a, _affine(low_a, step_a, code_a, EXACT), mask, earlier, EXACT)
        recon_b = _accumulate(recon_b, _affine(low_b, step_b, code_b, EXACT), mask, earlier, EXACT)
    v_a = tl.load(v_ptr + source + ch_a[None, :]).to(tl.float32) - recon_a
    v_b = tl.load(v_ptr + source + ch_a[None, :] + HI).to(tl.float32) - recon_b
    # a group's minimum and maximum over both tiles' columns in it
    low_a, high_a = _minmax_by_group(v_a, owner_a, NG)
    low_b, high_b = _minmax_by_group(v_b, owner_b, NG)
    low, high = tl.minimum(low_a, low_b), tl.maximum(high_a, high_b)
    v_min16 = low.to(tl.float16)
    v_scale16 = tl.math.div_rn(high - low, 15.0).to(tl.float16)
    m32, s32 = v_min16.to(tl.float32), v_scale16.to(tl.float32)
    code_a = int4_codes(v_a, per_row_column(m32, owner_a, NG), per_row_column(s32, owner_a, NG))
    code_b = int4_codes(v_b, per_row_column(m32, owner_b, NG), per_row_column(s32, owner_b, NG))
    packed = code_a.to(tl.uint8) | (code_b.to(tl.uint8) << 4)
    tl.store(codes_ptr + out + V_CODES + row_bytes, packed)
    group = tl.arange(0, NG)
    record = halves_ptr + out // 2 + V_PARAMS + r[:, None] * (2 * NG) + 2 * group[None, :]
    tl.store(record, v_min16)
    tl.store(record + 1, v_scale16)
