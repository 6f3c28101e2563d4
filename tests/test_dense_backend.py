"""Dense backends: decode rows on ``dense_attention``, prefill rows on ``dense_prefill``,
each launched only when the host says its rows may be present."""

import pytest
import torch

from flashloop_backend import FlashLoopConfig
from flashloop_backend.backends.dense import DenseBackend
from flashloop_backend.dispatch import RowMode
from flashloop_backend.kernels.op_protocols import OpName
from flashloop_backend.kernels.ops import KernelImpl
from flashloop_backend.kernels.torch_ref import SUPPORT
from flashloop_backend.kernels.torch_ref.paged import paged_attention
from flashloop_backend.registry import Registry
from flashloop_backend.registry.spec import SelectionInfo

from .test_flashloop_backend import REQUEST, _view


class Spy:
    """paged_attention that records the context lengths of each call."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __call__(self, q, kc, vc, tables, lengths, scale=None):
        self.calls.append(lengths.tolist())
        return paged_attention(q, kc, vc, tables, lengths, scale)


def _backend():
    decode, prefill = Spy(), Spy()
    impl = KernelImpl(OpName.DENSE_ATTENTION, decode, SUPPORT)
    prefill_impl = KernelImpl(OpName.DENSE_PREFILL, prefill, SUPPORT)
    info = SelectionInfo("test", "test", "test")
    return DenseBackend(impl, prefill_impl, frozenset(), info), decode, prefill


def _mixed_view(rng, decode_only=False, decode_bound=None):
    M = RowMode
    modes = [M.DECODE, M.PREFILL, M.PREFILL, M.PAD, M.INACTIVE, M.VERIFY]
    if decode_only:
        modes = [M.DECODE, M.PAD, M.VERIFY]
    elif decode_bound == 0:
        modes = [M.PREFILL, M.PREFILL, M.INACTIVE]
    tables = torch.randint(0, 12, (4, len(modes), 3), generator=rng, dtype=torch.int32)
    view = _view(modes, [1] * len(modes), list(range(3, 3 + len(modes))), tables)
    fields = {k: getattr(view, k) for k in view.__dataclass_fields__}
    fields.update(decode_only=decode_only, decode_bound=decode_bound)
    return type(view)(**fields), modes


@pytest.mark.parametrize(
    ("decode_only", "decode_bound", "launched"),
    [(False, None, ("decode", "prefill")), (True, 3, ("decode",)), (False, 0, ("prefill",))],
    ids=["mixed", "decode_only", "prefill_only"],
)
def test_rows_run_on_their_kernel_and_match_the_reference(rng, decode_only, decode_bound, launched):
    backend, decode, prefill = _backend()
    view, modes = _mixed_view(rng, decode_only, decode_bound)
    kc, vc = torch.randn(2, 12, 4, 2, 16, generator=rng)
    q = torch.randn(len(modes), 4, 16, generator=rng)
    out = backend.forward(q, kc, vc, view)
    assert ("decode",) * len(decode.calls) + ("prefill",) * len(prefill.calls) == launched
    lengths = view.context_lengths.tolist()
    is_decode = [m in (RowMode.DECODE, RowMode.VERIFY) for m in modes]
    for spy, mine in ((decode, is_decode), (prefill, [m == RowMode.PREFILL for m in modes])):
        for call in spy.calls:  # each kernel sees only its rows; the others have length 0
            assert call == [n if m else 0 for n, m in zip(lengths, mine, strict=True)]
    for r, mode in enumerate(modes):
        if mode in (RowMode.PAD, RowMode.INACTIVE):
            assert torch.equal(out[r], torch.zeros_like(out[r]))
            continue
        table = view.block_tables[1, r : r + 1]
        ref = paged_attention(q[r : r + 1], kc, vc, table, view.context_lengths[r : r + 1])
        torch.testing.assert_close(out[r : r + 1], ref)


class SpanSpy(Spy):
    """A decode kernel declaring ``grouped_verify_rows``: records the spans it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.spans: list[tuple[list[int] | None, int]] = []

    def __call__(self, q, kc, vc, tables, lengths, scale=None, row_spans=None, max_span=1):
        self.spans.append((None if row_spans is None else row_spans.tolist(), max_span))
        return super().__call__(q, kc, vc, tables, lengths, scale)


@pytest.mark.parametrize("declared", [True, False], ids=["declared", "not_declared"])
def test_verification_groups_reach_a_kernel_that_declares_grouped_rows(rng, declared):
    from dataclasses import replace

    from flashloop_backend.capabilities import Capability

    decode = SpanSpy()
    capabilities = SUPPORT.capabilities | ({Capability.GROUPED_VERIFY_ROWS} if declared else set())
    impl = KernelImpl(OpName.DENSE_ATTENTION, decode, replace(SUPPORT, capabilities=capabilities))
    prefill_impl = KernelImpl(OpName.DENSE_PREFILL, Spy(), SUPPORT)
    backend = DenseBackend(impl, prefill_impl, frozenset(), SelectionInfo("t", "t", "t"))
    M = RowMode
    modes = [M.VERIFY] * 3 + [M.DECODE, M.PAD]
    tables = torch.randint(0, 12, (4, len(modes), 3), generator=rng, dtype=torch.int32)
    view = _view(modes, [1] * 5, [5, 6, 7, 2, 0], tables)
    fields = {k: getattr(view, k) for k in view.__dataclass_fields__}
    fields.update(decode_only=True, request_ids=torch.tensor([3, 3, 3, 4, -1]), verify_rows=3)
    view = type(view)(**fields)
    kc, vc = torch.randn(2, 12, 4, 2, 16, generator=rng)
    q = torch.randn(len(modes), 4, 16, generator=rng)
    out = backend.forward(q, kc, vc, view)
    assert decode.spans == ([([3, 0, 0, 1, 1], 3)] if declared else [(None, 1)])
    for r in range(4):
        table = view.block_tables[1, r : r + 1]
        ref = paged_attention(q[r : r + 1], kc, vc, table, view.context_lengths[r : r + 1])
        torch.testing.assert_close(out[r : r + 1], ref)
    single = type(view)(**{**fields, "verify_rows": 1})
    backend.forward(q, kc, vc, single)
    assert decode.spans[-1] == (None, 1)  # no group of several rows: nothing to group


