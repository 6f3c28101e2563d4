"""Triton code that writes a step's loop-2 references into the reference store (wrapper in
``reference_store.py``)."""

import triton
import triton.language as tl

from flashloop_backend.kernels.triton.specialization import LAYER_INDEX


@triton.jit(do_not_specialize=LAYER_INDEX)
def store_reference_kernel(
    slot_ptr,
    incarnation_ptr,
    indices_ptr,
    mass_ptr,
    output_ptr,
    contribution_ptr,
    state_indices_ptr,
    state_mass_ptr,
    state_output_ptr,
    state_contribution_ptr,
    state_incarnation_ptr,
    layer,
    width,
    bucket,
    stride_ir,
    stride_ih,
    stride_mr,
    stride_or,
    stride_oh,
    stride_cr,
    stride_ch,
    stride_sl,
    stride_ss,
    stride_sh,
    stride_ml,
    stride_ms,
    stride_ol,
    stride_os,
    stride_oh2,
    stride_inc,
    head_dim,
    BLOCK_K: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    """One (row, head): the row's selected positions (``width`` of them, -1 up to
    ``bucket``), mass, output and contribution into its slot at ``layer``; head 0 also
    records the row's incarnation there."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    slot = tl.load(slot_ptr + row)
    source = indices_ptr + row * stride_ir + head * stride_ih
    target = state_indices_ptr + layer * stride_sl + slot * stride_ss + head * stride_sh
    for start in range(0, bucket, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        chosen = tl.load(source + k, mask=k < width, other=-1)
        tl.store(target + k, chosen, mask=k < bucket)
    mass = tl.load(mass_ptr + row * stride_mr + head)
    tl.store(state_mass_ptr + layer * stride_ml + slot * stride_ms + head, mass)
    d = tl.arange(0, HEAD_PAD)
    inside = d < head_dim
    output = tl.load(output_ptr + row * stride_or + head * stride_oh + d, mask=inside)
    at = layer * stride_ol + slot * stride_os + head * stride_oh2 + d
    tl.store(state_output_ptr + at, output, mask=inside)
    contribution = tl.load(contribution_ptr + row * stride_cr + head * stride_ch + d, mask=inside)
    tl.store(state_contribution_ptr + at, contribution, mask=inside)
    if head == 0:
        tl.store(state_incarnation_ptr + slot * stride_inc + layer, tl.load(incarnation_ptr + row))
