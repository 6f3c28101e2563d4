"""INT4 base + residual reference (RFC §3.3, DESIGN §4)."""

import pytest
import torch

from flashloop_backend.algorithms import (
    QuantizedInt4,
    dequantize_int4,
    encode_residual_chain,
    quantize_int4,
    reconstruct,
    unpack_codes,
)


def test_rfc_residual_is_taken_against_the_reconstruction():
    """X1 = 10.03 reconstructs as 10.00; X2 = 10.08 must store 0.08, not the raw 0.05."""
    x1 = torch.linspace(10.0, 11.5, 16)
    x1[1] = 10.03  # group scale 0.1: 10.03 -> code 0 -> 10.00
    x2 = x1.clone()
    x2[1] = 10.08
    chain = encode_residual_chain([x1, x2], group_size=16)
    assert reconstruct(chain, 0)[1].item() == pytest.approx(10.00, abs=1e-6)
    residual_input = x2 - reconstruct(chain, 0)
    assert residual_input[1].item() == pytest.approx(0.08, abs=1e-5)
    assert dequantize_int4(chain[1])[1].item() == pytest.approx(0.08, abs=5e-3)  # not 0.05
    assert reconstruct(chain, 1)[1].item() == pytest.approx(10.08, abs=5e-3)


def test_constant_group_stores_scale_zero_and_decodes_to_min():
    q = quantize_int4(torch.full((32,), 3.25), group_size=16)
    assert q.scale.tolist() == [0.0, 0.0]
    assert (unpack_codes(q) == 0).all()
    assert torch.equal(dequantize_int4(q), torch.full((32,), 3.25))


def test_packing_low_nibble_first_and_fp16_parameters():
    x = torch.arange(16.0)  # min 0, scale 1: codes 0..15
    q = quantize_int4(x, group_size=16)
    assert q.minimum.dtype == torch.float16 and q.scale.dtype == torch.float16
    assert q.codes.tolist() == [[0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]]
    assert torch.equal(dequantize_int4(q), x)


def test_round_half_to_even():
    x = torch.tensor([0.0, 0.5, 1.5, 2.5] + [15.0] * 12)  # scale exactly 1
    codes = unpack_codes(quantize_int4(x, group_size=16))[0, :4].tolist()
    assert codes == [0, 0, 2, 2]


def test_partial_trailing_group_uses_only_its_own_elements():
    x = torch.cat([torch.zeros(16) + torch.arange(16.0), torch.tensor([100.0, 101.0, 103.0])])
    q = quantize_int4(x, group_size=16)
    assert q.minimum.tolist() == [0.0, 100.0]
    assert q.scale[1].item() == pytest.approx(3 / 15, rel=1e-3)
    out = dequantize_int4(q)
    assert out.shape == x.shape
    assert (out[16:] - x[16:]).abs().max().item() <= q.scale[1].item() / 2 + 1e-3


def _per_element(encoded: QuantizedInt4, field: torch.Tensor) -> torch.Tensor:
    """A per-group FP16 parameter spread over the original elements."""
    ones = torch.full_like(encoded.codes, 0x11)  # every code 1
    spread = QuantizedInt4(
        ones, torch.zeros_like(field), field, encoded.shape, encoded.dim, encoded.group_size
    )
    return dequantize_int4(spread)


@pytest.mark.parametrize(("shape", "dim"), [((70, 3, 8), 0), ((5, 2, 64), -1), ((3, 40), 1)])
def test_bounded_error_without_accumulation_across_depths(shape, dim, rng):
    versions = [torch.randn(shape, generator=rng)]
    for _ in range(3):  # later loops change less, as in looped models
        versions.append(versions[-1] + 0.2 * torch.randn(shape, generator=rng))
    chain = encode_residual_chain(versions, group_size=16, dim=dim)
    for depth, encoded in enumerate(chain):
        # The error at a depth is that level's quantization error alone (no accumulation):
        # half a step, plus FP16 rounding of the stored minimum and of 15 steps.
        scale = _per_element(encoded, encoded.scale)
        minimum = _per_element(encoded, encoded.minimum.float().abs().to(torch.float16))
        bound = scale / 2 + (minimum + 15 * scale) * 2.0**-10 + 1e-6
        error = (versions[depth] - reconstruct(chain, depth)).abs()
        assert (error <= bound).all(), (depth, (error - bound).max())


def test_k_grouped_over_tokens_and_v_over_channels(rng):
    k = torch.randn(
        128, 2, 64, generator=rng
    )  # [T, H, D]: post-RoPE K grouped per channel over tokens
    qk = quantize_int4(k, group_size=64, dim=0)
    assert qk.minimum.shape == (2, 64, 2)  # per (head, channel), two token groups
    qv = quantize_int4(k, group_size=64, dim=-1)
    assert qv.minimum.shape == (128, 2, 1)  # per (token, head), one channel group
    with pytest.raises(ValueError, match="group_size=15"):
        quantize_int4(k, group_size=15)
    with pytest.raises(ValueError, match="depth=4"):
        reconstruct(encode_residual_chain([k], 64, 0), 4)


def test_compact_chain_inactive_rows_inherit_and_maps_are_explicit(rng):
    from flashloop_backend.algorithms import encode_compact_chain, reconstruct_compact

    rows = 40
    x1 = torch.randn(rows, 2, 8, generator=rng)
    active2 = torch.ones(rows, dtype=torch.bool)
    active3 = torch.arange(rows) % 4 == 1  # a quarter of the tokens recompute loop 3
    x2 = x1 + 0.1 * torch.randn(rows, 2, 8, generator=rng)
    x3 = torch.where(active3[:, None, None], x2 + 0.05 * torch.randn(rows, 2, 8, generator=rng), x2)
    chain = encode_compact_chain([x1, x2, x3], [active2, active2, active3], group_size=16, dim=0)
    assert chain.rows[2].tolist() == active3.nonzero().flatten().tolist()
    assert chain.levels[2].shape[0] == int(active3.sum())  # payload only for active rows
    level2, level3 = reconstruct_compact(chain, 1), reconstruct_compact(chain, 2)
    assert torch.equal(level3[~active3], level2[~active3])  # absent residual = inheritance
    assert (level3[active3] - x3[active3]).abs().max() < (x3[active3] - level2[active3]).abs().max()
    assert torch.allclose(reconstruct_compact(chain, 0), dequantize_int4(chain.levels[0]))


def test_compact_chain_depth_is_checked(rng):
    from flashloop_backend.algorithms import encode_compact_chain, reconstruct_compact

    x = torch.randn(16, 1, 4, generator=rng)
    chain = encode_compact_chain([x], [torch.ones(16, dtype=torch.bool)], group_size=16, dim=0)
    with pytest.raises(ValueError, match=r"depth=1 is outside the chain's \[0, 1\)"):
        reconstruct_compact(chain, 1)
