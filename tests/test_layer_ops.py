"""The model's fused per-layer kernels against their torch references (the interpreter on
a CPU, the GPU's Triton there): fp32 / fp16 here, bf16 on the GPU."""

import pytest
import torch

from flashloop_backend.host import layer_ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# one rounding of the activations' dtype apart at most (FP32 sums in another order)
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(got, expected, dtype):
    torch.testing.assert_close(got.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_x", [True, False], ids=["add_then_norm", "norm_only"])
def test_add_rms_norm_matches_the_sandwich_reference(dtype, with_x, rng):
    h, x = (torch.randn(5, 48, generator=rng).to(DEVICE, dtype) for _ in range(2))
    w1, w2 = (torch.randn(48, generator=rng).to(DEVICE, dtype) for _ in range(2))
    x, w1 = (x, w1) if with_x else (None, None)
    expected = layer_ops.add_rms_norm(h, x, w1, w2, 1e-6, use_triton=False)
    got = layer_ops.add_rms_norm(h, x, w1, w2, 1e-6, use_triton=True)
    for mine, ref in zip(got, expected, strict=True):
        _close(mine, ref, dtype)
    if not with_x:
        assert got[0] is h  # nothing added: the residual stream is the input itself


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_of_the_fused_projection_matches_the_reference(dtype, rng):
    q_heads, kv_heads, dim = 4, 2, 16
    qkv = torch.randn(3, (q_heads + 2 * kv_heads) * dim, generator=rng).to(DEVICE, dtype)
    angles = torch.randn(3, dim, generator=rng).to(DEVICE)
    cos, sin = angles.cos(), angles.sin()
    expected = layer_ops.rope_qk(qkv, cos, sin, q_heads, kv_heads, dim, use_triton=False)
    got = layer_ops.rope_qk(qkv, cos, sin, q_heads, kv_heads, dim, use_triton=True)
    for mine, ref in zip(got, expected, strict=True):
        assert mine.shape == ref.shape
        _close(mine, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [40, 2048])
def test_silu_mul_matches_the_reference(dtype, inter, rng):
    gate_up = torch.randn(3, 2 * inter, generator=rng).to(DEVICE, dtype)
    expected = layer_ops.silu_mul(gate_up, use_triton=False)
    _close(layer_ops.silu_mul(gate_up, use_triton=True), expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_write_lands_every_real_row_and_skips_padding(dtype, rng):
    """Slots across blocks of a strided per-layer view; -1 (padding) writes nowhere that
    is read."""
    pool = torch.zeros(6, 3, 4, 2, 16, dtype=dtype, device=DEVICE)  # [blocks, layers, bs, H, D]
    caches = {use: (pool.clone()[:, 1], pool.clone()[:, 1]) for use in (False, True)}
    k, v = (torch.randn(3, 2, 16, generator=rng).to(DEVICE, dtype) for _ in range(2))
    slots = torch.tensor([5, -1, 17], device=DEVICE)
    for use, (key_view, value_view) in caches.items():
        layer_ops.write_kv(key_view, value_view, slots, k, v, scratch=20, use_triton=use)
    for ref, mine in zip(caches[False], caches[True], strict=True):
        assert torch.equal(ref[:5], mine[:5])  # block 5 is the reference's scratch
    assert torch.equal(caches[True][0][1, 1], k[0]) and torch.equal(caches[True][1][4, 1], v[2])


def test_rope_of_a_head_width_off_powers_of_two_takes_the_reference(rng):
    """The kernel spans a head with one power-of-two range: a 24-wide head gets the
    reference's result, not a launch that cannot compile."""
    qkv = torch.randn(2, 4 * 24, generator=rng).to(DEVICE)
    angles = torch.randn(2, 24, generator=rng).to(DEVICE)
    cos, sin = angles.cos(), angles.sin()
    expected = layer_ops.rope_qk(qkv, cos, sin, 2, 1, 24, use_triton=False)
    got = layer_ops.rope_qk(qkv, cos, sin, 2, 1, 24, use_triton=True)
    for mine, ref in zip(got, expected, strict=True):
        assert torch.equal(mine, ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3], ids=["one_row_lanes", "three_rows_dot"])
def test_small_rows_linear_matches_f_linear(dtype, rows, rng):
    # 40 outputs and 300 inputs: neither a multiple of the tile, so both masks are used
    x = torch.randn(rows, 300, generator=rng).to(DEVICE, dtype)
    weight = (torch.randn(40, 300, generator=rng) / 16).to(DEVICE, dtype)
    tuning = layer_ops.LinearTuning(block_n=16, block_k=128, max_rows=4)
    got = layer_ops.linear(x, weight, use_triton=True, tuning=tuning)
    expected = torch.nn.functional.linear(x.float(), weight.float())
    assert got.shape == (rows, 40) and got.dtype == dtype
    # FP32 sums of 300 products: the result's own rounding plus the order of the sums
    _close(got, expected.to(dtype), dtype)


def test_linear_takes_f_linear_beyond_the_small_row_limit(rng):
    x = torch.randn(5, 32, generator=rng)
    weight = torch.randn(16, 32, generator=rng)
    tuning = layer_ops.LinearTuning(max_rows=4)
    got = layer_ops.linear(x, weight, use_triton=True, tuning=tuning)
    assert torch.equal(got, torch.nn.functional.linear(x, weight))


def test_small_rows_linear_refuses_a_tile_too_narrow_for_tensor_cores(rng):
    x = torch.randn(3, 32, generator=rng)
    weight = torch.randn(16, 32, generator=rng)
    tuning = layer_ops.LinearTuning(block_n=4, max_rows=4)
    with pytest.raises(ValueError, match="block_n=4 must be >= 16"):
        layer_ops.linear(x, weight, use_triton=True, tuning=tuning)


def test_small_rows_linear_names_mismatched_shapes(rng):
    x = torch.randn(1, 24, generator=rng)
    weight = torch.randn(16, 32, generator=rng)
    with pytest.raises(ValueError, match=r"x \[R, 32\].*got x \(1, 24\), weight \(16, 32\)"):
        layer_ops.linear(x, weight, use_triton=True)
