import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashloop_backend.dispatch import RowMode, partition_rows

D, V, P, I, X = RowMode.DECODE, RowMode.VERIFY, RowMode.PREFILL, RowMode.INACTIVE, RowMode.PAD  # noqa: E741

CASES = {
    # name: (modes, decode rows, active prefill rows)
    "rfc_example": ([I, D, P, I, D, P], [1, 4], [2, 5]),
    "all_decode": ([D, D, D], [0, 1, 2], []),
    "all_prefill": ([P, P, P, P], [], [0, 1, 2, 3]),
    "empty": ([], [], []),
    "padding_only": ([X, X, X], [], []),
    "verify_is_decode": ([P, V, V, D, X], [1, 2, 3], [0]),
    "inactive_only": ([I, I], [], []),
    "mixed_with_padding": ([X, P, D, I, V, P, X], [2, 4], [1, 5]),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_table(name):
    modes, decode, prefill = CASES[name]
    part = partition_rows(torch.tensor([int(m) for m in modes], dtype=torch.int8))
    assert part.segments() == (decode, prefill)
    kept = decode + prefill
    assert part.order.tolist()[: len(kept)] == kept
    for row in range(len(modes)):
        expected = kept.index(row) if row in kept else -1
        assert int(part.inverse[row]) == expected


def test_rejects_non_vector():
    with pytest.raises(ValueError, match="1-D"):
        partition_rows(torch.zeros(2, 2, dtype=torch.int8))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(list(RowMode)), max_size=40))
def test_stable_and_inverse_round_trips(modes):
    part = partition_rows(torch.tensor([int(m) for m in modes], dtype=torch.int8).reshape(-1))
    order = part.order.tolist()
    assert sorted(order) == list(range(len(modes)))  # a permutation
    decode, prefill = part.segments()
    # stable: each segment keeps the original order and holds exactly its modes
    assert decode == [i for i, m in enumerate(modes) if m in (D, V)]
    assert prefill == [i for i, m in enumerate(modes) if m == P]
    kept = decode + prefill
    for row in range(len(modes)):
        idx = int(part.inverse[row])
        if row in kept:
            assert order[idx] == row  # inverse undoes the gather
        else:
            assert idx == -1
    # scattering gathered values back restores the kept rows
    values = torch.arange(len(modes)) * 10
    gathered = values[part.order]
    restored = gathered[part.inverse.clamp(min=0)]
    mask = part.inverse >= 0
    assert torch.equal(restored[mask], values[mask])


def test_verify_spans_mark_each_verification_group_at_its_first_row():
    from flashloop_backend.dispatch import verify_spans

    M = RowMode
    modes = [M.VERIFY] * 3 + [M.DECODE, M.VERIFY, M.VERIFY, M.VERIFY, M.VERIFY, M.PAD, M.VERIFY]
    requests = [7, 7, 7, 8, 9, 9, 4, 4, 5, 5]
    depths = [2, 2, 2, 0, 1, 1, 1, 3, 0, 0]
    spans = verify_spans(
        torch.tensor([int(m) for m in modes], dtype=torch.int8),
        torch.tensor(requests),
        torch.tensor(depths),
    )
    # request 7's three rows; 9's two; 4's rows sit at two depths (two groups of one);
    # a row after a padding row starts its own group
    assert spans.dtype == torch.int32
    assert spans.tolist() == [3, 0, 0, 1, 2, 0, 1, 1, 1, 1]
    empty = torch.zeros(0, dtype=torch.int64)
    assert verify_spans(empty.to(torch.int8), empty, empty).tolist() == []
