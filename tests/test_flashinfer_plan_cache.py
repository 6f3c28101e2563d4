"""The FlashInfer adapter's plan reuse, on CPU with a stand-in for the FlashInfer wrapper:
a plan is reused for the same unmodified tensors or equal contents, never for changed ones;
given the host's sequence plan, it plans once per plan object and reads no device tensor."""

from typing import ClassVar

import pytest
import torch

from flashloop_backend.kernels import flashinfer
from flashloop_backend.kernels.flashinfer import FlashInferPagedAttention, _PlanSlot
from flashloop_backend.kernels.sequence_plan import plan_host_sequences, plan_sequences


class _Wrapper:
    def run(self, q, caches):
        return torch.ones_like(q)  # non-zero: padding rows must be zeroed by the adapter


def _adapter(plans: list):
    """The adapter with a planner that records each plan's sequences (no flashinfer)."""
    adapter = object.__new__(FlashInferPagedAttention)
    adapter._slots = [_PlanSlot() for _ in range(flashinfer.PLAN_SLOTS)]
    adapter._next_slot, adapter.current, adapter._last_device_slot = 0, None, None
    adapter.device_plans = 0

    def plan(sequences, lengths, *rest):
        plans.append(sequences)
        slot = adapter._slots[adapter._next_slot]
        adapter._next_slot = (adapter._next_slot + 1) % len(adapter._slots)
        slot.decode, slot.use_prefill, slot.planned = _Wrapper(), False, None
        slot.empty_rows = (lengths == 0) if sequences.has_empty_rows else None
        adapter.current = slot

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
    assert len(plans) == 2 and plans[-1].page_indices.tolist() == [0, 1, 2, 0]
    adapter(q, cache, cache, tables.clone(), lengths.clone())  # equal contents, new objects
    assert len(plans) == 2 and compared
    adapter(q, cache, cache, tables, torch.tensor([21, 30], dtype=torch.int32))
    assert len(plans) == 3 and adapter.device_plans == 3


def test_a_host_sequence_plan_is_planned_once_per_object_without_reading_the_device(
    monkeypatch,
):
    """Every layer passes the backend's one plan object: the adapter plans at the first,
    and neither compares nor reads back the device's tables and lengths at any."""

    def refuse(*args):
        raise AssertionError("read the device's rows")

    monkeypatch.setattr(torch, "equal", refuse)
    monkeypatch.setattr(flashinfer, "plan_sequences", refuse)
    plans = []
    adapter = _adapter(plans)
    q, cache = torch.randn(3, 2, 16), torch.randn(4, 16, 2, 16)
    tables = torch.tensor([[0, 1], [0, 1], [2, 3]], dtype=torch.int32)
    lengths = torch.tensor([17, 18, 0], dtype=torch.int32)
    keys = torch.tensor([0, 0, 1])
    sequences = plan_host_sequences(keys, lengths, torch.tensor([[0, 1], [2, 3]]).int(), 16)
    for _ in range(3):
        out = adapter(q, cache, cache, tables, lengths, sequence_plan=sequences)
    assert plans == [sequences]
    assert bool((out[2] == 0).all()) and bool((out[:2] == 1).all())
    again = plan_host_sequences(keys, lengths, torch.tensor([[0, 1], [2, 3]]).int(), 16)
    adapter(q, cache, cache, tables, lengths, sequence_plan=again)  # a new batch's plan
    assert plans == [sequences, again] and adapter.device_plans == 0


def test_a_host_sequence_plan_of_other_rows_or_pages_is_refused_by_name():
    adapter = _adapter([])
    q, cache = torch.randn(2, 2, 16), torch.randn(4, 16, 2, 16)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lengths = torch.tensor([20, 30], dtype=torch.int32)
    owner_tables = torch.tensor([[0, 1], [2, 3]]).int()
    three = plan_host_sequences(
        torch.tensor([0, 1, 1]), torch.tensor([5, 6, 9]).int(), owner_tables, 16
    )
    with pytest.raises(ValueError, match="covers 3 rows in pages of 16 keys; the call has 2"):
        adapter(q, cache, cache, tables, lengths, sequence_plan=three)
    eight = plan_host_sequences(torch.tensor([0, 1]), torch.tensor([10, 16]).int(), owner_tables, 8)
    with pytest.raises(ValueError, match="pages of 8 keys; the call has 2 rows in pages of 16"):
        adapter(q, cache, cache, tables, lengths, sequence_plan=eight)


