"""Sparse decode attention end to end: state store, paged reference ops, backend dispatch,
and the host against the naive model running the RFC algorithm."""

import os

import pytest
import torch

from flashloop_backend import FlashLoopConfig
from flashloop_backend.algorithms import sparse_correct, sparse_reference_state
from flashloop_backend.backends.sparse_state import ReferenceStates, key_bucket
from flashloop_backend.capabilities import SupportRequest
from flashloop_backend.dispatch import BatchView, RowMode
from flashloop_backend.host import Engine, SamplingParams
from flashloop_backend.host.naive import NaiveOuro
from flashloop_backend.kernels.torch_ref.paged import paged_attention
from flashloop_backend.kernels.torch_ref.sparse_decode import dense_source, sparse_correction
from flashloop_backend.registry import Registry

from .host_helpers import tiny_model

REQUEST = SupportRequest(head_dim=16, block_size=4, num_q_heads=4, num_kv_heads=2)
PROMPTS = [
    [1, 5, 9, 3, 22, 7, 8, 2, 40, 11, 12, 4, 4, 17, 30, 2, 2, 9, 50, 1, 19],
    [4, 4, 17, 9],
    [30, 2, 2, 9, 50, 1, 19, 8],
]


def sparse_config(key_retention):
    return FlashLoopConfig(
        sparse_decode_attention={"enabled": True, "key_retention": key_retention}
    )


def _pages(rng):
    kc, vc = torch.randn(10, 4, 2, 8, generator=rng), torch.randn(10, 4, 2, 8, generator=rng)
    tables = torch.tensor([[3, 1, 7], [2, 5, -1], [0, 0, 0]], dtype=torch.int32)
    return kc, vc, tables, torch.tensor([11, 6, 0], dtype=torch.int32)


def _row(cache, tables, r, n):
    return cache[tables[r].long().clamp(min=0)].reshape(-1, *cache.shape[2:])[:n]


