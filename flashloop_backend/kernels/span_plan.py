"""Rows of a nonconsecutive-query prefill call laid over the spans of positions they cover.

A kernel made for consecutive rows (a causal prefill chunk) serves a token-sparse chunk
by computing every position of the chunk's span: the served rows' queries sit at their
positions in a span buffer, the other positions' queries are zero and their outputs are
never read. Each served row attends to exactly the keys its own length names, as with
the nonconsecutive-query kernel; the dropped positions' keys are in the plane already
(copy-on-exit). A span continues while rows read one table at increasing lengths with
gaps of at most ``MAX_GAP`` positions, so the positions computed for nothing stay bounded
by the rows served. Made from the host's copy of the rows (:func:`plan_host_spans`, no
device read) or from the device's (:func:`plan_spans`, which reads them back;
:class:`DeviceSpanPlans` once per traversal).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from flashloop_backend.kernels.sequence_plan import SequencePlan, plan_host_sequences
from flashloop_backend.kernels.validate import tensor_versions

# The largest step in position from one served row of a span to the next (so at most
# MAX_GAP - 1 unserved positions between them); a larger step starts a new span (a new
# causal sequence), so a span computes at most that many positions for nothing per row.
MAX_GAP = 16


@dataclass(frozen=True)
class SpanPlan:
    """N served rows of an R-row call over the spans they cover, host tensors.

    rows [N] int64: the served rows (nonzero length), in call order;
    slots [N] int64: each served row's row in the span buffer;
    spans: the :class:`SequencePlan` of the span buffer's rows, one causal sequence per
    span (its rows at consecutive lengths of one table);
    num_rows: R, the call's rows."""

    rows: torch.Tensor
    slots: torch.Tensor
    spans: SequencePlan
    num_rows: int

    @property
    def span_rows(self) -> int:
        return self.spans.num_rows

    def pinned(self) -> SpanPlan:
        """The same plan in pinned host memory, so copies of it to a GPU do not wait."""
        return SpanPlan(
            self.rows.pin_memory(), self.slots.pin_memory(), self.spans.pinned(), self.num_rows
        )


def check_span_sequences(spans: SequencePlan, rows: int, block_size: int) -> None:
    """Refuses a span plan's ``spans`` that a causal kernel could not run over a span
    buffer of ``rows`` rows in pages of ``block_size`` keys: another row count, a row of
    length 0, or another page size (ValueError naming both)."""
    if spans.has_empty_rows or spans.num_rows != rows:
        raise ValueError(
            f"a span run takes a plan of its {rows} rows with no empty row; got "
            f"{spans.num_rows} rows, empty rows {spans.has_empty_rows}"
        )
    if spans.block_size != block_size:
        raise ValueError(f"the plan's pages hold {spans.block_size} keys; the cache's {block_size}")