def test_plan_sequences_groups_a_prefill_chunk_and_keeps_decode_rows_apart():
    """Hand-worked plan, block size 4: a 3-row chunk of one sequence (positions 4-6, table
    [3, 5]), a decode row at position 7 (table [1, 2]) and a padding row."""
    tables = torch.tensor([[3, 5], [3, 5], [3, 5], [1, 2], [-1, -1]], dtype=torch.int32)
    lengths = torch.tensor([5, 6, 7, 8, 0], dtype=torch.int32)
    plan = plan_sequences(tables, lengths, 4)
    assert plan.qo_indptr.tolist() == [0, 3, 4, 5]  # the chunk, the decode row, the padding
    assert plan.kv_indptr.tolist() == [0, 2, 4, 5]  # 7 keys -> 2 pages, 8 -> 2, padding -> 1
    assert plan.page_indices.tolist() == [3, 5, 1, 2, 0]
    assert plan.last_page_lengths.tolist() == [3, 4, 1]
    assert plan.has_empty_rows and (plan.num_rows, plan.num_sequences) == (5, 3)
    fields = (plan.qo_indptr, plan.kv_indptr, plan.page_indices, plan.last_page_lengths)
    assert all(t.dtype == torch.int32 for t in fields)
    # the same rows from the host's copy: keys name the tables, the padding row's is all -1
    keys = torch.tensor([0, 0, 0, 1, 2])
    owner_tables = torch.tensor([[3, 5], [1, 2], [-1, -1]], dtype=torch.int32)
    host = plan_host_sequences(keys, lengths, owner_tables, 4)
    for field in ("qo_indptr", "kv_indptr", "page_indices", "last_page_lengths"):
        assert torch.equal(getattr(host, field), getattr(plan, field)), field
    assert host.has_empty_rows


def test_empty_rows_beside_a_chunk_are_planned_as_runs_of_causal_sequences():
    """Hand-worked, block size 4, EMPTY_RUN 64: a 2-row chunk (table [3, 5], positions
    4-5), rows 2..69 of length 0 (some padding, some of the chunk's table), a decode row
    (table [1, 2], position 7) and a 2-row empty run. The empty rows form runs cut at row
    64, each one causal sequence over as many keys, every page its first row's first block
    (block 0 for padding); without a chunk, each empty row stays a sequence of its own."""
    from flashloop_backend.kernels.sequence_plan import EMPTY_RUN

    assert EMPTY_RUN == 64
    chunk, decode, pad = [3, 5], [1, 2], [-1, -1]
    rows = (
        [chunk, chunk] + [chunk if r % 3 == 1 else pad for r in range(2, 70)] + [decode, pad, pad]
    )
    lengths = [5, 6] + [0] * 68 + [8, 0, 0]
    tables = torch.tensor(rows, dtype=torch.int32)
    plan = plan_sequences(tables, torch.tensor(lengths, dtype=torch.int32), 4)
    assert plan.qo_indptr.tolist() == [0, 2, 64, 70, 71, 73]
    assert plan.kv_indptr.tolist() == [0, 2, 18, 20, 22, 23]  # 62 keys: 16 pages, 6: 2, ...
    # row 2 is padding (block 0), row 64 reads the chunk's table (block 3)
    assert plan.page_indices.tolist() == [3, 5] + [0] * 16 + [3, 3] + [1, 2] + [0]
    assert plan.last_page_lengths.tolist() == [2, 2, 2, 4, 2]  # 62 keys, 6, 8, 2
    keys = torch.tensor([{(3, 5): 0, (1, 2): 1, (-1, -1): 2}[tuple(r)] for r in rows])
    host = plan_host_sequences(keys, torch.tensor(lengths, dtype=torch.int32),
                               torch.tensor([chunk, decode, pad], dtype=torch.int32), 4)  # fmt: skip
    for field in ("qo_indptr", "kv_indptr", "page_indices", "last_page_lengths"):
        assert torch.equal(getattr(host, field), getattr(plan, field)), field
    decode_only = plan_sequences(tables[70:], torch.tensor(lengths[70:], dtype=torch.int32), 4)
    assert decode_only.qo_indptr.tolist() == [0, 1, 2, 3]  # no chunk: one row a sequence