def test_paged_ops_match_the_per_row_reference(rng):
    kc, vc, tables, lengths = _pages(rng)
    q = torch.randn(3, 4, 8, generator=rng)
    out, idx, mass, ref_out, contribution = dense_source(q, kc, vc, tables, lengths, 0.3, 16)
    torch.testing.assert_close(out, paged_attention(q, kc, vc, tables, lengths))  # loop 2 = dense
    k2, v2 = torch.randn_like(kc), torch.randn_like(vc)
    corrected = sparse_correction(q, k2, v2, tables, idx, mass, ref_out, contribution)
    for r, n in ((0, 11), (1, 6)):
        state = sparse_reference_state(q[r], _row(kc, tables, r, n), _row(vc, tables, r, n), 0.3)
        # the kernels' order: positions increasing (the reference state's is by probability)
        chosen = state.indices.sort(-1).values
        assert idx[r, :, : state.indices.shape[1]].tolist() == chosen.tolist()
        assert (idx[r, :, state.indices.shape[1] :] == -1).all()
        expected = sparse_correct(state, q[r], _row(k2, tables, r, n), _row(v2, tables, r, n))
        torch.testing.assert_close(corrected[r], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and (idx[2] == -1).all()


def test_state_store_incarnations_and_retirement():
    states = ReferenceStates(
        num_slots=2, num_layers=1, num_heads=1, head_dim=2, k_bucket=16, device="cpu"
    )
    slots, inc = torch.tensor([0, 1, -1]), torch.tensor([7, 8, 9])
    keep = torch.tensor([True, False, True])
    idx = torch.zeros(3, 1, 2, dtype=torch.int32)
    states.write(
        0, slots, inc, keep, idx, torch.ones(3, 1), torch.ones(3, 1, 2), torch.ones(3, 1, 2)
    )
    assert states.ready(0, slots, inc).tolist() == [
        True,
        False,
        False,
    ]  # row 1 not kept, row 2 no slot
    assert states.ready(0, torch.tensor([0]), torch.tensor([8])).tolist() == [
        False
    ]  # a newer token
    states.retire(0)
    assert states.ready(0, slots, inc).tolist() == [False, False, False]
    with pytest.raises(ValueError, match="exceed the state's bucket"):
        states.write(
            0,
            slots,
            inc,
            keep,
            torch.zeros(3, 1, 17, dtype=torch.int32),
            torch.ones(3, 1),
            torch.ones(3, 1, 2),
            torch.ones(3, 1, 2),
        )
    assert key_bucket(0.1, 4096) == 416


@pytest.mark.parametrize("width", [16, 11])
def test_the_triton_reference_store_writes_what_indexing_writes(width, rng):
    """One launch for every field: indices padded with -1 to the bucket, mass, output,
    contribution and the incarnation at each row's slot, against the indexing writes;
    rows not kept go to the scratch slot and leave the others untouched."""
    from flashloop_backend.backends.sparse_state import store_by_indexing
    from flashloop_backend.kernels.triton.reference_store import store_reference_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton store runs on a GPU or under TRITON_INTERPRET=1")
    shape = {"num_slots": 3, "num_layers": 2, "num_heads": 2, "head_dim": 16, "k_bucket": 16}
    by_index = ReferenceStates(**shape, device=device)
    by_kernel = ReferenceStates(**shape, device=device)
    target = torch.tensor([2, 0, 1, 0], device=device)
    keep = torch.tensor([True, True, False, False], device=device)
    rows = by_index.write_rows(target, torch.tensor([5, 6, 7, 8], device=device), keep)
    idx = torch.randint(0, 100, (4, 2, width), generator=rng, dtype=torch.int32).to(device)
    mass = torch.rand(4, 2, generator=rng).to(device)
    output, contribution = (torch.randn(4, 2, 16, generator=rng).to(device) for _ in range(2))
    fields = (idx, mass, output, contribution)
    store_by_indexing(by_index.tensors(), 1, *rows, *fields)
    store_reference_triton(by_kernel.tensors(), 1, *rows, *fields)
    *per_slot, incarnation = by_kernel.tensors()
    *want_per_slot, want_incarnation = by_index.tensors()
    for mine, want in zip(per_slot, want_per_slot, strict=True):
        assert torch.equal(mine[:, :3], want[:, :3])  # slot 3 is scratch
    assert torch.equal(incarnation[:3], want_incarnation[:3])
    assert incarnation[:3, 1].tolist() == [6, -1, 5]
    assert (by_kernel.indices[1, 2, :, width:] == -1).all()


def test_missing_reference_runs_dense_and_is_counted(rng):
    backend = Registry.discover().create("flashloop", REQUEST, sparse_config(0.1))
    backend.reserve_state(4, 1, 4, 16, 64, "cpu")
    kc, vc = torch.randn(8, 4, 2, 16, generator=rng), torch.randn(8, 4, 2, 16, generator=rng)
    one = torch.ones(2, dtype=torch.int64)
    view = BatchView(
        positions=torch.tensor([9, 5]), depths=torch.tensor([2, 3]),
        row_modes=torch.tensor([RowMode.DECODE, RowMode.DECODE], dtype=torch.int8),
        slots=torch.tensor([0, 1]), incarnations=torch.tensor([3, 4]), request_ids=one, window_ids=-one,
        context_lengths=torch.tensor([10, 6], dtype=torch.int32),
        block_tables=torch.tensor([[[1, 2, 3], [4, 5, 6]]] * 4, dtype=torch.int32),
    )  # fmt: skip
    q = torch.randn(2, 4, 16, generator=rng)
    out = backend.forward(q, kc, vc, view, layer=0)
    dense = paged_attention(q, kc, vc, view.row_block_tables(), view.context_lengths)
    torch.testing.assert_close(out, dense)
    assert int(backend.states.missing_reference) == 2


def _engine(model, config, **kwargs):
    backend = Registry.discover().create("flashloop", REQUEST, config)
    return Engine(model, backend, num_blocks=128, block_size=4, **kwargs), backend


@pytest.mark.parametrize("key_retention", [0.1, 0.3])
def test_host_matches_naive_sparse_algorithm(key_retention):
    model = tiny_model(seed=1)
    naive = NaiveOuro(model.config, dict(model.state_dict()), key_retention=key_retention)
    params = [SamplingParams(max_new_tokens=n) for n in (8, 5, 6)]
    engine, backend = _engine(
        model, sparse_config(key_retention), prefill_chunk=5, max_batch_tokens=7
    )
    results = engine.generate(PROMPTS, params)  # mixed batches: rows at different depths
    for prompt, p, result in zip(PROMPTS, params, results, strict=True):
        assert result.output_token_ids == naive.generate(prompt, p.max_new_tokens)[0]
    assert int(backend.states.missing_reference) == 0
    assert int(backend.states.sources_written) > 0
    dense = [
        r.output_token_ids for r in _engine(model, FlashLoopConfig())[0].generate(PROMPTS, params)
    ]
    assert [r.output_token_ids for r in results] != dense  # the approximation is really active


def test_full_retention_equals_dense():
    model = tiny_model(seed=2)
    sparse = _engine(model, sparse_config(1.0))[0].generate(
        PROMPTS, SamplingParams(max_new_tokens=6)
    )
    dense = _engine(model, FlashLoopConfig())[0].generate(PROMPTS, SamplingParams(max_new_tokens=6))
    assert [r.output_token_ids for r in sparse] == [r.output_token_ids for r in dense]


def test_error_paths(rng):
    kc, vc, tables, lengths = _pages(rng)
    q = torch.randn(3, 4, 8, generator=rng)
    with pytest.raises(ValueError, match="k_bucket=2 cannot hold"):
        dense_source(q, kc, vc, tables, lengths, 0.3, 2)
    backend = Registry.discover().create("flashloop", REQUEST, sparse_config(0.1))
    one = torch.ones(1, dtype=torch.int64)
    view = BatchView(
        positions=one, depths=one, row_modes=torch.tensor([RowMode.DECODE], dtype=torch.int8), slots=one,
        incarnations=one, request_ids=one, window_ids=-one, context_lengths=torch.tensor([2], dtype=torch.int32),
        block_tables=torch.zeros(4, 1, 1, dtype=torch.int32),
    )  # fmt: skip
    with pytest.raises(
        RuntimeError,
        match=r"reserve\(EngineCapacity\) \(or reserve_state\) before the first forward",
    ):
        backend.forward(
            torch.randn(1, 4, 16, generator=rng),
            torch.randn(2, 4, 2, 16),
            torch.randn(2, 4, 2, 16),
            view,
        )


def test_a_row_without_a_usable_slot_targets_the_scratch_slot():
    states = ReferenceStates(5, 1, 1, 4, 16, "cpu")
    slots = torch.arange(-10, 20)
    usable = (slots >= 0) & (slots < 5)
    assert torch.equal(states.target(slots), torch.where(usable, slots, 5))
    assert states.target(slots.int()).dtype == torch.int32


@pytest.mark.parametrize("depths", [{0}, {1}, {0, 1}, {2}, {1, 3}, None])
def test_a_batch_reads_reference_readiness_only_where_a_row_can_correct(depths, monkeypatch):
    """Loop 1-2 decode rows and prompt rows never correct: a batch whose host-named decode
    depths are all below loop 3 plans its routes without the readiness gather (its launches
    are graph nodes of every loop-1 and loop-2 step); unknown depths read it."""
    from flashloop_backend.backends.batch_plan import BatchPlan, PlanRouting

    config = sparse_config(0.1)
    states = ReferenceStates(4, 2, 4, 16, 16, "cpu")
    reads = []
    monkeypatch.setattr(
        states, "ready_layers", lambda *a: reads.append(1) or torch.ones(2, 2, dtype=torch.bool)
    )
    one = torch.ones(2, dtype=torch.int64)
    row_depths = sorted(depths or {2}) * 2
    view = BatchView(
        positions=torch.tensor([9, 5]),
        depths=torch.tensor(row_depths[:2]),
        row_modes=torch.tensor([RowMode.DECODE, RowMode.DECODE], dtype=torch.int8),
        slots=torch.tensor([0, 1]),
        incarnations=torch.tensor([3, 4]),
        request_ids=one,
        window_ids=-one,
        context_lengths=torch.tensor([10, 6], dtype=torch.int32),
        block_tables=torch.zeros(4, 2, 3, dtype=torch.int32),
        decode_only=True,
        decode_depths=None if depths is None else frozenset(depths),
    )
    routing = PlanRouting(BatchPlan.of(view, config), states, config)
    corrects = depths is None or max(depths) >= 2
    assert bool(reads) == corrects
    assert routing.routes.dim() == (2 if corrects else 1)
