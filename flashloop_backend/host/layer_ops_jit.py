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
    HEADS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """One row, every head of q then k: x * cos + rotate_half(x) * sin in FP32, rounded
    once. The fused projection holds q, k, v heads in that order along a row."""
    row = tl.program_id(0).to(tl.int64)
    half: tl.constexpr = HEAD_DIM // 2
    head = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_DIM)[None, :]
    valid = (head < Q_HEADS + KV_HEADS) & (d < HEAD_DIM)
    partner = tl.where(d < half, d + half, d - half)
    sign = tl.where(d < half, -1.0, 1.0)
    base = qkv_ptr + row * stride_qkv + head * HEAD_DIM
    x = tl.load(base + d, mask=valid, other=0.0)
    dtype = x.dtype
    rotated = sign * tl.load(base + partner, mask=valid, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + row * stride_cs + d)
    sin = tl.load(sin_ptr + row * stride_cs + d)
    out = (x.to(tl.float32) * cos + rotated * sin).to(dtype)
    is_q = head < Q_HEADS
    tl.store(q_ptr + row * stride_q + head * HEAD_DIM + d, out, mask=valid & is_q)
    k_head = tl.where(is_q, 0, head - Q_HEADS)
    tl.store(k_ptr + row * stride_k + k_head * HEAD_DIM + d, out, mask=valid & ~is_q)


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


@triton.jit
def small_rows_linear_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rows,
    n_out,
    k_in,
    stride_x,
    stride_w,
    stride_y,
    ROWS_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_DOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """A block of BLOCK_N outputs of y = x W^T for every one of a few rows, each weight
    tile read once, FP32 accumulation. ``USE_DOT``: tensor-core tiles with the rows padded
    to ROWS_PAD >= 16; else (ROWS_PAD == 1) per-lane products summed once at the end."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    r = tl.arange(0, ROWS_PAD)
    r_ok = r < rows
    if USE_DOT:
        acc = tl.zeros((ROWS_PAD, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_ok = k < k_in
        w_at = w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :]
        w = tl.load(w_at, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        if USE_DOT:
            x_at = x_ptr + r[:, None] * stride_x + k[None, :]
            x = tl.load(x_at, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w), input_precision=DOT_PRECISION)
        else:
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    dtype = y_ptr.dtype.element_ty
    if USE_DOT:
        y_at = y_ptr + r[:, None] * stride_y + n[None, :]
        tl.store(y_at, acc.to(dtype), mask=r_ok[:, None] & n_ok[None, :])
    else:
        tl.store(y_ptr + n, tl.sum(acc, axis=1).to(dtype), mask=n_ok)
