"""Rows of a paged-attention call grouped into causal sequences, in CSR form.

A run of consecutive rows that read one block table at consecutive context lengths is one
causal sequence (a prefill chunk); any other row is a sequence of one query. Where a plan
has a chunk (a sequence of several rows of nonzero length, so a kernel runs it as
prefill), consecutive rows of length 0 (rows the kernel does not serve: another op's
prompt rows, decode rows, padding) join in causal sequences cut at every ``EMPTY_RUN``-th
row, so a step whose other op serves thousands of rows plans a few sequences, not one per
row. Grouping changes no served row's keys: a causal sequence's row attends to exactly the
keys its own length names (a kernel may still round differently for another grouping).
Kernels that plan on the host (FlashInfer) take this form. It is made either from the
device's tables and lengths (:func:`plan_sequences`, which reads them back) or
from the host's own copy of them (:func:`plan_host_sequences`, which reads nothing from
the device, so planning never waits for kernels queued before it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequencePlan:
    """S sequences over R rows, int32 tensors on the host.

    qo_indptr [S + 1]: sequence s holds rows qo_indptr[s] .. qo_indptr[s + 1] - 1;
    kv_indptr [S + 1]: its pages are page_indices[kv_indptr[s] .. kv_indptr[s + 1] - 1];
    page_indices [kv_indptr[S]]; last_page_lengths [S]: keys in its last page (1 .. BS).
    A row of length 0 (padding, or a row the op does not serve) is planned as one visible
    key, the first of its table's first block (block 0 where that is -1), so no sequence
    is empty; where the plan has a chunk, consecutive such rows (runs cut at every
    multiple of ``EMPTY_RUN``) are one causal sequence over as many keys, every page its
    first row's block. ``has_empty_rows`` says whether any exists (its output must be
    zeroed).
    ``block_size`` is the pages' size BS. A plan of no rows has no sequence."""

    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    page_indices: torch.Tensor
    last_page_lengths: torch.Tensor
    has_empty_rows: bool
    block_size: int

    @property
    def num_rows(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def num_sequences(self) -> int:
        return self.qo_indptr.shape[0] - 1

    def pinned(self) -> SequencePlan:
        """The same plan in pinned host memory, so copies of it to a GPU do not wait."""
        fields = (self.qo_indptr, self.kv_indptr, self.page_indices, self.last_page_lengths)
        return SequencePlan(*(t.pin_memory() for t in fields), self.has_empty_rows, self.block_size)


# Rows of length 0 one causal sequence holds at most where a plan has a chunk: a run this
# long costs a prefill kernel one small tile of queries over as many keys.
EMPTY_RUN = 64


def _no_rows(block_size: int) -> SequencePlan:
    """The plan of no rows."""
    zero = torch.zeros(1, dtype=torch.int32)
    empty = torch.zeros(0, dtype=torch.int32)
    return SequencePlan(zero, zero.clone(), empty, empty.clone(), False, block_size)


def _bounds(continues: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([S] first row, [S] row after the last) given [R - 1] bool: row r + 1 continues
    row r's sequence."""
    starts_here = torch.ones(rows, dtype=torch.bool, device=continues.device)
    starts_here[1:] = ~continues
    first = torch.nonzero(starts_here).flatten()
    return first, torch.cat([first[1:], first.new_tensor([rows])])


def _sequence_bounds(
    lengths: torch.Tensor, same_table: torch.Tensor, empty: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """([S] first row, [S] keys, [S] bool: a run of empty rows) of each sequence of rows
    with lengths [R] int64 (at least 1), given [R - 1] bool: row r + 1 reads row r's
    table, and [R] bool: the row is empty (length 0 before the clamp). A sequence's keys
    are its last row's length, a run's its row count. A
    row continues the one before when it reads the same table at the next length; where
    some sequence then has several rows of nonzero length (only a sequence's first row can
    be empty), an empty row continues only an empty row, within blocks of ``EMPTY_RUN``
    rows."""
    rows = lengths.shape[0]
    continues = (lengths[1:] == lengths[:-1] + 1) & same_table
    first, ends = _bounds(continues, rows)
    runs = torch.zeros_like(first, dtype=torch.bool)
    if bool(((ends - first - empty[first].long()) > 1).any()):
        index = torch.arange(1, rows, device=lengths.device)
        joined = empty[1:] & empty[:-1] & (index % EMPTY_RUN != 0)
        # a row after an empty one starts a sequence: a run holds nothing but empty rows
        first, ends = _bounds((continues & ~empty[:-1]) | joined, rows)
        runs = empty[first] & (ends - first > 1)
    return first, torch.where(runs, ends - first, lengths[ends - 1]), runs


def _csr(
    first: torch.Tensor,
    rows: int,
    kv_len: torch.Tensor,
    seq_tables: torch.Tensor,
    block_size: int,
    has_empty_rows: bool,
    runs: torch.Tensor,
) -> SequencePlan:
    """The plan of sequences starting at rows ``first`` [S] with ``kv_len`` [S] keys (at
    least 1) over ``seq_tables`` [S, MB] (entries >= 0), all on the host; a run of empty
    rows (``runs`` [S] bool) reads its table's first block for every page."""
    pages = (kv_len + block_size - 1) // block_size
    width = seq_tables.shape[1]
    over = torch.nonzero((pages > width) & ~runs).flatten()
    if over.numel():
        s = int(over[0])
        raise ValueError(
            f"row {int(first[s])}: {int(kv_len[s])} keys need {int(pages[s])} pages of "
            f"{block_size}; its table holds {width}"
        )
    columns = torch.arange(max(width, int(pages.max())))[None, :]
    keep = columns < pages[:, None]
    read = torch.where(runs[:, None], 0, columns.clamp(max=width - 1))
    indices = seq_tables.gather(1, read.expand(len(first), -1))[keep].to(torch.int32)
    kv_indptr = torch.zeros(len(first) + 1, dtype=torch.int32)
    kv_indptr[1:] = torch.cumsum(pages, 0)
    last = (kv_len - (pages - 1) * block_size).to(torch.int32)
    qo_indptr = torch.cat([first, first.new_tensor([rows])]).to(torch.int32)
    return SequencePlan(qo_indptr, kv_indptr, indices, last, has_empty_rows, block_size)


def plan_sequences(tables: torch.Tensor, lengths: torch.Tensor, block_size: int) -> SequencePlan:
    """The plan of rows with tables [R, MB] int32 and lengths [R] int32 on any device: rows
    continue a sequence when their tables are equal. The rows are grouped on the tables'
    device, so only each sequence's table travels to the host (a 32K-row chunk would
    otherwise copy R x MB entries), and that copy waits for the device."""
    rows = lengths.shape[0]
    if rows == 0:
        return _no_rows(block_size)
    empty = lengths == 0
    has_empty_rows = bool(empty.any())
    lengths = lengths.long().clamp(min=1)
    same_table = (tables[1:] == tables[:-1]).all(dim=1)  # before the clamp, as the host's keys
    tables = tables.clamp(min=0)
    first, kv_len, runs = _sequence_bounds(lengths, same_table, empty)
    seq_tables = tables[first].cpu()
    return _csr(first.cpu(), rows, kv_len.cpu(), seq_tables, block_size, has_empty_rows, runs.cpu())


def plan_host_sequences(
    table_keys: torch.Tensor,
    lengths: torch.Tensor,
    key_tables: torch.Tensor,
    block_size: int,
    pin: bool = False,
) -> SequencePlan:
    """The plan of R rows from the host's own copy of them: table_keys [R] int64 (row r
    reads table key_tables[table_keys[r]]), lengths [R] int32, key_tables [K, MB] int32,
    all on the host. Rows continue a sequence when their keys are equal (and their lengths
    continue): with one key per distinct table, the grouping :func:`plan_sequences` makes
    from the tables themselves; keys naming equal tables (a plane carried from another)
    may split a sequence it would join, which changes no row's keys. ``pin``: in pinned
    memory (for a kernel on a GPU)."""
    for name, tensor in (
        ("table_keys", table_keys),
        ("lengths", lengths),
        ("key_tables", key_tables),
    ):
        if tensor.device.type != "cpu":
            raise ValueError(
                f"plan_host_sequences takes host tensors; {name} is on {tensor.device}"
            )
    if table_keys.shape != lengths.shape or lengths.dim() != 1:
        raise ValueError(
            f"table_keys {tuple(table_keys.shape)} and lengths {tuple(lengths.shape)} must "
            "both be [rows]"
        )
    rows = lengths.shape[0]
    if rows == 0:
        plan = _no_rows(block_size)
        return plan.pinned() if pin else plan
    empty = lengths == 0
    has_empty_rows = bool(empty.any())
    lengths = lengths.long().clamp(min=1)
    first, kv_len, runs = _sequence_bounds(lengths, table_keys[1:] == table_keys[:-1], empty)
    seq_tables = key_tables[table_keys[first]].clamp(min=0)
    plan = _csr(first, rows, kv_len, seq_tables, block_size, has_empty_rows, runs)
    return plan.pinned() if pin else plan
