"""Nonconsecutive prefill rows over their spans: the span plan, and the span op (torch
causal kernel on the CPU, FlashInfer's prefill on a GPU) against the per-row reference."""

import dataclasses

import pytest
import torch

from flashloop_backend.capabilities import Capability, SupportRequest
from flashloop_backend.host import Engine, SamplingParams
from flashloop_backend.kernels.op_protocols import OpName
from flashloop_backend.kernels.ops import KernelImpl
from flashloop_backend.kernels.sequence_plan import plan_host_sequences
from flashloop_backend.kernels.span_plan import MAX_GAP, plan_host_spans, plan_spans
from flashloop_backend.kernels.span_prefill import span_prefill_reference
from flashloop_backend.kernels.torch_ref.paged import paged_prefill
from flashloop_backend.registry import Registry

from .host_helpers import tiny_model
from .test_feature_combinations import _config

BLOCK = 16


def test_spans_follow_one_table_at_increasing_lengths_and_skip_unserved_rows():
    keys = torch.tensor([0, 0, 0, 0, 1, 1, 0, 0])
    lengths = torch.tensor([0, 3, 5, 6, 2, 4, 0, 7 + MAX_GAP], dtype=torch.int32)
    key_tables = torch.tensor([[4, 5], [7, 8]], dtype=torch.int32)
    plan = plan_host_spans(keys, lengths, key_tables, BLOCK)
    assert plan.rows.tolist() == [1, 2, 3, 4, 5, 7]
    # spans: lengths 3..6 of table 0 (4 rows), 2..4 of table 1 (3), then 7 + MAX_GAP alone
    # (a gap of MAX_GAP + 1 from 6 starts a span)
    assert plan.slots.tolist() == [0, 2, 3, 4, 6, 7]
    assert plan.spans.qo_indptr.tolist() == [0, 4, 7, 8]
    assert plan.span_rows == 8 and plan.num_rows == 8
    assert plan.spans.page_indices.tolist() == [4, 7, 4, 5]
    assert plan.spans.last_page_lengths.tolist() == [6, 4, 7 + MAX_GAP - BLOCK]


def test_a_call_that_serves_no_row_plans_no_span():
    plan = plan_host_spans(
        torch.zeros(3, dtype=torch.int64),
        torch.zeros(3, dtype=torch.int32),
        torch.zeros((1, 2), dtype=torch.int32),
        BLOCK,
    )
    assert plan.rows.numel() == 0 and plan.span_rows == 0 and plan.num_rows == 3


def test_the_host_plan_refuses_device_tensors_and_mismatched_shapes():
    with pytest.raises(ValueError, match=r"lengths .* must both be \[rows\]"):
        plan_host_spans(
            torch.zeros(3, dtype=torch.int64),
            torch.zeros(2, dtype=torch.int32),
            torch.zeros((1, 2), dtype=torch.int32),
            BLOCK,
        )
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="host tensors; lengths is on cuda"):
            plan_host_spans(
                torch.zeros(2, dtype=torch.int64),
                torch.zeros(2, dtype=torch.int32, device="cuda"),
                torch.zeros((1, 2), dtype=torch.int32),
                BLOCK,
            )


def _sparse_chunk(rng, dtype, device, hq=4, hkv=2, dim=16):
    """Two prompts' token-sparse chunks beside decode-like rows the call does not serve:
    (q, caches, tables, lengths, table keys, key tables)."""
    blocks = 12
    cache_k = torch.randn(blocks, BLOCK, hkv, dim, generator=rng)
    cache_v = torch.randn(blocks, BLOCK, hkv, dim, generator=rng)
    key_tables = torch.tensor([[3, 0, 7, 1, 9], [2, 5, 11, 4, 6]], dtype=torch.int32)
    first = torch.tensor([0, 2, 3, 5, 6, 7, 9, 10, 11, 12, 14, 15, 16, 19, 22, 23, 50]) + 20
    second = torch.tensor([1, 2, 4, 5, 8, 9, 10, 13, 14]) + 40
    lengths = torch.cat(
        [torch.zeros(3, dtype=torch.long), first + 1, torch.zeros(2, dtype=torch.long), second + 1]
    )
    keys = torch.cat(
        [
            torch.tensor([1, 0, 1]),
            torch.zeros(len(first), dtype=torch.long),
            torch.tensor([1, 0]),
            torch.ones(len(second), dtype=torch.long),
        ]
    )
    tables = key_tables[keys]
    q = torch.randn(len(lengths), hq, dim, generator=rng)
    on = lambda t: t.to(device)  # noqa: E731
    caches = (on(cache_k.to(dtype)), on(cache_v.to(dtype)))
    return on(q.to(dtype)), caches, on(tables), on(lengths.int()), keys, key_tables


