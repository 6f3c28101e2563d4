"""The FlashInfer adapter's plan reuse, on CPU with a stand-in for the FlashInfer wrapper:
a plan is reused for the same unmodified tensors or equal contents, never for changed ones."""

import pytest
import torch

from flashloop_backend.kernels.flashinfer import FlashInferPagedAttention


class _Wrapper:
    def run(self, q, caches):
        return torch.ones_like(q)  # non-zero: padding rows must be zeroed by the adapter


def _adapter(plans: list):
    adapter = object.__new__(FlashInferPagedAttention)  # no flashinfer import on CPU
    adapter._key, adapter.use_prefill, adapter.decode = None, False, _Wrapper()

    def plan(tables, lengths, device, *rest):
        plans.append((tables.clone(), lengths.clone()))
        adapter.empty_rows = (lengths == 0).to(device)
        adapter.has_empty_rows = bool(adapter.empty_rows.any())

    adapter.plan = plan
    return adapter


def test_plan_reused_for_the_same_tensors_and_redone_when_they_change(monkeypatch):
    compared = []
    equal = torch.equal
    monkeypatch.setattr(torch, "equal", lambda a, b: compared.append(1) or equal(a, b))
    plans = []
    adapter = _adapter(plans)
    q = torch.randn(2, 2, 16)
    cache = torch.randn(4, 16, 2, 16)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lengths = torch.tensor([20, 30], dtype=torch.int32)
    for _ in range(3):  # every layer of one traversal
        adapter(q, cache, cache, tables, lengths)
    assert len(plans) == 1 and not compared  # same objects: no device comparison (a sync)
    tables[1, 1] = 0  # modified in place: same object, new version
    adapter(q, cache, cache, tables, lengths)
    assert len(plans) == 2 and plans[-1][0][1, 1] == 0
    adapter(q, cache, cache, tables.clone(), lengths.clone())  # equal contents, new objects
    assert len(plans) == 2 and compared
    adapter(q, cache, cache, tables, torch.tensor([21, 30], dtype=torch.int32))
    assert len(plans) == 3


def test_plan_sequences_groups_a_prefill_chunk_and_keeps_decode_rows_apart():
    """Hand-worked plan, block size 4: a 3-row chunk of one sequence (positions 4-6, table
    [3, 5]), a decode row at position 7 (table [1, 2]) and a padding row."""
    from flashloop_backend.kernels.flashinfer import plan_sequences

    tables = torch.tensor([[3, 5], [3, 5], [3, 5], [1, 2], [-1, -1]], dtype=torch.int32)
    lengths = torch.tensor([5, 6, 7, 8, 0], dtype=torch.int32)
    qo, kv_indptr, indices, last = plan_sequences(tables, lengths, 4)
    assert qo.tolist() == [0, 3, 4, 5]  # sequences: the chunk, the decode row, the padding row
    assert kv_indptr.tolist() == [0, 2, 4, 5]  # 7 keys -> 2 pages, 8 -> 2, padding -> 1
    assert indices.tolist() == [3, 5, 1, 2, 0]
    assert last.tolist() == [3, 4, 1]
    assert all(t.dtype == torch.int32 for t in (qo, kv_indptr, indices, last))


def test_plan_sequences_splits_rows_whose_lengths_do_not_continue():
    from flashloop_backend.kernels.flashinfer import plan_sequences

    tables = torch.tensor([[3, 5], [3, 5]], dtype=torch.int32)
    qo, *_ = plan_sequences(tables, torch.tensor([6, 6], dtype=torch.int32), 4)
    assert qo.tolist() == [0, 1, 2]  # two decode rows of one table at the same position


def test_planned_wrapper_is_the_wrapper_the_last_call_planned(monkeypatch):
    """Benchmarks time FlashInfer's kernel alone through ``planned_wrapper``: the wrapper of
    the device's last planned call, and a LookupError before any call planned there."""
    from flashloop_backend.kernels import flashinfer

    device = torch.device("cpu")
    adapter = _adapter([])
    monkeypatch.setattr(flashinfer, "_INSTANCES", {device: adapter})
    with pytest.raises(LookupError, match="no paged_attention_flashinfer call"):
        flashinfer.planned_wrapper(device)
    q, cache = torch.randn(2, 2, 16), torch.randn(4, 16, 2, 16)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    flashinfer.paged_attention_flashinfer(q, cache, cache, tables, torch.tensor([20, 30]).int())
    assert flashinfer.planned_wrapper(device) is adapter.decode


def test_padding_rows_are_zeroed_and_a_batch_without_them_returns_the_kernel_output():
    adapter = _adapter([])
    q = torch.randn(2, 2, 16)
    cache = torch.randn(4, 16, 2, 16)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    out = adapter(q, cache, cache, tables, torch.tensor([20, 0], dtype=torch.int32))
    assert torch.equal(out[0], torch.ones_like(out[0])) and torch.equal(
        out[1], torch.zeros_like(out[1])
    )
    out = adapter(q, cache, cache, tables, torch.tensor([20, 30], dtype=torch.int32))
    assert torch.equal(out, torch.ones_like(out))
