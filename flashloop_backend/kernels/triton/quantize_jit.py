"""Triton code for affine INT4 quantize-and-pack (wrapper in ``quantize.py``)."""

import triton
import triton.language as tl


@triton.jit
def int4_codes(x, m32, s32):
    """INT4 codes (FP32 0..15) of x from FP32 copies of the stored minimum and scale
    (broadcast to x's shape), rounded half to even; 0 where the scale is 0 (a constant
    group stores code 0)."""
    ratio = tl.math.div_rn(x - m32, tl.where(s32 > 0, s32, 1.0))
    # round half to even: floor(r + 0.5), minus one where r sat exactly halfway on an odd result
    up = tl.floor(ratio + 0.5)
    halfway = (up - ratio) == 0.5
    odd = (up - 2.0 * tl.floor(up * 0.5)) == 1.0
    code = tl.where(halfway & odd, up - 1.0, up)
    code = tl.minimum(tl.maximum(code, 0.0), 15.0)
    return tl.where(s32 > 0, code, 0.0)


@triton.jit
def quantize_int4_kernel(
    x_ptr,
    codes_ptr,
    min_ptr,
    scale_ptr,
    length,
    stride_xo,
    stride_xl,
    stride_co,
    stride_cg,
    stride_po,
    GROUP: tl.constexpr,
):
    """One (outer row, group): FP16 min and scale from the group's own elements, codes
    rounded half to even from the stored parameters, two codes per byte (low nibble first)."""
    outer = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    i = tl.arange(0, GROUP)
    pos = group * GROUP + i
    valid = pos < length
    x = tl.load(x_ptr + outer * stride_xo + pos * stride_xl, mask=valid, other=0.0).to(tl.float32)
    low = tl.min(tl.where(valid, x, float("inf")), axis=0)
    high = tl.max(tl.where(valid, x, float("-inf")), axis=0)
    min16 = low.to(tl.float16)
    scale16 = tl.math.div_rn(high - low, 15.0).to(tl.float16)
    code = int4_codes(x, min16.to(tl.float32), scale16.to(tl.float32))
    code = tl.where(valid, code, 0.0).to(tl.uint8)
    pair = tl.reshape(code, (GROUP // 2, 2))
    even, odd_codes = tl.split(pair)
    packed = even | (odd_codes << 4)
    j = tl.arange(0, GROUP // 2)
    tl.store(codes_ptr + outer * stride_co + group * stride_cg + j, packed)
    tl.store(min_ptr + outer * stride_po + group, min16)
    tl.store(scale_ptr + outer * stride_po + group, scale16)
