"""Sparse decode attention reference: the RFC's worked example and its invariants."""

import math

import pytest
import torch

from flashloop_backend.algorithms import selected_count, sparse_correct, sparse_reference_state


def _logit_keys(probs):
    """Keys whose scaled logits (scale 1, q = [1]) are log p: softmax gives back p."""
    return torch.tensor([math.log(p) for p in probs]).reshape(-1, 1, 1)


def test_rfc_worked_example():
    q = torch.ones(1, 1)
    k = _logit_keys([0.1, 0.3, 0.6])
    v = torch.tensor([10.0, 20.0, 30.0]).reshape(3, 1, 1)
    state = sparse_reference_state(q, k, v, key_retention=2 / 3, scale=1.0)
    assert state.indices.tolist() == [[2, 1]]  # the two most probable keys
    assert state.mass.item() == pytest.approx(0.9)
    assert state.output.item() == pytest.approx(25.0)
    assert state.contribution.item() == pytest.approx(24.0)
    # later loop: selected softmax [0.75, 0.25] over selected values [20, 40]
    k_later = k.clone()
    k_later[1, 0, 0], k_later[2, 0, 0] = math.log(0.75), math.log(0.25)
    v_later = torch.tensor([10.0, 20.0, 40.0]).reshape(3, 1, 1)
    out = sparse_correct(state, q, k_later, v_later, scale=1.0)
    assert out.item() == pytest.approx(23.5)


def test_full_retention_equals_dense_attention(rng):
    q, k, v = (
        torch.randn(4, 16, generator=rng),
        torch.randn(9, 4, 16, generator=rng),
        torch.randn(9, 4, 16, generator=rng),
    )
    state = sparse_reference_state(q, k, v, key_retention=1.0)
    assert state.mass.tolist() == pytest.approx([1.0] * 4)
    k2, v2 = torch.randn(9, 4, 16, generator=rng), torch.randn(9, 4, 16, generator=rng)
    dense = torch.softmax(torch.einsum("hd,thd->ht", q, k2) / 4.0, -1)
    expected = torch.einsum("ht,thd->hd", dense, v2)
    torch.testing.assert_close(sparse_correct(state, q, k2, v2), expected, atol=1e-5, rtol=1e-5)
    # and at the reference loop itself the correction is exactly the reference output
    torch.testing.assert_close(sparse_correct(state, q, k, v), state.output, atol=1e-5, rtol=1e-5)


def test_heads_select_independently_and_current_token_can_rank(rng):
    q = torch.zeros(2, 1)
    q[0, 0], q[1, 0] = 1.0, -1.0
    k = torch.tensor([3.0, 0.0, 0.0, -3.0]).reshape(4, 1, 1).expand(4, 2, 1).contiguous()
    v = torch.arange(4.0).reshape(4, 1, 1).expand(4, 2, 1).contiguous()
    state = sparse_reference_state(q, k, v, key_retention=0.25, scale=1.0)
    assert state.indices.tolist() == [[0], [3]]  # head 1 picks the last (current) token


def test_ties_go_to_the_earlier_position():
    q = torch.ones(1, 1)
    k = torch.zeros(5, 1, 1)  # all probabilities equal
    state = sparse_reference_state(q, k, torch.randn(5, 1, 1), key_retention=0.4, scale=1.0)
    assert state.indices.tolist() == [[0, 1]]


def test_gqa_and_counts(rng):
    q = torch.randn(4, 8, generator=rng)
    k, v = torch.randn(20, 2, 8, generator=rng), torch.randn(20, 2, 8, generator=rng)
    state = sparse_reference_state(q, k, v, key_retention=0.1)
    assert state.indices.shape == (4, 2)
    assert (state.mass > 0).all() and (state.mass <= 1).all()
    assert (
        selected_count(0.1, 20) == 2 and selected_count(0.1, 3) == 1 and selected_count(1.0, 7) == 7
    )
    assert selected_count(0.1, 30) == 3  # 0.1 * 30 is 3.0000000000000004 in binary: still 3
    with pytest.raises(ValueError, match=r"query heads \(3\)"):
        sparse_reference_state(torch.randn(3, 8), k, v)
    with pytest.raises(ValueError, match="key_retention=0"):
        selected_count(0, 5)
