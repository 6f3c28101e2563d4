"""The model's per-layer work around attention, fused where a GPU runs it: the sandwich
residual add with both RMSNorms, RoPE of q and k from the fused QKV projection, SiLU x up
from the fused gate-up projection, and the KV write. Each op has a torch reference (the
math the naive model uses; it runs on the CPU) and one Triton kernel (``layer_ops_jit``)
taken for CUDA tensors, or everywhere with ``use_triton=True`` (the interpreter tests).

Shapes: R rows, H hidden, Hq / Hkv heads of D dims, I intermediate channels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from flashloop_backend.kernels.triton.paged_decode import next_pow2


def _triton(x: torch.Tensor, use_triton: bool | None) -> bool:
    return x.is_cuda if use_triton is None else use_triton


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * round(x * rsqrt(mean(x^2) + eps)), statistics in FP32: x [..., H]."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(
    h: torch.Tensor,
    x: torch.Tensor | None,
    x_weight: torch.Tensor | None,
    next_weight: torch.Tensor,
    eps: float,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h', y) with h' = h + norm(x; x_weight) (h' = h without ``x``) and y = norm(h';
    next_weight): h, x [R, H]; weights [H]."""
    if not _triton(h, use_triton):
        if x is not None:
            h = h + rms_norm_reference(x, x_weight, eps)
        return h, rms_norm_reference(h, next_weight, eps)
    from flashloop_backend.host.layer_ops_jit import add_rmsnorm_kernel

    rows, hidden = h.shape
    if h.stride(-1) != 1 or (x is not None and x.stride(-1) != 1):
        raise ValueError("add_rms_norm needs rows with a unit inner stride")
    out = torch.empty_like(h) if x is not None else h
    y = torch.empty_like(h)
    if rows:
        add_rmsnorm_kernel[(rows,)](
            h,
            x if x is not None else h,
            x_weight if x_weight is not None else next_weight,
            next_weight,
            out,
            y,
            hidden,
            h.stride(0),
            (x if x is not None else h).stride(0),
            out.stride(0),
            y.stride(0),
            eps,
            HAS_X=x is not None,
            BLOCK=next_pow2(hidden),
        )
    return out, y