def test_an_empty_row_before_a_decode_row_makes_no_runs():
    """A row of length 0 continued by a row of its table at length 2 is one sequence with a
    single served row, not a chunk: the empty rows after it stay sequences of their own
    (every served row alone, as the decode kernel needs where nothing else joins)."""
    tables = torch.tensor([[5, 6], [5, 6], [-1, -1], [-1, -1], [7, 8]], dtype=torch.int32)
    plan = plan_sequences(tables, torch.tensor([0, 2, 0, 0, 7], dtype=torch.int32), 4)
    assert plan.qo_indptr.tolist() == [0, 2, 3, 4, 5]


def test_the_device_plan_tells_a_table_with_block_0_from_padding():
    """Tables [0, -1] and [-1, -1] are different tables (equal only once clamped): the plan
    from the device's rows keeps them apart, as the host's keys do."""
    tables = torch.tensor([[0, -1], [-1, -1], [5, 6]], dtype=torch.int32)
    keys = torch.tensor([0, 1, 0, 1, 1, 2])
    lengths = torch.tensor([0, 0, 2, 0, 0, 7], dtype=torch.int32)
    device_plan = plan_sequences(tables[keys], lengths, 4)
    host_plan = plan_host_sequences(keys, lengths, tables, 4)
    for field in ("qo_indptr", "kv_indptr", "page_indices", "last_page_lengths"):
        assert torch.equal(getattr(host_plan, field), getattr(device_plan, field)), field


def test_plan_sequences_splits_rows_whose_lengths_do_not_continue():
    tables = torch.tensor([[3, 5], [3, 5]], dtype=torch.int32)
    plan = plan_sequences(tables, torch.tensor([6, 6], dtype=torch.int32), 4)
    assert plan.qo_indptr.tolist() == [0, 1, 2]  # two decode rows of one table, one position
    assert not plan.has_empty_rows


@pytest.mark.parametrize("seed", range(20))
def test_the_host_plan_equals_the_plan_from_the_device_rows(seed):
    """Random rows over distinct tables (chunks, decode rows, masked rows of length 0,
    padding): the plan from keys and the host's tables equals the one from every row's
    table, field for field."""
    generator = torch.Generator().manual_seed(seed)
    owners, width, block = 5, 6, 4
    owner_tables = torch.randperm(owners * width, generator=generator).int().view(owners, width)
    owner_tables[-1] = -1  # the padding rows' table
    keys, lengths = [], []
    while len(keys) < 40:
        owner = int(torch.randint(owners, (), generator=generator))
        count = int(torch.randint(1, 6, (), generator=generator))
        start = int(torch.randint(0, width * block - count, (), generator=generator))
        masked = bool(torch.rand((), generator=generator) < 0.2)
        for i in range(count):
            keys.append(owner)
            lengths.append(0 if owner == owners - 1 or masked else start + i + 1)
    keys_t, lengths_t = torch.tensor(keys), torch.tensor(lengths, dtype=torch.int32)
    device_plan = plan_sequences(owner_tables[keys_t], lengths_t, block)
    host_plan = plan_host_sequences(keys_t, lengths_t, owner_tables, block)
    for field in ("qo_indptr", "kv_indptr", "page_indices", "last_page_lengths"):
        assert torch.equal(getattr(host_plan, field), getattr(device_plan, field)), field
    assert host_plan.has_empty_rows == device_plan.has_empty_rows


def test_a_plan_of_no_rows_has_no_sequence():
    tables = torch.zeros(0, 3, dtype=torch.int32)
    empty = torch.zeros(0, dtype=torch.int32)
    for plan in (
        plan_sequences(tables, empty, 4),
        plan_host_sequences(empty.long(), empty, tables, 4),
    ):
        assert plan.qo_indptr.tolist() == [0] and plan.kv_indptr.tolist() == [0]
        assert plan.page_indices.numel() == 0 and plan.last_page_lengths.numel() == 0
        assert (plan.num_rows, plan.num_sequences, plan.has_empty_rows) == (0, 0, False)


def test_plan_host_sequences_refuses_device_tensors_and_mismatched_rows():
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    with pytest.raises(ValueError, match="must both be \\[rows\\]"):
        plan_host_sequences(torch.tensor([0, 0]), torch.tensor([1], dtype=torch.int32), tables, 4)
    meta = torch.tensor([0], device="meta")
    with pytest.raises(ValueError, match="takes host tensors; table_keys is on meta"):
        plan_host_sequences(meta, torch.tensor([1], dtype=torch.int32), tables, 4)


