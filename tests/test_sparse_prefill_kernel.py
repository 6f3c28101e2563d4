"""Tiled nonconsecutive-query prefill (Triton; interpreter on CPU) against a
position-indexed mask reference and the per-row paged reference."""

import dataclasses

import pytest
import torch

from flashloop_backend.kernels.torch_ref.paged import paged_attention
from flashloop_backend.kernels.triton.sparse_prefill import (
    PrefillTuning,
    key_splits,
    sparse_prefill_triton,
    tile_starts,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
SMALL = PrefillTuning(block_m=16, block_n=16, min_keys_per_split=16)  # up to 5 key splits


def test_tile_starts_cut_at_segments_and_every_block_m_rows():
    tables = torch.tensor([[1, 2]] * 5 + [[3, 4]] * 2 + [[1, 2]], dtype=torch.int32)
    starts, count = tile_starts(tables.to(DEVICE), 2)
    # segments [0, 5), [5, 7), [7, 8) -> tiles at 0, 2, 4 | 5 | 7
    assert count.tolist() == [5]
    assert starts.tolist() == [0, 2, 4, 5, 7, 8, 8, 8, 8]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (4, 2)])
def test_nonconsecutive_queries_match_a_position_indexed_mask(dtype, hq, hkv, rng):
    length, block, dim = 80, 16, 16
    keys = torch.randn(length, hkv, dim, generator=rng)
    values = torch.randn(length, hkv, dim, generator=rng)
    positions = torch.tensor([0, 3, 4, 9, 17, 18, 30, 31, 47, 50, 63, 64, 70, 71, 78, 79, 5])
    q = torch.randn(len(positions), hq, dim, generator=rng)
    # reference: every query against the whole sequence, masked by absolute position
    mask = torch.arange(length)[None, :] <= positions[:, None]  # [Q, T]
    expanded_k = keys.repeat_interleave(hq // hkv, dim=1)
    expanded_v = values.repeat_interleave(hq // hkv, dim=1)
    logits = torch.einsum("qhd,thd->hqt", q, expanded_k) / dim**0.5
    probs = torch.softmax(logits.masked_fill(~mask[None], float("-inf")), dim=-1)
    expected = torch.einsum("hqt,thd->qhd", probs, expanded_v)
    # the same sequence in shuffled pages
    pages = torch.tensor([4, 0, 2, 5, 1])
    cache_k = torch.zeros(6, block, hkv, dim)
    cache_v = torch.zeros(6, block, hkv, dim)
    cache_k[pages] = keys.reshape(5, block, hkv, dim)
    cache_v[pages] = values.reshape(5, block, hkv, dim)
    tables = pages.int()[None, :].repeat(len(positions), 1)
    got = sparse_prefill_triton(
        q.to(DEVICE, dtype),
        cache_k.to(DEVICE, dtype),
        cache_v.to(DEVICE, dtype),
        tables.to(DEVICE),
        (positions + 1).int().to(DEVICE),
        tuning=SMALL,
    )
    torch.testing.assert_close(got.float().cpu(), expected, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("max_registers", [None, 128], ids=["free", "capped"])
@pytest.mark.parametrize("keys_per_split", [16, 1 << 30], ids=["key_splits", "one_split"])
def test_several_sequences_padding_and_split_tiles_match_the_paged_reference(
    dtype, max_registers, keys_per_split, rng
):
    """Key splits merged by merge_splits, or one split writing its output directly."""
    hq = hkv = 2
    dim, block = 16, 16
    kc = torch.randn(12, block, hkv, dim, generator=rng).to(DEVICE, dtype)
    vc = torch.randn(12, block, hkv, dim, generator=rng).to(DEVICE, dtype)
    first = torch.tensor([3, 5, 7, 1], dtype=torch.int32)
    second = torch.tensor([0, 2, 4, 6], dtype=torch.int32)
    # 20 rows of sequence A (more than one tile), 2 padding rows, 7 rows of B, then A again
    lengths_a = torch.tensor(
        [1, 2, 5, 6, 7, 12, 13, 20, 21, 22, 30, 33, 40, 41, 44, 45, 50, 57, 60, 64]
    )
    lengths_b = torch.tensor([64, 10, 11, 12, 40, 41, 2])
    lengths = torch.cat([lengths_a, torch.zeros(2, dtype=torch.long), lengths_b, torch.tensor([9])])
    tables = torch.cat(
        [first.repeat(20, 1), torch.full((2, 4), -1, dtype=torch.int32), second.repeat(7, 1),
         first[None]]
    )  # fmt: skip
    q = torch.randn(len(lengths), hq, dim, generator=rng).to(DEVICE, dtype)
    # a cap spills, no more
    tuning = dataclasses.replace(
        SMALL, max_registers=max_registers, min_keys_per_split=keys_per_split
    )
    got = sparse_prefill_triton(
        q, kc, vc, tables.to(DEVICE), lengths.int().to(DEVICE), tuning=tuning
    )
    expected = paged_attention(
        q.float(), kc.float(), vc.float(), tables.to(DEVICE), lengths.int().to(DEVICE)
    )
    torch.testing.assert_close(got.float(), expected, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(got[20:22], torch.zeros_like(got[20:22]))  # padding rows: zeros


def test_rejects_a_non_power_of_two_head_dim():
    kc = torch.zeros(2, 16, 1, 24, device=DEVICE)
    one = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim=24 must be a power of two"):
        sparse_prefill_triton(torch.zeros(1, 1, 24, device=DEVICE), kc, kc, one[:, None], one)


def test_tile_starts_are_planned_once_per_tables_tensor(monkeypatch):
    """Every layer passes the same tables: planned once; another tensor with the same
    values, an in-place change or another tile height plans again."""
    from flashloop_backend.kernels.triton import sparse_prefill

    calls = []
    real = sparse_prefill.tile_starts
    monkeypatch.setattr(sparse_prefill, "tile_starts", lambda *a: calls.append(1) or real(*a))
    tables = torch.tensor([[1, 2]] * 5 + [[3, 4]] * 3, dtype=torch.int32, device=DEVICE)
    first = sparse_prefill.planned_tile_starts(tables, 2)
    assert sparse_prefill.planned_tile_starts(tables, 2) is first and len(calls) == 1
    sparse_prefill.planned_tile_starts(tables.clone(), 2)
    sparse_prefill.planned_tile_starts(tables, 4)
    assert len(calls) == 3
    assert sparse_prefill.planned_tile_starts(tables, 4)[1].tolist() == [3]  # 0, 4 | 5
    tables[5:] = tables[0]  # one segment now: the plan must follow the contents
    assert sparse_prefill.planned_tile_starts(tables, 4)[1].tolist() == [2]  # 0, 4
    assert len(calls) == 4
    del tables  # the memo does not keep a step's tables alive
    assert sparse_prefill._LAST_TILES[0][0]() is None
    with torch.inference_mode():  # inference tensors keep no version: planned every call
        frozen = torch.tensor([[1, 2]] * 3, dtype=torch.int32, device=DEVICE)
        for _ in range(2):
            assert sparse_prefill.planned_tile_starts(frozen, 2)[1].tolist() == [2]
    assert len(calls) == 6


def test_a_launch_that_fills_a_wave_unsplit_does_not_split_its_keys():
    tuning = PrefillTuning()  # two programs an SM
    # a 2,048-row chunk over 16 heads: 256 programs of 264 slots on 132 SMs
    assert key_splits(16, 16, 32768, 132, tuning) == 1
    assert key_splits(12, 16, 32768, 132, tuning) == 1
    # one tile: as many splits as fill the slots, each at least min_keys_per_split keys
    assert key_splits(1, 16, 32768, 132, tuning) == 16
    assert key_splits(1, 16, 1024, 132, tuning) == 1024 // tuning.min_keys_per_split
    assert key_splits(4, 16, 32768, 132, tuning) == 4
    # more programs than one wave holds: one split, never zero
    assert key_splits(40, 16, 32768, 132, tuning) == 1