def rope_qk(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    use_triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Post-RoPE q [R, Hq, D], k [R, Hkv, D] and v [R, Hkv, D] (a view) from the fused
    projection qkv [R, (Hq + 2 Hkv) * D] and the FP32 tables cos, sin [R, D]."""
    rows = qkv.shape[0]
    q, k, v = qkv.view(rows, q_heads + 2 * kv_heads, head_dim).split(
        (q_heads, kv_heads, kv_heads), dim=1
    )
    # the kernel spans a head with one power-of-two range; other widths take the reference
    if not _triton(qkv, use_triton) or head_dim & (head_dim - 1):
        return rope_reference(q, cos, sin), rope_reference(k, cos, sin), v
    from flashloop_backend.host.layer_ops_jit import rope_qk_kernel

    if qkv.stride(-1) != 1 or cos.stride(-1) != 1 or cos.stride() != sin.stride():
        raise ValueError("rope_qk needs unit inner strides and cos/sin of one layout")
    q_out = torch.empty((rows, q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    k_out = torch.empty((rows, kv_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if rows:
        rope_qk_kernel[(rows,)](
            qkv,
            cos,
            sin,
            q_out,
            k_out,
            qkv.stride(0),
            cos.stride(0),
            q_out.stride(0),
            k_out.stride(0),
            Q_HEADS=q_heads,
            KV_HEADS=kv_heads,
            HEADS_PAD=1 << (q_heads + kv_heads - 1).bit_length(),
            HEAD_DIM=head_dim,
        )
    return q_out, k_out, v


@dataclass(frozen=True)
class LinearTuning:
    """Launch shape of the small-rows linear kernel; ``max_rows``: more rows take cuBLAS."""

    block_n: int = 4
    block_k: int = 1024
    num_warps: int = 2
    num_stages: int = 3
    use_dot: bool = False
    max_rows: int = 1


# The launch shape with the least total time over Ouro-1.4B's four projections at one row
# (scripts/bench_small_linear.py; results/bench_small_linear.json): at 16 rows cuBLAS is
# as fast, so more than one row takes it.
DEFAULT_LINEAR = LinearTuning()


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    use_triton: bool | None = None,
    tuning: LinearTuning = DEFAULT_LINEAR,
) -> torch.Tensor:
    """x [R, K] @ weight [N, K]^T -> [R, N] in x's dtype: a decode step's few rows through
    one Triton pass over the weights (FP32 accumulation), other row counts through
    ``F.linear``."""
    rows = x.shape[0]
    if not _triton(x, use_triton) or not 0 < rows <= tuning.max_rows:
        return F.linear(x, weight)
    from flashloop_backend.host.layer_ops_jit import small_rows_linear_kernel

    n_out, k_in = weight.shape
    if x.shape[1] != k_in or x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError(
            f"linear needs x [R, {k_in}] and weight [N, {k_in}] with unit inner strides; "
            f"got x {tuple(x.shape)}, weight {tuple(weight.shape)}"
        )
    use_dot = tuning.use_dot or rows > 1
    if use_dot and tuning.block_n < 16:
        raise ValueError(
            f"block_n={tuning.block_n} must be >= 16 for tensor-core tiles (use_dot, or "
            f"{rows} rows with max_rows={tuning.max_rows})"
        )
    y = torch.empty((rows, n_out), dtype=x.dtype, device=x.device)
    small_rows_linear_kernel[(-(-n_out // tuning.block_n),)](
        x,
        weight,
        y,
        rows,
        n_out,
        k_in,
        x.stride(0),
        weight.stride(0),
        y.stride(0),
        ROWS_PAD=max(16, next_pow2(rows)) if use_dot else 1,
        BLOCK_N=tuning.block_n,
        BLOCK_K=tuning.block_k,
        USE_DOT=use_dot,
        # FP32 inputs keep IEEE products (TF32 would lose ~3 digits)
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        num_warps=tuning.num_warps,
        num_stages=tuning.num_stages,
    )
    return y


def rope_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., H, D] rotated by cos/sin [..., D] (broadcast over heads), computed in FP32."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat((-x32[..., half:], x32[..., :half]), dim=-1)
    return (x32 * cos[..., None, :] + rotated * sin[..., None, :]).to(x.dtype)


def silu_mul(gate_up: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """silu(gate) * up from gate_up [R, 2I] (gate first): [R, I]."""
    inter = gate_up.shape[-1] // 2
    if not _triton(gate_up, use_triton):
        return F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
    from flashloop_backend.host.layer_ops_jit import silu_mul_kernel

    rows = gate_up.shape[0]
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, next_pow2(inter))
    if rows:
        silu_mul_kernel[(rows, -(-inter // block))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0), BLOCK=block
        )
    return out


def write_kv(
    key_view: torch.Tensor,
    value_view: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scratch: int,
    use_triton: bool | None = None,
) -> None:
    """k, v [R, Hkv, D] into one layer's cache views [NB, BS, Hkv, D] at flat slots [R]
    (int64; -1: a padding row, whose write lands in the scratch slots from ``scratch`` on
    in the reference and is skipped by the kernel: nothing reads either)."""
    block_size = key_view.shape[1]
    if not _triton(k, use_triton):
        spread = scratch + torch.arange(slots.shape[0], device=slots.device) % block_size
        slots = torch.where(slots >= 0, slots, spread)
        blocks, offsets = slots // block_size, slots % block_size
        key_view[blocks, offsets] = k.to(key_view.dtype)
        value_view[blocks, offsets] = v.to(value_view.dtype)
        return
    from flashloop_backend.host.layer_ops_jit import kv_write_kernel

    width = k.shape[1] * k.shape[2]
    if key_view.stride()[2:] != (k.shape[2], 1) or key_view.stride() != value_view.stride():
        raise ValueError("write_kv needs cache views whose (Hkv, D) rows are contiguous")
    if k.stride()[1:] != (k.shape[2], 1) or v.stride()[1:] != (v.shape[2], 1):
        raise ValueError("write_kv needs k and v rows of contiguous (Hkv, D)")
    if k.dtype != key_view.dtype or v.dtype != value_view.dtype:
        raise ValueError(f"k/v dtype {k.dtype} differs from the cache's {key_view.dtype}")
    if slots.shape[0]:
        kv_write_kernel[(slots.shape[0],)](
            k,
            v,
            slots,
            key_view,
            value_view,
            k.stride(0),
            v.stride(0),
            key_view.stride(0),
            key_view.stride(1),
            block_size,
            width,
            WIDTH=next_pow2(width),
        )
