"""Triton code that reconstructs chosen positions of packed KV (wrapper in
``packed_sparse.py``): sparse decode over packed KV reads only the selected keys."""

import triton
import triton.language as tl

from flashloop_backend.kv.levels import LevelKind

COMPACT = tl.constexpr(int(LevelKind.COMPACT))


@triton.jit
def _level_rows(
    pos, row, level, tables, maps, kinds, stride_ll, stride_ml, stride_kr, take, GROUP: tl.constexpr
):
    """Page, row within the page and presence [N] of positions ``pos`` at one level."""
    kind = tl.load(kinds + row * stride_kr + level)
    logical = tl.where(
        kind == COMPACT, tl.load(maps + level * stride_ml + pos, mask=take, other=-1), pos
    )
    present = take & (kind != 2) & (logical >= 0)
    page = tl.load(tables + level * stride_ll + logical // GROUP, mask=present, other=0).to(
        tl.int64
    )
    return page, logical % GROUP, present


@triton.jit
def reconstruct_rows(
    pos,
    row,
    kv_head,
    d,
    kc_ptr,
    kmin_ptr,
    kscale_ptr,
    vc_ptr,
    vmin_ptr,
    vscale_ptr,
    tables,
    maps,
    level_kinds_ptr,
    packed_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
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
    stride_ll,
    stride_ml,
    stride_kr,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_tr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    LEVELS: tl.constexpr,
    WANT_K: tl.constexpr,
    V_BY_CHANNEL: tl.constexpr = False,
):
    """FP32 K and V [BLOCK_N, D] of one row's positions ``pos`` [BLOCK_N] (-1: zeros) for
    KV head ``kv_head``: below the row's packed length the sum of its levels (base +
    residuals present at its depth), above it the BF16 paged cache. ``tables`` / ``maps``
    point at the row's level metadata. K stays zero unless ``WANT_K``.

    V_BY_CHANNEL returns V transposed, [D, BLOCK_N], positions along the fast axis: a
    channel's codes of one group are one 32-byte row, so the positions of a group read the
    same sectors in one load instead of one sector per channel each, and each position's
    channel-group parameters are loaded once and broadcast over its channels."""
    wanted = pos >= 0
    in_packed = wanted & (pos < tl.load(packed_ptr + row))
    k = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    if V_BY_CHANNEL:
        v = tl.zeros([HEAD_DIM, BLOCK_N], tl.float32)
    else:
        v = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    for level in range(LEVELS):
        page, within, present = _level_rows(
            pos,
            row,
            level,
            tables,
            maps,
            level_kinds_ptr,
            stride_ll,
            stride_ml,
            stride_kr,
            in_packed,
            GROUP,
        )
        mask = present[:, None]
        if WANT_K:
            k_byte = tl.load(
                kc_ptr
                + (page * skc_p + within * skc_t + kv_head * skc_h)[:, None]
                + (d // 2)[None, :],
                mask=mask,
                other=0,
            ).to(tl.int32)
            k_code = ((k_byte >> ((d % 2) * 4)[None, :]) & 15).to(tl.float32)
            k_param = (page * skm_p + kv_head * skm_h)[:, None] + d[None, :]
            k += (
                tl.load(kmin_ptr + k_param, mask=mask, other=0.0).to(tl.float32)
                + tl.load(kscale_ptr + k_param, mask=mask, other=0.0).to(tl.float32) * k_code
            )
        if V_BY_CHANNEL:
            byte = tl.load(
                vc_ptr
                + (page * svc_p + kv_head * svc_h + within // 2)[None, :]
                + d[:, None] * svc_d,
                mask=present[None, :],
                other=0,
            ).to(tl.int32)
            code = ((byte >> ((within % 2) * 4)[None, :]) & 15).to(tl.float32)
            param = page * svm_p + within * svm_t + kv_head * svm_h
            for g in tl.static_range((HEAD_DIM + GROUP - 1) // GROUP):
                low = tl.load(vmin_ptr + param + g, mask=present, other=0.0).to(tl.float32)
                step = tl.load(vscale_ptr + param + g, mask=present, other=0.0).to(tl.float32)
                v += tl.where((d // GROUP)[:, None] == g, low[None, :] + step[None, :] * code, 0.0)
        else:
            v_byte = tl.load(
                vc_ptr
                + (page * svc_p + kv_head * svc_h + within // 2)[:, None]
                + d[None, :] * svc_d,
                mask=mask,
                other=0,
            ).to(tl.int32)
            v_code = ((v_byte >> ((within % 2) * 4)[:, None]) & 15).to(tl.float32)
            v_param = (page * svm_p + within * svm_t + kv_head * svm_h)[:, None] + (d // GROUP)[
                None, :
            ]
            v += (
                tl.load(vmin_ptr + v_param, mask=mask, other=0.0).to(tl.float32)
                + tl.load(vscale_ptr + v_param, mask=mask, other=0.0).to(tl.float32) * v_code
            )
    paged = wanted & ~in_packed
    block = tl.load(tables_ptr + row * stride_tr + pos // BLOCK_SIZE, mask=paged, other=0).to(
        tl.int64
    )
    if WANT_K:
        slot = block * stride_kb + (pos % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        k += tl.load(k_ptr + slot[:, None] + d[None, :], mask=paged[:, None], other=0.0).to(
            tl.float32
        )
    vslot = block * stride_vb + (pos % BLOCK_SIZE) * stride_vt + kv_head * stride_vh
    if V_BY_CHANNEL:
        v += tl.load(v_ptr + vslot[None, :] + d[:, None], mask=paged[None, :], other=0.0).to(
            tl.float32
        )
    else:
        v += tl.load(v_ptr + vslot[:, None] + d[None, :], mask=paged[:, None], other=0.0).to(
            tl.float32
        )
    return k, v


@triton.jit
def packed_gather_kernel(
    positions_ptr,
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
    out_k_ptr,
    out_v_ptr,
    stride_pr,
    stride_ph,
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
    stride_or,
    stride_oh,
    stride_on,
    count,
    GROUP_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    LEVELS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """K and V [BLOCK_N, D] of one (row, query head)'s positions (-1: zeros), in the output
    dtype (:func:`reconstruct_rows`)."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    kv_head = head // GROUP_Q
    d = tl.arange(0, HEAD_DIM)
    pos = tl.load(positions_ptr + row * stride_pr + head * stride_ph + n, mask=n < count, other=-1)
    k, v = reconstruct_rows(
        pos,
        row,
        kv_head,
        d,
        kc_ptr,
        kmin_ptr,
        kscale_ptr,
        vc_ptr,
        vmin_ptr,
        vscale_ptr,
        level_tables_ptr + row * stride_lr,
        level_maps_ptr + row * stride_mr,
        level_kinds_ptr,
        packed_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
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
        stride_ll,
        stride_ml,
        stride_kr,
        stride_kb,
        stride_kt,
        stride_kh,
        stride_vb,
        stride_vt,
        stride_vh,
        stride_tr,
        BLOCK_N,
        HEAD_DIM,
        GROUP,
        BLOCK_SIZE,
        LEVELS,
        True,
    )
    out = row * stride_or + head * stride_oh + n[:, None] * stride_on + d[None, :]
    valid = (n < count)[:, None]
    tl.store(out_k_ptr + out, k.to(out_k_ptr.dtype.element_ty), mask=valid)
    tl.store(out_v_ptr + out, v.to(out_v_ptr.dtype.element_ty), mask=valid)
