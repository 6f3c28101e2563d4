"""Triton code of the model's per-layer work around attention (wrappers in ``layer_ops.py``).

Each kernel handles one row and reproduces the torch reference's rounding points: FP32
statistics and arithmetic, the result rounded to the activations' dtype where the
reference rounds it.
"""

import triton
import triton.language as tl


@triton.jit
def add_rmsnorm_kernel(
    h_ptr,
    x_ptr,
    x_weight_ptr,
    next_weight_ptr,
    h_out_ptr,
    y_ptr,
    hidden,
    stride_h,
    stride_x,
    stride_ho,
    stride_y,
    eps,
    HAS_X: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row: h' = h + norm_x(x) (skipped without ``HAS_X``), y = norm_next(h'), where
    norm_w(z) = w * round(z * rsqrt(mean(z^2) + eps)) with FP32 statistics."""
    row = tl.program_id(0).to(tl.int64)
    col = tl.arange(0, BLOCK)
    valid = col < hidden
    h = tl.load(h_ptr + row * stride_h + col, mask=valid, other=0.0)
    dtype = h.dtype
    if HAS_X:
        x = tl.load(x_ptr + row * stride_x + col, mask=valid, other=0.0).to(tl.float32)
        inv = tl.math.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
        normed = (x * inv).to(dtype).to(tl.float32)
        wx = tl.load(x_weight_ptr + col, mask=valid, other=0.0).to(tl.float32)
        h = (h.to(tl.float32) + (wx * normed).to(dtype).to(tl.float32)).to(dtype)
        tl.store(h_out_ptr + row * stride_ho + col, h, mask=valid)
    h32 = h.to(tl.float32)
    inv_h = tl.math.rsqrt(tl.sum(h32 * h32, axis=0) / hidden + eps)
    wn = tl.load(next_weight_ptr + col, mask=valid, other=0.0).to(tl.float32)
    y = wn * (h32 * inv_h).to(dtype).to(tl.float32)
    tl.store(y_ptr + row * stride_y + col, y.to(dtype), mask=valid)


@triton.jit
def rope_qk_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    k_ptr,
    stride_qkv,
    stride_cs,
    stride_q,
    stride_k,
    Q_HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """One (row, head of q then k): x * cos + rotate_half(x) * sin in FP32, rounded once.
    The fused projection holds q, k, v heads in that order along a row."""
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HEAD_DIM)
    partner = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    base = qkv_ptr + row * stride_qkv + head * HEAD_DIM
    x = tl.load(base + d)
    dtype = x.dtype
    x = x.to(tl.float32)
    rotated = sign * tl.load(base + partner).to(tl.float32)
    cos = tl.load(cos_ptr + row * stride_cs + d)
    sin = tl.load(sin_ptr + row * stride_cs + d)
    out = (x * cos + rotated * sin).to(dtype)
    if head < Q_HEADS:
        tl.store(q_ptr + row * stride_q + head * HEAD_DIM + d, out)
    else:
        tl.store(k_ptr + row * stride_k + (head - Q_HEADS) * HEAD_DIM + d, out)


@triton.jit
def silu_mul_kernel(gate_up_ptr, out_ptr, inter, stride_gu, stride_o, BLOCK: tl.constexpr):
    """One (row, block of channels): round(round(silu(gate)) * up), gate and up side by
    side in the fused projection's row."""
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = col < inter
    gate = tl.load(gate_up_ptr + row * stride_gu + col, mask=valid, other=0.0)
    up = tl.load(gate_up_ptr + row * stride_gu + inter + col, mask=valid, other=0.0)
    dtype = gate.dtype
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + col, (silu * up.to(tl.float32)).to(dtype), mask=valid)


@triton.jit
def kv_write_kernel(
    k_ptr,
    v_ptr,
    slots_ptr,
    key_cache_ptr,
    value_cache_ptr,
    stride_kr,
    stride_vr,
    stride_cb,
    stride_co,
    block_size,
    width,
    WIDTH: tl.constexpr,
):
    """One row: its K and V (``width`` = Hkv * D contiguous values) into the cache slot
    ``slots[row]`` (skipped for -1, a padding row)."""
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + row)
    if slot >= 0:
        i = tl.arange(0, WIDTH)
        valid = i < width
        at = (slot // block_size) * stride_cb + (slot % block_size) * stride_co + i
        tl.store(key_cache_ptr + at, tl.load(k_ptr + row * stride_kr + i, mask=valid), mask=valid)
        tl.store(value_cache_ptr + at, tl.load(v_ptr + row * stride_vr + i, mask=valid), mask=valid)
