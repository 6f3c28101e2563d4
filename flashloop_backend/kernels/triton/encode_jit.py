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

from flashloop_backend.kernels.triton.quantize_jit import int4_codes


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
def encode_level_kernel(
    k_ptr,
    v_ptr,
    blocks_ptr,
    rows_ptr,
    slots_ptr,
    pages_ptr,
    kc_ptr,
    kmin_ptr,
    kscale_ptr,
    vc_ptr,
    vmin_ptr,
    vscale_ptr,
    level,
    block_rows,
    stride_st,
    stride_pl,
    stride_xb,
    stride_xt,
    stride_xl,
    stride_xh,
    skc_p,
    skc_l,
    skc_t,
    skc_h,
    skm_p,
    skm_l,
    skm_h,
    svc_p,
    svc_l,
    svc_h,
    svc_d,
    svm_p,
    svm_l,
    svm_t,
    svm_h,
    HEAD_DIM: tl.constexpr,
    CHANNELS: tl.constexpr,
    GROUP: tl.constexpr,
    EXACT: tl.constexpr,
):
    """One (page of this level, layer, KV head, CHANNELS of its channels): the page's G rows ``rows`` [Pd * G] (row
    of the append for each slot; a compact level's last page repeats its last row) of K
    and V [NB, L, BS, Hkv, D] (row r is row r % BS, BS = ``block_rows``, of block
    ``blocks[r // BS]``: paged pools read in place) minus their reconstruction from
    levels 0 .. level - 1 (``slots``
    [Lv, T] int32: a row's slot in that level's pages, -1 where absent; ``pages`` [Lv, P]
    int32 page ids), quantized as the store's chain does: K per channel across the G rows,
    V per row across G channels; codes and FP16 parameters written to page
    ``pages[level, index]`` of the pools. K's groups (one per channel) and V's (G channels
    of a row) never cross a block of CHANNELS channels (a multiple of G), so the blocks of
    a head are independent programs."""
    index = tl.program_id(0)
    layer = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2) // (HEAD_DIM // CHANNELS)
    first_channel = tl.program_id(2) % (HEAD_DIM // CHANNELS) * CHANNELS
    r = tl.arange(0, GROUP)
    c = first_channel + tl.arange(0, CHANNELS)
    rows = tl.load(rows_ptr + index * GROUP + r).to(tl.int64)
    block = tl.load(blocks_ptr + rows // block_rows)
    source = block * stride_xb + (rows % block_rows) * stride_xt + layer * stride_xl
    source = (source + head * stride_xh)[:, None] + c[None, :]
    # K first, then V: one reconstruction tile live at a time
    recon_k = tl.zeros([GROUP, CHANNELS], tl.float32)
    for earlier in range(level):
        page, within, present = _level_slots(
            slots_ptr + earlier * stride_st, pages_ptr + earlier * stride_pl, rows, GROUP
        )
        mask = present[:, None]
        byte = tl.load(
            kc_ptr
            + (page * skc_p + layer * skc_l + within * skc_t + head * skc_h)[:, None]
            + (c // 2)[None, :],
            mask=mask,
            other=0,
        ).to(tl.int32)
        code = ((byte >> ((c % 2) * 4)[None, :]) & 15).to(tl.float32)
        param = (page * skm_p + layer * skm_l + head * skm_h)[:, None] + c[None, :]
        low = tl.load(kmin_ptr + param, mask=mask, other=0.0).to(tl.float32)
        step = tl.load(kscale_ptr + param, mask=mask, other=0.0).to(tl.float32)
        recon_k = _accumulate(recon_k, _affine(low, step, code, EXACT), mask, earlier, EXACT)
    # x - (+0) is x: the base level takes its values as they are
    k = tl.load(k_ptr + source).to(tl.float32) - recon_k
    # ---- K: one group per channel across the page's rows
    target = tl.load(pages_ptr + level * stride_pl + index).to(tl.int64)
    k_min16 = tl.min(k, axis=0).to(tl.float16)
    k_scale16 = tl.math.div_rn(tl.max(k, axis=0) - tl.min(k, axis=0), 15.0).to(tl.float16)
    k_code = int4_codes(k, k_min16.to(tl.float32)[None, :], k_scale16.to(tl.float32)[None, :])
    even, odd = tl.split(tl.reshape(k_code.to(tl.uint8), (GROUP, CHANNELS // 2, 2)))
    pair = first_channel // 2 + tl.arange(0, CHANNELS // 2)
    k_row = target * skc_p + layer * skc_l + head * skc_h
    tl.store(kc_ptr + k_row + r[:, None] * skc_t + pair[None, :], even | (odd << 4))
    k_param = target * skm_p + layer * skm_l + head * skm_h + c
    tl.store(kmin_ptr + k_param, k_min16)
    tl.store(kscale_ptr + k_param, k_scale16)

    # ---- V: one group per row across each run of G channels
    recon_v = tl.zeros([GROUP, CHANNELS], tl.float32)
    for earlier in range(level):
        page, within, present = _level_slots(
            slots_ptr + earlier * stride_st, pages_ptr + earlier * stride_pl, rows, GROUP
        )
        mask = present[:, None]
        byte = tl.load(
            vc_ptr
            + (page * svc_p + layer * svc_l + head * svc_h + within // 2)[:, None]
            + c[None, :] * svc_d,
            mask=mask,
            other=0,
        ).to(tl.int32)
        code = ((byte >> ((within % 2) * 4)[:, None]) & 15).to(tl.float32)
        param = (page * svm_p + layer * svm_l + within * svm_t + head * svm_h)[:, None] + (
            c // GROUP
        )[None, :]
        low = tl.load(vmin_ptr + param, mask=mask, other=0.0).to(tl.float32)
        step = tl.load(vscale_ptr + param, mask=mask, other=0.0).to(tl.float32)
        recon_v = _accumulate(recon_v, _affine(low, step, code, EXACT), mask, earlier, EXACT)
    v = tl.load(v_ptr + source).to(tl.float32) - recon_v
    grouped = tl.reshape(v, (GROUP, CHANNELS // GROUP, GROUP))
    v_min16 = tl.min(grouped, axis=2).to(tl.float16)
    v_scale16 = tl.math.div_rn(tl.max(grouped, axis=2) - tl.min(grouped, axis=2), 15.0).to(
        tl.float16
    )
    v_code = int4_codes(
        grouped, v_min16.to(tl.float32)[:, :, None], v_scale16.to(tl.float32)[:, :, None]
    )
    by_channel = tl.trans(tl.reshape(v_code, (GROUP, CHANNELS)))  # [C, G]: rows pair per byte
    even, odd = tl.split(tl.reshape(by_channel.to(tl.uint8), (CHANNELS, GROUP // 2, 2)))
    half = tl.arange(0, GROUP // 2)
    v_block = target * svc_p + layer * svc_l + head * svc_h
    tl.store(vc_ptr + v_block + c[:, None] * svc_d + half[None, :], even | (odd << 4))
    groups = first_channel // GROUP + tl.arange(0, CHANNELS // GROUP)
    v_param = (target * svm_p + layer * svm_l + head * svm_h + r * svm_t)[:, None] + groups[None, :]
    tl.store(vmin_ptr + v_param, v_min16)
    tl.store(vscale_ptr + v_param, v_scale16)