@pytest.mark.parametrize("host_plan", [True, False], ids=["host_plan", "device_plan"])
def test_the_span_op_equals_the_per_row_reference(host_plan, rng):
    q, (cache_k, cache_v), tables, lengths, keys, key_tables = _sparse_chunk(
        rng, torch.float32, "cpu"
    )
    plan = plan_host_spans(keys, lengths, key_tables, BLOCK) if host_plan else None
    got = span_prefill_reference(q, cache_k, cache_v, tables, lengths, None, plan)
    expected = paged_prefill(q, cache_k, cache_v, tables, lengths)
    assert plan is None or plan.spans.num_sequences == 3  # the gap of 27 before 50 cuts
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    assert not got[lengths == 0].any()


def test_the_device_plan_groups_rows_by_their_tables_values():
    tables = torch.tensor([[3, 0], [3, 0], [2, 5], [3, 0]], dtype=torch.int32)
    lengths = torch.tensor([4, 6, 3, 7], dtype=torch.int32)
    plan = plan_spans(tables, lengths, BLOCK)
    assert plan.spans.qo_indptr.tolist() == [0, 3, 4, 5]
    assert plan.slots.tolist() == [0, 2, 3, 4]
    # a row the call does not serve, of another table, between two served rows of one
    # table does not cut their span: as the host plans it
    tables = torch.tensor([[3, 0], [2, 5], [3, 0]], dtype=torch.int32)
    lengths = torch.tensor([4, 0, 6], dtype=torch.int32)
    device = plan_spans(tables, lengths, BLOCK)
    host = plan_host_spans(torch.tensor([0, 1, 0]), lengths, tables[:2], BLOCK)
    assert device.spans.qo_indptr.tolist() == host.spans.qo_indptr.tolist() == [0, 3]
    assert device.rows.tolist() == host.rows.tolist() == [0, 2]
    assert device.slots.tolist() == host.slots.tolist() == [0, 2]
    nothing = plan_spans(tables, torch.zeros(3, dtype=torch.int32), BLOCK)
    assert nothing.span_rows == 0 and nothing.num_rows == 3


def test_a_plan_of_other_rows_is_refused(rng):
    q, (cache_k, cache_v), tables, lengths, keys, key_tables = _sparse_chunk(
        rng, torch.float32, "cpu"
    )
    plan = plan_host_spans(keys[:-1], lengths[:-1], key_tables, BLOCK)
    with pytest.raises(
        ValueError, match=f"span_plan covers {len(keys) - 1} rows; the call has {len(keys)}"
    ):
        span_prefill_reference(q, cache_k, cache_v, tables, lengths, None, plan)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU and FlashInfer")
# Ouro-1.4B's heads and dtype, whose FlashInfer prefill kernel the dense prefill builds
@pytest.mark.parametrize("dtype", [torch.bfloat16])
@pytest.mark.parametrize("host_plan", [True, False], ids=["host_plan", "device_plan"])
def test_flashinfer_over_spans_equals_the_per_row_reference(dtype, host_plan, rng):
    pytest.importorskip("flashinfer")
    from flashloop_backend.kernels.flashinfer_span import sparse_prefill_flashinfer

    q, (cache_k, cache_v), tables, lengths, keys, key_tables = _sparse_chunk(
        rng, dtype, "cuda", hq=16, hkv=16, dim=128
    )
    plan = plan_host_spans(keys, lengths.cpu(), key_tables, BLOCK, pin=True) if host_plan else None
    for _ in range(2):  # the second call reuses the plan
        got = sparse_prefill_flashinfer(q, cache_k, cache_v, tables, lengths, None, span_plan=plan)
        expected = paged_prefill(q.float(), cache_k.float(), cache_v.float(), tables, lengths)
        tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
        torch.testing.assert_close(got.float(), expected, atol=tol, rtol=tol)
        assert not got[lengths == 0].any()
    # two rows of one table more than MAX_GAP apart: two spans of one row (still the
    # prefill wrapper)
    apart = torch.zeros_like(lengths)
    apart[3], apart[4] = 21, 21 + MAX_GAP + 1
    plan = plan_host_spans(keys, apart.cpu(), key_tables, BLOCK, pin=True) if host_plan else None
    assert plan is None or plan.spans.num_sequences == plan.span_rows == 2
    got = sparse_prefill_flashinfer(q, cache_k, cache_v, tables, apart, None, span_plan=plan)
    expected = paged_prefill(q.float(), cache_k.float(), cache_v.float(), tables, apart)
    torch.testing.assert_close(got.float(), expected, atol=2e-2, rtol=2e-2)