def test_dense_backends_report_both_kernels():
    registry = Registry.discover()
    choices = registry.backends["torch"].kernel_choices(REQUEST, FlashLoopConfig(), registry)
    assert choices == {"dense_attention": "torch_reference", "dense_prefill": "torch_reference"}


def test_prefill_provider_that_cannot_serve_is_a_reason():
    from flashloop_backend.backends.dense import DenseBackendSpec

    registry = Registry.discover()
    spec = DenseBackendSpec("x", "torch_reference", 1, "test", prefill_provider="no_such")
    reasons = spec.not_supported_reasons(REQUEST, FlashLoopConfig(), registry, registry.env)
    assert any("prefill rows" in r and "no_such" in r for r in reasons), reasons


class PlanSpy(Spy):
    """A kernel declaring ``host_sequence_plan``: records the sequence plan it is given."""

    def __init__(self) -> None:
        super().__init__()
        self.plans: list = []

    def __call__(self, q, kc, vc, tables, lengths, scale=None, sequence_plan=None):
        self.plans.append((sequence_plan, tables, lengths))
        return super().__call__(q, kc, vc, tables, lengths, scale)


@pytest.mark.parametrize("batch", ["prefill_only", "mixed", "decode_only", "no_rows"])
@pytest.mark.parametrize("declared", [True, False], ids=["declared", "not_declared"])
def test_the_host_plans_the_rows_of_a_kernel_that_declares_host_sequence_plan(rng, batch, declared):
    """A view from the host carries its rows on the host; a kernel declaring
    ``host_sequence_plan`` gets their sequence plan, equal to the plan from the device's
    tables and the lengths it is given, and the same object at every layer."""
    from dataclasses import replace

    from flashloop_backend.capabilities import Capability
    from flashloop_backend.host.batch import RowGroup, build_batch
    from flashloop_backend.host.kvcache import PagedKVCache
    from flashloop_backend.kernels.sequence_plan import plan_sequences

    kv = PagedKVCache(64, 1, 4, 2, 16, 3, torch.float32, "cpu")
    for request, tokens in ((0, 30), (1, 21), (2, 9)):
        kv.reserve(request, tokens)
    M = RowMode
    prompt = [RowGroup(0, M.PREFILL, 0, 8, 6), RowGroup(1, M.PREFILL, 1, 4, 5)]
    prompt.append(RowGroup(0, M.PREFILL, 2, 2, 3))
    decode = [RowGroup(2, M.DECODE, 1, 8, 1), RowGroup(1, M.DECODE, 0, 20, 1)]
    groups = {"prefill_only": prompt, "mixed": decode + prompt, "decode_only": decode}
    groups = groups.get(batch, [])
    view = build_batch(groups, kv, "cpu", pad_to=20 if groups else None).view
    spies = PlanSpy(), PlanSpy()
    capabilities = SUPPORT.capabilities | ({Capability.HOST_SEQUENCE_PLAN} if declared else set())
    support = replace(SUPPORT, capabilities=capabilities)
    impl = KernelImpl(OpName.DENSE_ATTENTION, spies[0], support)
    prefill_impl = KernelImpl(OpName.DENSE_PREFILL, spies[1], support)
    backend = DenseBackend(impl, prefill_impl, frozenset(), SelectionInfo("t", "t", "t"))
    kc, vc = torch.randn(2, 64, 4, 2, 16, generator=rng)
    q = torch.randn(view.num_rows, 4, 16, generator=rng)
    first = backend.forward(q, kc, vc, view)
    second = backend.forward(q, kc, vc, view)  # the next layer
    torch.testing.assert_close(first, second)
    launched = [spy for spy in spies if spy.plans]
    assert len(launched) == (2 if batch == "mixed" else 1)
    for spy in launched:
        (plan, tables, lengths), (again, *_) = spy.plans
        if not declared:
            assert plan is None and again is None
            continue
        assert again is plan
        expected = plan_sequences(tables, lengths, 4)
        for field in ("qo_indptr", "kv_indptr", "page_indices", "last_page_lengths"):
            assert torch.equal(getattr(plan, field), getattr(expected, field)), field
        assert plan.has_empty_rows == expected.has_empty_rows
    if declared and batch == "prefill_only":  # three chunks of 6, 5 and 3 rows, 6 padding
        assert spies[1].plans[0][0].qo_indptr.tolist()[:4] == [0, 6, 11, 14]