def test_planned_wrapper_is_the_wrapper_the_last_call_planned(monkeypatch):
    """Benchmarks time FlashInfer's kernel alone through ``planned_wrapper``: the wrapper of
    the device's last planned call, and a LookupError before any call planned there."""
    device = torch.device("cpu")
    adapter = _adapter([])
    monkeypatch.setattr(flashinfer, "_INSTANCES", {device: adapter})
    with pytest.raises(LookupError, match="no paged_attention_flashinfer call"):
        flashinfer.planned_wrapper(device)
    q, cache = torch.randn(2, 2, 16), torch.randn(4, 16, 2, 16)
    tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    flashinfer.paged_attention_flashinfer(q, cache, cache, tables, torch.tensor([20, 30]).int())
    assert flashinfer.planned_wrapper(device) is adapter.current.decode


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


class _Event:
    """A stand-in CUDA event that counts its records and the host's waits on it."""

    made: ClassVar[list] = []

    def __init__(self):
        self.waits, self.records = 0, 0
        _Event.made.append(self)

    def record(self, stream=None):
        self.records += 1

    def synchronize(self):
        self.waits += 1


class _PlannedWrapper:
    """A stand-in FlashInfer wrapper that records its plans' arguments."""

    def __init__(self, workspace, layout):
        assert layout == "NHD"
        self.plans = []

    def plan(self, *args, **kwargs):
        self.plans.append((args, kwargs))


def _stand_in_adapter(monkeypatch) -> tuple[FlashInferPagedAttention, list]:
    """The real adapter over a stand-in FlashInfer module and CUDA events (its events)."""
    import types

    fake = types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=type("Prefill", (_PlannedWrapper,), {}),
        BatchDecodeWithPagedKVCacheWrapper=type("Decode", (_PlannedWrapper,), {}),
    )
    monkeypatch.setattr(_Event, "made", [])
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setitem(__import__("sys").modules, "flashinfer", fake)
    return FlashInferPagedAttention(torch.device("cpu")), _Event.made


def test_plans_rotate_over_slots_and_wait_only_for_a_reused_slots_copy(monkeypatch):
    """``plan`` with a stand-in FlashInfer module: a chunk goes to a prefill wrapper and
    single-row sequences to a decode wrapper, each given the plan in FlashInfer's argument
    order; plans rotate over ``PLAN_SLOTS`` slots, and planning on a slot again first waits
    for the event recorded after its last plan (and for nothing else)."""
    adapter, events = _stand_in_adapter(monkeypatch)
    owner_tables = torch.tensor([[3, 5], [1, 2]], dtype=torch.int32)
    chunk = plan_host_sequences(
        torch.tensor([0, 0, 1]), torch.tensor([5, 6, 2]).int(), owner_tables, 4
    )
    rows = plan_host_sequences(torch.tensor([0, 1]), torch.tensor([5, 0]).int(), owner_tables, 4)
    adapter.plan(chunk, torch.tensor([5, 6, 2]).int(), 8, 2, 16, torch.float16, 0.25)
    first = adapter.current
    args, kwargs = first.prefill.plans[0]
    assert [a.tolist() if torch.is_tensor(a) else a for a in args] == [
        [0, 2, 3],
        [0, 2, 3],
        [3, 5, 1],
        [2, 2],
        8,
        2,
        16,
        4,
    ]
    dtypes = dict(q_data_type=torch.float16, kv_data_type=torch.float16, sm_scale=0.25)
    assert kwargs == dict(causal=True, **dtypes)
    assert first.decode is None and first.empty_rows is None
    adapter.plan(rows, torch.tensor([5, 0]).int(), 8, 2, 16, torch.float16, 0.25)
    args, kwargs = adapter.current.decode.plans[0]
    assert [a.tolist() if torch.is_tensor(a) else a for a in args] == [
        [0, 2, 3],
        [3, 5, 1],
        [1, 1],
        8,
        2,
        16,
        4,
    ]
    assert "causal" not in kwargs and adapter.current.empty_rows.tolist() == [False, True]
    for _ in range(flashinfer.PLAN_SLOTS - 2):
        adapter.plan(rows, torch.tensor([5, 0]).int(), 8, 2, 16, torch.float16, 0.25)
    assert [e.waits for e in events] == [0] * flashinfer.PLAN_SLOTS  # every slot new so far
    adapter.plan(chunk, torch.tensor([5, 6, 2]).int(), 8, 2, 16, torch.float16, 0.25)
    assert adapter.current is first and first.copied.waits == 1  # the first slot again
    assert sum(e.waits for e in events) == 1 and len(first.prefill.plans) == 2