def _span_engine(flags, record, prefill_chunk=16):
    """An engine whose ``sparse_prefill`` runs over spans by the torch causal reference,
    declaring ``span_prefill`` (every call's span plan, tables and lengths go to
    ``record``), or the registry's choice when ``record`` is None."""
    shape = dict(head_dim=16, block_size=4, num_q_heads=4, num_kv_heads=2)
    backend = Registry.discover().create("flashloop", SupportRequest(**shape), _config(flags))
    if record is not None:
        choice = backend.kernels[OpName.SPARSE_PREFILL]

        def over_spans(q, kc, vc, tables, lengths, scale=None, span_plan=None):
            record.append((span_plan, tables, lengths))
            return span_prefill_reference(q, kc, vc, tables, lengths, scale, span_plan)

        support = choice.impl.support
        declared = {Capability.SPAN_PREFILL, Capability.HOST_SEQUENCE_PLAN}
        support = dataclasses.replace(support, capabilities=support.capabilities | declared)
        impl = KernelImpl(OpName.SPARSE_PREFILL, over_spans, support)
        backend.kernels[OpName.SPARSE_PREFILL] = dataclasses.replace(choice, impl=impl)
    sizes = dict(num_blocks=240, block_size=4, prefill_chunk=prefill_chunk, max_batch_tokens=40)
    return Engine(tiny_model(seed=11), backend, pad_to_multiple=8, **sizes)


SPAN_PROMPTS = [[(5 * i + 2) % 61 for i in range(n)] for n in (70, 12, 45)]


def _chunk_spans(calls) -> list[int]:
    """Positions each request's served rows of each call cover, less one."""
    covered = []
    for _, tables, lengths in calls:
        served, owners = lengths[lengths > 0], tables[lengths > 0]
        for table in owners.unique(dim=0):
            mine = served[(owners == table).all(dim=1)]
            covered.append(int(mine.max() - mine.min()))
    return covered


@pytest.mark.parametrize("quantized", [False, True], ids=["bf16_kv", "all_on"])
def test_the_engine_bounds_span_chunks_by_positions_and_gives_the_same_tokens(quantized):
    flags = {
        "token_sparse_prefill": True,
        "sparse_decode_attention": quantized,
        "kv_residual_quantization": quantized,
    }
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    expected = _span_engine(flags, None)
    assert not expected.chunks_by_positions
    expected = [r.output_token_ids for r in expected.generate(SPAN_PROMPTS, params)]
    by_rows: list = []
    unbounded = _span_engine(flags, by_rows)
    unbounded.chunks_by_positions = False
    calls: list = []
    spans = _span_engine(flags, calls)
    assert spans.chunks_by_positions
    for engine in (unbounded, spans):
        got = engine.generate(SPAN_PROMPTS, params)
        assert [r.output_token_ids for r in got] == expected
    planned = [call for call in calls if call[0] is not None and call[0].rows.numel()]
    assert planned, "no sparse prefill call carried the host's span plan"
    for plan, tables, lengths in planned:
        device = plan_spans(tables, lengths, 4)
        assert torch.equal(plan.rows, device.rows) and torch.equal(plan.slots, device.slots)
        for field in ("qo_indptr", "kv_indptr", "page_indices", "last_page_lengths"):
            assert torch.equal(getattr(plan.spans, field), getattr(device.spans, field)), field
    # a request's chunk covers at most prefill_chunk (16) positions; by rows it covers more
    assert max(_chunk_spans(calls)) < 16
    assert max(_chunk_spans(by_rows)) >= 16


def test_a_span_kernel_serves_only_configs_whose_sparse_loops_keep_enough_rows():
    from flashloop_backend import FlashLoopConfig
    from flashloop_backend.capabilities import Support, not_supported_reasons
    from flashloop_backend.kernels.ops import KernelProvider
    from flashloop_backend.registry import resolve

    support = Support(
        devices=frozenset({"cpu"}),
        dtypes=frozenset({torch.float32}),
        capabilities=frozenset({Capability.NONCONSECUTIVE_QUERIES, Capability.SPAN_PREFILL}),
        min_prefill_retention=0.75,
    )
    request = SupportRequest(device="cpu", dtype=torch.float32, prefill_retention=0.5)
    assert not_supported_reasons(support, request) == [
        "token-sparse prefill retention 0.5 is below 0.75, the least this implementation serves"
    ]
    registry = Registry.discover()
    impl = KernelImpl(OpName.SPARSE_PREFILL, span_prefill_reference, support)
    registry.kernels["span_test"] = KernelProvider(
        "span_test", "0", {OpName.SPARSE_PREFILL: impl}, priority=1000
    )
    request = SupportRequest(device="cpu", dtype=torch.float32)

    def sparse(retention):
        config = FlashLoopConfig(
            token_sparse_prefill={"enabled": True, "window_size": 64, "retention": retention}
        )
        return resolve(config, "flashloop", request, registry).kernels["sparse_prefill"]

    assert sparse([1, 1, 1, 0.75]) == "span_test"
    assert sparse([1, 1, 0.75, 0.75]) == "span_test"
    assert sparse([1, 1, 0.75, 0.5]) != "span_test"
    backend = registry.create(
        "flashloop",
        request,
        FlashLoopConfig(token_sparse_prefill={"enabled": True, "retention": [1, 1, 0.25, 0.1]}),
    )
    why = backend.kernels[OpName.SPARSE_PREFILL].reason
    assert "span_test: token-sparse prefill retention 0.1 is below 0.75" in why
    assert not backend.prefill_chunks_by_positions()