def plan_host_spans(
    table_keys: torch.Tensor,
    lengths: torch.Tensor,
    key_tables: torch.Tensor,
    block_size: int,
    pin: bool = False,
) -> SpanPlan:
    """The span plan of R rows from the host's copy of them: table_keys [R] int64 (row r
    reads table key_tables[table_keys[r]]), lengths [R] int32 (0: a row the call does not
    serve), key_tables [K, MB] int32, all on the host. A served row continues the span of
    the served row before it when both read one key and its length is greater by 1 to
    ``MAX_GAP``. ``pin``: in pinned memory (for a kernel on a GPU)."""
    for name, tensor in (("table_keys", table_keys), ("lengths", lengths)):
        if tensor.device.type != "cpu":
            raise ValueError(f"plan_host_spans takes host tensors; {name} is on {tensor.device}")
    if table_keys.shape != lengths.shape or lengths.dim() != 1:
        raise ValueError(
            f"table_keys {tuple(table_keys.shape)} and lengths {tuple(lengths.shape)} must "
            "both be [rows]"
        )
    rows = torch.nonzero(lengths > 0).flatten()
    served = lengths[rows].long()
    keys = table_keys[rows]
    step = served[1:] - served[:-1]
    continues = (keys[1:] == keys[:-1]) & (step >= 1) & (step <= MAX_GAP)
    starts = torch.ones(len(rows), dtype=torch.bool)
    starts[1:] = ~continues
    span_of = torch.cumsum(starts.long(), 0) - 1  # [N] the span each served row is in
    first = torch.nonzero(starts).flatten()
    last = torch.cat([first[1:], first.new_tensor([len(rows)])])[: len(first)] - 1
    first_length, last_length = served[first], served[last]
    sizes = last_length - first_length + 1  # [S] span rows
    offsets = torch.cumsum(sizes, 0) - sizes
    slots = offsets[span_of] + served - first_length[span_of]
    # the span buffer's rows: each span's consecutive lengths over its table key
    span_keys = torch.repeat_interleave(keys[first], sizes)
    within = torch.arange(int(sizes.sum())) - torch.repeat_interleave(offsets, sizes)
    span_lengths = (torch.repeat_interleave(first_length, sizes) + within).int()
    spans = plan_host_sequences(span_keys, span_lengths, key_tables, block_size)
    plan = SpanPlan(rows, slots, spans, lengths.shape[0])
    return plan.pinned() if pin else plan


def plan_spans(tables: torch.Tensor, lengths: torch.Tensor, block_size: int) -> SpanPlan:
    """The span plan of rows with tables [R, MB] int32 and lengths [R] int32 on any
    device: a served row reads the table of the served row before it when their tables
    are equal (rows the call does not serve, length 0, between them change nothing). The
    rows are grouped on the tables' device, so only each run's table travels to the host;
    the copy waits for the device."""
    served = torch.nonzero(lengths > 0).flatten()
    starts = torch.ones(served.shape[0], dtype=torch.bool, device=tables.device)
    mine = tables[served]
    if served.shape[0] > 1:
        starts[1:] = ~(mine[1:] == mine[:-1]).all(dim=1)
    keys = torch.zeros(lengths.shape[0], dtype=torch.int64, device=tables.device)
    keys[served] = torch.cumsum(starts.long(), 0) - 1
    key_tables = mine[torch.nonzero(starts).flatten()].clamp(min=0)
    if key_tables.shape[0] == 0:  # no row served: one table so that every key is valid
        key_tables = tables.new_zeros((1, tables.shape[1]))
    return plan_host_spans(keys.cpu(), lengths.cpu(), key_tables.cpu(), block_size)


class DeviceSpanPlans:
    """The span plan of rows on the device, read back once while a traversal passes the
    same tables and lengths again (every layer passes its plan's own tensors): the very
    tensors, unmodified (held weakly, so a tensor at a freed one's address never passes
    for it), or for inference tensors, which keep no version, equal ones by content (a
    comparison on the device, which waits for it at every call, but copies nothing back)."""

    def __init__(self) -> None:
        self._last: tuple | None = None  # (tables ref, lengths ref, versions, copies, plan)
        self.reads = 0  # plans made by reading the device

    def plan(self, tables: torch.Tensor, lengths: torch.Tensor, block_size: int) -> SpanPlan:
        """:func:`plan_spans` of tables [R, MB] and lengths [R], pinned for a GPU."""
        versions = tensor_versions(tables, lengths)
        if self._last is not None:
            tables_ref, lengths_ref, seen, copies, plan = self._last
            if versions is not None:
                same = tables_ref() is tables and lengths_ref() is lengths and seen == versions
            else:
                same = bool(copies) and all(
                    a.shape == b.shape and torch.equal(a, b)
                    for a, b in zip(copies, (tables, lengths), strict=True)
                )
            if same and plan.spans.block_size == block_size:
                return plan
        plan = plan_spans(tables, lengths, block_size)
        plan = plan.pinned() if tables.device.type == "cuda" else plan
        self.reads += 1
        copies = () if versions is not None else (tables.clone(), lengths.clone())
        self._last = (weakref.ref(tables), weakref.ref(lengths), versions, copies, plan)
        return plan
