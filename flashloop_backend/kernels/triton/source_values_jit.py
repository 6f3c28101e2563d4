"""Triton code of the BF16 loop-2 source's value pass and of the selection's finish
(wrappers in ``threshold_select.py``): split programs read every value of their positions
once, summing the dense output and the contribution of the keys the selection took (the
attention read the keys only; packed KV sums its own contribution); a last launch sums
the partials and the selection's mass.
"""

import triton
import triton.language as tl

from flashloop_backend.kernels.triton.select_jit import _order_key, take_selected
from flashloop_backend.kernels.triton.specialization import BLOCK_TABLE_ROWS, SCALAR_PER_ROW


@triton.jit(do_not_specialize=BLOCK_TABLE_ROWS, do_not_specialize_on_alignment=SCALAR_PER_ROW)
def source_values_kernel(
    logits_ptr,
    lse_ptr,
    lengths_ptr,
    plan_ptr,
    offsets_ptr,
    v_ptr,
    tables_ptr,
    part_out_ptr,
    part_contrib_ptr,
    stride_lr,
    stride_lh,
    stride_er,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_tr,
    chunk,
    num_splits,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """One (row, KV head, split) of the compaction's positions: every value row of the
    split read once for the GROUP query heads that share it, p = exp(logit - lse) from
    ``logits`` [R, H, T] and ``lse`` [R, H]; partials [R, H, S, D] of the dense output
    sum p v (``part_out``) and of the contribution, the same sum over the selected keys
    (``part_contrib``: the compaction's rule, keys above the plan's threshold and the ties
    at it whose rank is below its count). USE_DOT multiplies on tensor cores with p in the
    values' dtype, the same rounding in both sums, so their difference is the unselected
    keys' share exactly as computed."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    g = tl.arange(0, GROUP_PAD)
    in_group = g < GROUP
    heads = kv_head * GROUP + g
    pair = row * (tl.num_programs(1) * GROUP) + heads
    threshold = tl.load(plan_ptr + pair * 3, mask=in_group, other=0).to(tl.uint32, bitcast=True)
    remaining = tl.load(plan_ptr + pair * 3 + 1, mask=in_group, other=0)
    ties_seen = tl.load(offsets_ptr + (pair * num_splits + split) * 2 + 1, mask=in_group, other=0)
    lse = tl.load(lse_ptr + row * stride_er + heads, mask=in_group, other=0.0)
    length = tl.load(lengths_ptr + row)
    first = split * chunk
    last = tl.minimum(first + chunk, length)
    n = tl.arange(0, BLOCK_N)
    d = tl.arange(0, HEAD_DIM)
    logits_rows = logits_ptr + row * stride_lr + heads[:, None] * stride_lh
    acc_out = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    acc_sel = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    if GROUP == 1 and USE_DOT:  # one head: its plan as scalars (the padded entries are 0)
        threshold = tl.sum(threshold, 0)
        remaining = tl.sum(remaining, 0)
        ties_seen = tl.sum(ties_seen, 0)
        lse = tl.sum(lse, 0)
    for start in range(first, last, BLOCK_N):
        pos = start + n
        visible = pos < last
        block = tl.load(tables_ptr + row * stride_tr + pos // BLOCK_SIZE, mask=visible, other=0)
        v = tl.load(
            v_ptr
            + block.to(tl.int64)[:, None] * stride_vb
            + (pos % BLOCK_SIZE)[:, None] * stride_vt
            + kv_head * stride_vh
            + d[None, :],
            mask=visible[:, None],
            other=0.0,
        )
        if GROUP == 1 and USE_DOT:
            # one query head: its selection as vectors, and p and the selected p as rows 0
            # and 1 of the padded tile, so one dot sums the output and the contribution
            logit = tl.load(
                logits_ptr + row * stride_lr + kv_head * stride_lh + pos,
                mask=visible,
                other=float("-inf"),
            )
            take, ties = take_selected(
                _order_key(logit), visible, threshold, remaining, ties_seen, 0
            )
            p = tl.where(visible, tl.exp(logit - lse), 0.0)
            both = tl.where(
                g[:, None] == 0,
                p[None, :],
                tl.where((g[:, None] == 1) & take[None, :], p[None, :], 0.0),
            )
            acc_out += tl.dot(both.to(v.dtype), v, input_precision=DOT_PRECISION)
            ties_seen += ties
        else:
            live = in_group[:, None] & visible[None, :]
            logit = tl.load(logits_rows + pos[None, :], mask=live, other=float("-inf"))
            take, ties = take_selected(
                _order_key(logit),
                live,
                threshold[:, None],
                remaining[:, None],
                ties_seen[:, None],
                1,
            )
            p = tl.where(live, tl.exp(logit - lse[:, None]), 0.0)
            p_sel = tl.where(take, p, 0.0)
            if USE_DOT:
                acc_out += tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
                acc_sel += tl.dot(p_sel.to(v.dtype), v, input_precision=DOT_PRECISION)
            else:
                values = v.to(tl.float32)[None, :, :]
                acc_out += tl.sum(p[:, :, None] * values, axis=1)
                acc_sel += tl.sum(p_sel[:, :, None] * values, axis=1)
            ties_seen += ties
    if GROUP == 1 and USE_DOT:  # rows 0 and 1 of the one tile
        acc_sel = tl.sum(tl.where(g[:, None] == 1, acc_out, 0.0), 0)[None, :] + acc_sel
        acc_out = tl.sum(tl.where(g[:, None] == 0, acc_out, 0.0), 0)[None, :] + tl.zeros_like(
            acc_out
        )
    part = ((pair * num_splits + split) * HEAD_DIM)[:, None] + d[None, :]
    tl.store(part_out_ptr + part, acc_out, mask=in_group[:, None])
    tl.store(part_contrib_ptr + part, acc_sel, mask=in_group[:, None])


@triton.jit
def select_finish_kernel(
    part_mass_ptr,
    part_contrib_ptr,
    part_out_ptr,
    output_ptr,
    out_ptr,
    mass_ptr,
    contrib_ptr,
    stride_or,
    stride_oh,
    stride_qr,
    stride_qh,
    stride_mr,
    stride_cr,
    stride_ch,
    num_splits,
    num_value_splits,
    HEAD_DIM: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    VALUE_SPLITS_PAD: tl.constexpr,
    VALUES: tl.constexpr,
):
    """One (row, head): mass [R, H] summed over the compaction's [R, H, S] partials in
    split order; with VALUES, a value pass's [R, H, S', D] partials summed into the
    contribution [R, H, D] and the dense output [R, H, D] FP32 (``output``, otherwise
    read); the dense output also in ``out``'s dtype."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pair = row * tl.num_programs(1) + head
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_DIM)
    in_split = s < num_splits
    mass = tl.load(part_mass_ptr + pair * num_splits + s, mask=in_split, other=0.0)
    tl.store(mass_ptr + row * stride_mr + head, tl.sum(mass, 0))
    if VALUES:
        v = tl.arange(0, VALUE_SPLITS_PAD)
        in_value = v < num_value_splits
        parts = (pair * num_value_splits + v)[:, None] * HEAD_DIM + d[None, :]
        contrib = tl.load(part_contrib_ptr + parts, mask=in_value[:, None], other=0.0)
        tl.store(contrib_ptr + row * stride_cr + head * stride_ch + d, tl.sum(contrib, 0))
        dense = tl.sum(tl.load(part_out_ptr + parts, mask=in_value[:, None], other=0.0), 0)
        tl.store(output_ptr + row * stride_or + head * stride_oh + d, dense)
    else:
        dense = tl.load(output_ptr + row * stride_or + head * stride_oh + d)
    tl.store(out_ptr + row * stride_qr + head * stride_qh + d, dense.to(out_ptr.dtype.element_ty))