def test_a_device_plan_is_read_once_while_the_same_tensors_come_unmodified():
    from flashloop_backend.kernels.span_plan import DeviceSpanPlans

    plans = DeviceSpanPlans()
    tables = torch.tensor([[3, 0], [3, 0], [2, 5]], dtype=torch.int32)
    lengths = torch.tensor([4, 6, 3], dtype=torch.int32)
    first = plans.plan(tables, lengths, BLOCK)
    assert plans.plan(tables, lengths, BLOCK) is first and plans.reads == 1
    lengths[2] = 0  # modified in place: planned again
    again = plans.plan(tables, lengths, BLOCK)
    assert again is not first and plans.reads == 2 and again.rows.tolist() == [0, 1]
    # equal values in other tensors are planned again (never trusted by address)
    assert plans.plan(tables.clone(), lengths.clone(), BLOCK) is not again
    assert plans.reads == 3


def test_a_device_plan_of_inference_tensors_is_reused_by_content():
    from flashloop_backend.kernels.span_plan import DeviceSpanPlans

    plans = DeviceSpanPlans()
    with torch.inference_mode():
        tables = torch.tensor([[3, 0], [3, 0]], dtype=torch.int32)
        lengths = torch.tensor([4, 6], dtype=torch.int32)
        first = plans.plan(tables, lengths, BLOCK)
        assert plans.plan(tables.clone(), lengths.clone(), BLOCK) is first
        lengths[1] = 5  # no version counter: the content tells
        assert plans.plan(tables, lengths, BLOCK) is not first and plans.reads == 2


def test_the_span_provider_is_opt_in_below_the_tile_kernel():
    from flashloop_backend.kernels import flashinfer_span, torch_ref, triton

    span, tile = flashinfer_span.provider(), triton.provider()
    # below every built-in provider: automatic selection never reaches it
    assert span.priority < min(tile.priority, torch_ref.provider().priority)
    registry = Registry.discover()
    assert registry._kernel_priority(OpName.SPARSE_PREFILL)[-1] == "flashinfer_span"
    assert list(span.impls) == [OpName.SPARSE_PREFILL]
    support = span.impls[OpName.SPARSE_PREFILL].support
    assert Capability.SPAN_PREFILL in support.capabilities
    assert Capability.HOST_SEQUENCE_PLAN not in support.capabilities
    assert support.min_prefill_retention == flashinfer_span.SPAN_MIN_RETENTION
    assert "flashinfer_span" in Registry.discover().kernel_names()


def test_a_span_plan_of_another_page_size_or_with_empty_rows_is_refused(rng):
    from flashloop_backend.kernels.span_plan import check_span_sequences

    q, (cache_k, cache_v), tables, lengths, keys, key_tables = _sparse_chunk(
        rng, torch.float32, "cpu"
    )
    plan = plan_host_spans(keys, lengths, key_tables, BLOCK * 2)
    with pytest.raises(
        ValueError, match=f"the plan's pages hold {BLOCK * 2} keys; the cache's {BLOCK}"
    ):
        span_prefill_reference(q, cache_k, cache_v, tables, lengths, None, plan)
    plan = plan_host_spans(keys, lengths, key_tables, BLOCK)
    with pytest.raises(
        ValueError, match=f"a span run takes a plan of its {plan.span_rows + 1} rows"
    ):
        check_span_sequences(plan.spans, plan.span_rows + 1, BLOCK)
    padded = plan_host_sequences(
        torch.zeros(2, dtype=torch.int64),
        torch.tensor([0, 3], dtype=torch.int32),
        key_tables,
        BLOCK,
    )
    with pytest.raises(ValueError, match="with no empty row; got 2 rows, empty rows True"):
        check_span_sequences(padded, 2, BLOCK)
