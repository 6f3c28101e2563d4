"""The flashloop backend's packed INT4 KV: the page store, what to encode when, and the
reader metadata of every batch (planned on the host) and of every graph step (planned
into fixed-address buffers).

A prompt is packed once it has run every loop: whole groups of ``group_size`` rows, every
depth's logical history, compact residual levels for rows that token-sparse prefill left
inactive (or that exited early). The host's BF16 blocks of those rows are then freed, so
no BF16 shadow remains. ``fixed_prompt`` stops there: generated tokens stay BF16.
``rolling`` keeps a BF16 tail of at least ``tail_size`` final rows and flushes one whole
group each time the tail reaches ``tail_size + group_size`` (so it holds
tail_size..tail_size+G-1 rows after every step).

A request's pages are reserved when it is admitted (:meth:`PackedState.reserve`), bounded
by :meth:`PackedState.page_bound`: packing then never runs out of pages mid-flight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from flashloop_backend.backends.base import GraphStep, RequestKV
from flashloop_backend.dispatch import BatchView
from flashloop_backend.kv.levels import (
    LevelMetadata,
    first_compact,
    level_metadata,
    level_version,
    level_widths,
    row_kinds,
    row_packed,
    write_row_levels,
)
from flashloop_backend.kv.store import PackedKVStore

# Rows packed per append: the torch writer gathers a chunk's BF16 K/V (per layer pass), so
# the chunk bounds that copy; the Triton writer reads the pools in place. A multiple of
# every group size (compact levels start a fresh page per chunk).
PACK_CHUNK_ROWS = 4096


class PackedState:
    def __init__(
        self,
        store: PackedKVStore,
        write: Callable,
        policy: str,
        tail_size: int,
        compact_from: int = 1,
    ) -> None:
        """``compact_from``: the first level the configuration can make compact (the graph
        buffers' kernels read the levels below it as dense only)."""
        self.store, self.write = store, write
        self.policy, self.tail_size = policy, tail_size
        self.compact_from = compact_from
        self.chunk_rows = PACK_CHUNK_ROWS  # rows per append of a prompt's packing
        self._planned: tuple[BatchView, LevelMetadata] | None = None
        self._ordered: LevelMetadata | None = None
        self._graph: _GraphInputs | None = None

    @property
    def group_size(self) -> int:
        return self.store.group_size

    # ------------------------------------------------------------ budget
    @staticmethod
    def packable_rows(rows: int, group_size: int, policy: str, tail_size: int) -> int:
        """Whole groups of ``rows`` final rows that go to the store: all of them
        (``fixed_prompt``), or all that leave at least ``tail_size`` rows in BF16 (``rolling``)."""
        keep = tail_size if policy == "rolling" else 0
        return max(0, rows - keep) // group_size * group_size

    @staticmethod
    def page_bound(
        prompt_length: int,
        max_new_tokens: int,
        depths: int,
        group_size: int,
        policy: str,
        tail_size: int,
    ) -> int:
        """Most pages a request can ever hold. Rows are packed in whole groups, and each
        append costs a level at most rows / G pages (a compact level starts a fresh page per
        append but stores only its active rows), so every level costs at most packed rows /
        G. ``fixed_prompt`` packs the prompt only; ``rolling`` also flushes generated rows."""
        rows = prompt_length + (max_new_tokens if policy == "rolling" else 0)
        packed = PackedState.packable_rows(rows, group_size, policy, tail_size)
        return depths * (packed // group_size)

    @staticmethod
    def default_pages(
        num_blocks: int, block_size: int, depths: int, group_size: int, policy: str, tail: int
    ) -> int:
        """Pages to pack the most tokens a BF16 pool of ``num_blocks`` blocks (spread over
        every depth plane) holds, at every depth: any request that pool holds fits."""
        tokens = num_blocks // depths * block_size
        return max(1, PackedState.page_bound(tokens, 0, depths, group_size, policy, tail))

    def pages_needed(self, prompt_length: int, max_new_tokens: int, depths: int) -> int:
        """:meth:`page_bound` under this state's group size, policy and tail."""
        return self.page_bound(
            prompt_length, max_new_tokens, depths, self.group_size, self.policy, self.tail_size
        )

    def reserve(
        self,
        sequence: int,
        prompt_length: int,
        max_new_tokens: int,
        depths: int,
        adopted_rows: int = 0,
    ) -> None:
        """Hold every page the request can need but those of ``adopted_rows`` (whole groups
        it starts from another prompt's pages) (raises ``OutOfPackedPagesError`` when the
        pool's unreserved pages are short; nothing is taken then)."""
        needed = self.pages_needed(prompt_length, max_new_tokens, depths)
        self.store.reserve(sequence, needed - depths * (adopted_rows // self.group_size))

    def release(self, sequence: int) -> None:
        """Return the sequence's pages and what remains of its reservation."""
        self.store.release(sequence)

    # ------------------------------------------------------------ packing
    def packed_rows(self, sequence: int) -> int:
        """Rows the sequence holds at every level."""
        entry = self.store.sequences.get(sequence)
        return 0 if entry is None else entry.rows

    def level_rows(self, sequence: int, level: int) -> int:
        """Rows the sequence holds at ``level``."""
        entry = self.store.sequences.get(sequence)
        return 0 if entry is None else entry.level_rows(level)

    def prompt_rows(self, prompt_length: int) -> int:
        """Rows of a completed prompt to pack: every whole group (``fixed_prompt``), or
        every whole group that leaves at least ``tail_size`` rows in BF16 (``rolling``)."""
        return self.packable_rows(prompt_length, self.group_size, self.policy, self.tail_size)

    def pack_rows(self, sequence: int, kv: RequestKV, end: int, drop: bool = True) -> None:
        """Pack rows [already packed, end) of every depth and, with ``drop``, free their
        BF16 blocks: the store becomes their only copy."""
        start = self.packed_rows(sequence)
        if end <= start:
            return
        depths = kv.num_depths
        behind = [d for d in range(depths) if self.level_rows(sequence, d) == start]
        # read in place by the writer, freed after it; levels stored ahead are read back
        rows = kv.planes(start, end, range(behind[0], depths))
        self.store.append_rows(sequence, rows, kv.active(start, end), write=self.write)
        if drop:
            kv.drop(end)

    def pack_prompt_level(
        self, sequence: int, kv: RequestKV, depth: int, rows: int, chunk: int | None = None
    ) -> int:
        """Encode ``depth`` alone over at least the first ``rows`` of the prompt's rows to
        pack (:meth:`prompt_rows`), in the appends :meth:`pack_final_prompt_rows` makes
        (multiples of ``chunk`` from row 0, then the end), each over the rows the levels
        below stored in the same appends; returns the rows of ``depth`` stored."""
        chunk = self._chunk(chunk)
        end = self.prompt_rows(kv.prompt_length)
        done = self.level_rows(sequence, depth)
        while done < min(rows, end):
            stop = min(done // chunk * chunk + chunk, end)
            planes = kv.planes(done, stop, range(depth, depth + 1))
            self.store.append_rows(sequence, planes, kv.active(done, stop), write=self.write)
            done = stop
        return done

    def shareable_rows(self, sequence: int, rows: int) -> int:
        """Of the sequence's first ``rows`` rows, those other prompts may start from: whole
        groups, and with a compact level whole chunks (where every prompt's packing ends an
        append, so the pages hold what a prompt packing them itself would write)."""
        entry = self.store.sequences.get(sequence)
        if entry is None:
            return 0
        rows = min(rows, entry.rows) // self.group_size * self.group_size
        if any(m is not None for m in entry.host_maps):
            rows = rows // self.chunk_rows * self.chunk_rows
        return rows

    def pack_final_prompt_rows(
        self, sequence: int, kv: RequestKV, rows: int, chunk: int | None = None
    ) -> None:
        """Encode what the prompt's first ``rows`` final rows complete: the appends
        :meth:`pack_prompt` would make that end at or before them (so the pages are the
        same as a whole-prompt packing's), keeping their BF16 blocks for the prompt's later
        chunks."""
        chunk = self._chunk(chunk)
        end = self.prompt_rows(kv.prompt_length)
        # appends end at multiples of the chunk from row 0 whatever the prompt's length: a
        # compact level's pages (which follow its appends) of those rows are then the same
        # in every prompt that starts with them, so they can be shared
        for stop in range(self.packed_rows(sequence) // chunk * chunk + chunk, end, chunk):
            if stop > rows:
                return
            self.pack_rows(sequence, kv, stop, drop=False)
        if rows >= end:
            self.pack_rows(sequence, kv, end, drop=False)

    def _chunk(self, chunk: int | None) -> int:
        chunk = self.chunk_rows if chunk is None else chunk
        if chunk <= 0 or chunk % self.group_size:
            raise ValueError(f"chunk={chunk} must be a multiple of group_size={self.group_size}")
        return chunk

    def pack_prompt(self, sequence: int, kv: RequestKV, chunk: int | None = None) -> None:
        """Encode a completed prompt's whole groups at every depth (all but the BF16 tail
        under ``rolling``) that :meth:`pack_final_prompt_rows` has not, ``chunk`` rows at
        a time so the conversion peak stays bounded, then free their BF16 blocks.
        ``fixed_prompt`` packs nothing after the prompt: what its reservation holds beyond
        the pages taken (compact levels take fewer) goes back to the pool."""
        chunk = self._chunk(chunk)
        self.pack_final_prompt_rows(sequence, kv, kv.prompt_length, chunk)
        kv.drop(self.packed_rows(sequence))  # rows adopted from another prompt included
        if self.policy != "rolling":
            self.store.unreserve(sequence)

    def flush_tail(self, sequence: int, kv: RequestKV) -> None:
        """``rolling``: move whole groups of final rows from the BF16 tail to the store,
        each time the tail reaches ``tail_size + group_size`` rows."""
        if self.policy != "rolling":
            return
        while kv.final_rows - self.packed_rows(sequence) >= self.tail_size + self.group_size:
            self.pack_rows(sequence, kv, self.packed_rows(sequence) + self.group_size)

    def rows_until_repacking(self, sequence: int, final_rows: int) -> int | None:
        """``rolling``: how many more rows can become final before the next flush changes
        the packed rows (None: they never change after the prompt)."""
        if self.policy != "rolling":
            return None
        return self.packed_rows(sequence) + self.tail_size + self.group_size - final_rows

    # ------------------------------------------------------------ per-batch metadata
    def plan(self, view: BatchView, sequences: list[int], depths: list[int]) -> None:
        """Reader metadata for ``view``'s decode rows (host planning step): ``sequences[i]``
        and ``depths[i]`` of its i-th decode row, in batch order, which the stable
        decode-first order keeps first; rows of sequences not packed yet read BF16 only.
        Prefill and padding rows read no packed KV and cost nothing here."""
        bound = view.num_rows if view.decode_bound is None else view.decode_bound
        if len(sequences) != bound or len(depths) != bound:
            raise ValueError(
                f"plan got {len(sequences)} rows but the batch has decode_bound={bound} decode "
                "rows: only decode rows read packed KV, each planned once"
            )
        meta = level_metadata(self.store, sequences, depths, view.device)
        self._planned, self._ordered = (view, meta), meta  # already the decode-first order

    def meta_for(self, view: BatchView, order: torch.Tensor | None) -> LevelMetadata:
        """The planned metadata in the backend's gathered row order (computed once per
        batch: every layer gathers the same order; ``order`` None: the view's own)."""
        if self._planned is None or self._planned[0] is not view:
            raise RuntimeError(
                "packed KV metadata was not planned for this batch: the host calls "
                "backend.plan(view, request_ids, depths) after building it"
            )
        if order is None:
            return self._planned[1]
        if self._ordered is None:
            self._ordered = self._planned[1].rows(order)
        return self._ordered  # decode rows first: readers take the first decode_bound rows

    # ------------------------------------------------------------ graph metadata
    def reserve_graph_inputs(self, rows: int, max_context: int, depths: int) -> None:
        self._graph = _GraphInputs(self.store, rows, max_context, depths, self.compact_from)

    def plan_graph_step(self, sequences: list[int | None], depths: list[int]) -> GraphStep:
        if self._graph is None:
            raise RuntimeError("plan_graph_step needs reserve_graph_inputs(...) first")
        return self._graph.fill(sequences, depths)

    def bind_graph_step(self, view: BatchView, step: GraphStep) -> None:
        """The metadata a graph step planned into the fixed buffers, for ``view``."""
        assert self._graph is not None
        meta = self._graph.meta.first_levels(view.num_rows, step.variant)
        self._planned, self._ordered = (view, meta), None


class _GraphInputs:
    """The packed reader's metadata at fixed addresses and widths for graphs of up to
    ``rows`` rows: a row's page tables and maps (every level its sequence has) are
    rewritten only when its sequence or that sequence's packing changed since the
    buffers last held them; per step only the kinds (which levels the row's depth reads)
    and packed lengths."""

    def __init__(
        self, store: PackedKVStore, rows: int, max_context: int, depths: int, compact_from: int
    ) -> None:
        device = store.blocks.device
        self.store, self.packed_rows = store, max_context
        self.pages = max(1, -(-max_context // store.group_size))
        # kinds [rows, depths] and packed lengths [rows] share one device buffer, written
        # each step from a pinned host copy by one asynchronous copy (a pageable copy would
        # wait for the device)
        cuda = device.type == "cuda"
        words = rows * (depths + 1)
        self._step = torch.zeros(words, dtype=torch.int32, device=device)
        host = torch.zeros(words, dtype=torch.int32, pin_memory=cuda)
        self._step_host, self._host_words = host, host.numpy()
        self._copied = torch.cuda.Event() if cuda else None
        self.meta = LevelMetadata(
            torch.full((rows, depths, self.pages), -1, dtype=torch.int32, device=device),
            torch.full((rows, depths, self.packed_rows), -1, dtype=torch.int32, device=device),
            self._step[: rows * depths].view(rows, depths),
            self._step[rows * depths :],
            compact_from,
        )
        self.versions: list[int | None] = [None] * rows  # the entry version each row holds
        # per row: (entry version, per depth (kinds, first compact level), packed rows)
        self._row_steps: list[tuple | None] = [None] * rows

    def _row_step(self, row: int, entry, depth: int) -> tuple[list[int], int, int]:
        """(kinds, first compact level, packed rows) of ``row`` at ``depth``, computed once
        per version of its sequence's entry."""
        version = level_version(entry)
        cached = self._row_steps[row]
        if cached is None or cached[0] != version:
            levels = self.meta.num_levels
            by_depth = []
            for d in range(levels):
                kinds = row_kinds(entry, d, levels)
                by_depth.append((kinds, first_compact(torch.tensor([kinds]))))
            cached = (version, by_depth, row_packed(entry))
            self._row_steps[row] = cached
        kinds, first = cached[1][min(depth, len(cached[1]) - 1)]
        return kinds, first, cached[2]

    def fill(self, sequences: list[int | None], depths: list[int]) -> GraphStep:
        levels, pages, rows = level_widths(self.store, sequences, depths)
        if pages > self.pages or rows > self.packed_rows:
            return GraphStep(
                levels,
                f"a packed history of {rows} rows exceeds the graph capacity of {self.packed_rows}",
            )
        entries = [self.store.sequences.get(s) if s is not None else None for s in sequences]
        tables, maps = self.meta.tables, self.meta.maps
        for row, entry in enumerate(entries):
            version = level_version(entry)  # unique per append across the store
            if entry is not None and self.versions[row] != version:
                tables[row].fill_(-1)
                maps[row].fill_(-1)
                write_row_levels(entry, tables[row], maps[row], tables.shape[1])
                self.versions[row] = version
        steps = [
            self._row_step(row, e, d)
            for row, (e, d) in enumerate(zip(entries, depths, strict=True))
        ]
        first = min((step[1] for step in steps), default=self.meta.num_levels)
        if first < self.meta.compact_from:
            raise RuntimeError(
                f"a row reads level {first} as compact; the graph buffers' kernels read "
                f"levels below {self.meta.compact_from} as dense only"
            )
        if self._copied is not None:  # the last step's copy may still read the host buffer
            self._copied.synchronize()
        all_rows, all_levels = self.meta.kinds.shape
        kinds = self._host_words[: all_rows * all_levels].reshape(all_rows, all_levels)
        packed = self._host_words[all_rows * all_levels :]
        for row, (row_kinds_now, _, packed_rows) in enumerate(steps):
            kinds[row] = row_kinds_now
            packed[row] = packed_rows
        self._step.copy_(self._step_host, non_blocking=True)
        if self._copied is not None:  # on the stream the copy ran on (the store's device)
            self._copied.record(torch.cuda.current_stream(self._step.device))
        return GraphStep(levels)