def test_calls_alternating_between_row_sets_keep_their_plans(monkeypatch):
    """One layer's prefill rows, then its decode rows, layer after layer: each host plan
    and each unmodified pair of device tensors is planned once, not at every call."""
    plans = []
    adapter = _adapter(plans)
    q, cache = torch.randn(2, 2, 16), torch.randn(4, 16, 2, 16)
    owner_tables = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    tables = owner_tables.clone()
    prefill_lengths = torch.tensor([17, 18], dtype=torch.int32)
    decode_lengths = torch.tensor([20, 30], dtype=torch.int32)
    keys = torch.tensor([0, 0])
    prefill = plan_host_sequences(keys, prefill_lengths, owner_tables, 16)
    decode = plan_host_sequences(torch.tensor([0, 1]), decode_lengths, owner_tables, 16)
    for _ in range(3):
        adapter(q, cache, cache, tables, prefill_lengths, sequence_plan=prefill)
        adapter(q, cache, cache, tables, decode_lengths, sequence_plan=decode)
    assert plans == [prefill, decode]
    other_tables, other_lengths = tables.clone(), torch.tensor([5, 0], dtype=torch.int32)
    for _ in range(3):  # device rows: the same tensors, unmodified
        adapter(q, cache, cache, tables, decode_lengths)
        adapter(q, cache, cache, other_tables, other_lengths)
    assert len(plans) == 4 and adapter.device_plans == 2


def test_single_row_sequences_at_a_ratio_the_decode_kernel_lacks_take_the_prefill_wrapper(
    monkeypatch,
):
    """FlashInfer's decode kernel serves 1, 2, 3, 4 or 8 query heads per KV head; at 5 the
    same rows are planned on the prefill wrapper (one causal sequence a row)."""
    adapter, _ = _stand_in_adapter(monkeypatch)
    owner_tables = torch.tensor([[3, 5], [1, 2]], dtype=torch.int32)
    lengths = torch.tensor([5, 2]).int()
    rows = plan_host_sequences(torch.tensor([0, 1]), lengths, owner_tables, 4)
    adapter.plan(rows, lengths, 8, 2, 16, torch.float16, 0.25)
    assert adapter.current.decode is not None and not adapter.current.use_prefill
    adapter.plan(rows, lengths, 10, 2, 16, torch.float16, 0.25)
    assert adapter.current.use_prefill and adapter.current.decode is None
    args, kwargs = adapter.current.prefill.plans[0]
    assert args[0].tolist() == [0, 1, 2] and kwargs["causal"]


def test_more_sequences_than_flashinfers_prefill_plans_are_refused_by_count(monkeypatch):
    adapter, events = _stand_in_adapter(monkeypatch)
    monkeypatch.setattr(flashinfer, "PREFILL_MAX_SEQUENCES", 1)
    owner_tables = torch.tensor([[3, 5], [1, 2]], dtype=torch.int32)
    lengths = torch.tensor([5, 6, 2]).int()
    chunk = plan_host_sequences(torch.tensor([0, 0, 1]), lengths, owner_tables, 4)
    with pytest.raises(ValueError, match="at most 1 sequences; this call's 3 rows form 2"):
        adapter.plan(chunk, lengths, 8, 2, 16, torch.float16, 0.25)
    # refused before any slot was picked, waited on or given a wrapper
    assert adapter.current is None and not events and adapter._next_slot == 0
    assert all(slot.prefill is None and slot.decode is None for slot in adapter._slots)


def test_a_sequence_longer_than_its_table_is_refused():
    """A length that needs more pages than the row's table holds is refused, not planned
    over the table's pages alone."""
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    lengths = torch.tensor([9], dtype=torch.int32)
    for plan in (
        lambda: plan_sequences(tables, lengths, 4),
        lambda: plan_host_sequences(torch.tensor([0]), lengths, tables, 4),
    ):
        with pytest.raises(ValueError, match="row 0: 9 keys need 3 pages of 4; its table holds 2"):
            plan()
