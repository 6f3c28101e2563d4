"""Per-batch reader metadata of the packed store, planned on the host: per row, the page
ids and compact maps of every level it reads, each level's kind and the packed length
(:class:`LevelMetadata`). Graph buffers rewrite a row's share only when its sequence
changed (``level_version``)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import torch

from flashloop_backend.device_copy import copy_into, to_device
from flashloop_backend.kv.store import PackedKVStore, SequenceLevels


class LevelKind(IntEnum):
    """How a row reads one level: every logical row stored (``DENSE``), only the rows a
    compact map names (``COMPACT``), or not at all (``EMPTY``: past the row's depth)."""

    DENSE = 0
    COMPACT = 1
    EMPTY = 2


@dataclass(frozen=True)
class LevelMetadata:
    """What the packed readers read per row (R rows, Lv levels, P pages, Tp packed rows):

    tables [R, Lv, P] int32 page ids per level (-1 past the level's pages); maps [R, Lv,
    Tp] int32 logical -> compact row (-1: absent); kinds [R, Lv] int32 :class:`LevelKind`;
    packed_lengths [R] int32 packed rows of the row's sequence (0: it reads BF16 only). A
    row at depth d reads levels 0..d. ``compact_from``: the first level any row may read
    as ``COMPACT`` (known on the host; kernels read the levels below it as dense only)."""

    tables: torch.Tensor
    maps: torch.Tensor
    kinds: torch.Tensor
    packed_lengths: torch.Tensor
    compact_from: int = 1

    @property
    def num_levels(self) -> int:
        return self.kinds.shape[1]

    def rows(self, index: torch.Tensor) -> LevelMetadata:
        """The metadata of rows ``index`` ([N] int64 or a slice), in that order."""
        return LevelMetadata(
            self.tables[index],
            self.maps[index],
            self.kinds[index],
            self.packed_lengths[index],
            self.compact_from,
        )

    def head(self, count: int) -> LevelMetadata:
        """The first ``count`` rows."""
        return self.rows(slice(0, count))

    def first_levels(self, rows: int, levels: int) -> LevelMetadata:
        """The first ``rows`` rows and ``levels`` levels (a graph bucket's views)."""
        return LevelMetadata(
            self.tables[:rows, :levels],
            self.maps[:rows, :levels],
            self.kinds[:rows, :levels],
            self.packed_lengths[:rows],
            self.compact_from,
        )

    def to(self, device: torch.device | str) -> LevelMetadata:
        """On ``device``; from the host through pinned asynchronous copies (a pageable
        copy of a batch's maps, megabytes at 32K, would wait for the queued steps)."""
        return LevelMetadata(
            to_device(self.tables, device),
            to_device(self.maps, device),
            to_device(self.kinds, device),
            to_device(self.packed_lengths, device),
            self.compact_from,
        )


def level_metadata(
    store: PackedKVStore,
    sequences: list[int | None],
    depths: list[int],
    device: torch.device | str,
    widths: tuple[int, int, int] | None = None,
) -> LevelMetadata:
    """Per-row reader metadata, built once per batch on the host, Lv = the deepest packed
    row's depth + 1. A row whose sequence is None or not in the store (padding, not packed
    yet) reads BF16 only. ``widths`` (Lv, P, Tp) fixes the shapes (a CUDA graph's buffers);
    each must hold the batch's own (:func:`level_widths`)."""
    entries = [store.sequences.get(s) if s is not None else None for s in sequences]
    levels, pages, rows = natural = level_widths(store, sequences, depths)
    if widths is not None:
        if any(w < n for w, n in zip(widths, natural, strict=True)):
            raise ValueError(
                f"metadata widths {widths} are below this batch's (levels, pages, rows) {natural}"
            )
        levels, pages, rows = widths
    tables = torch.full((len(sequences), levels, pages), -1, dtype=torch.int32)
    maps = torch.full((len(sequences), levels, rows), -1, dtype=torch.int32)
    kinds = torch.full((len(sequences), levels), int(LevelKind.EMPTY), dtype=torch.int32)
    packed = torch.zeros(len(sequences), dtype=torch.int32)
    # per-row host work only for rows of packed sequences, once per (sequence, depth): a
    # prefill chunk's thousands of rows (not packed yet) keep the fill values, so a step's
    # host planning grows with its packed rows, not with its prefill rows (the cost of the
    # other way is in results/README.md, "All three features at 32K")
    written: dict[tuple[int, int], int] = {}
    for i, (sequence, entry, depth) in enumerate(zip(sequences, entries, depths, strict=True)):
        if entry is None:
            continue
        first = written.setdefault((sequence, depth), i)
        if first != i:
            tables[i], maps[i], kinds[i], packed[i] = (
                tables[first],
                maps[first],
                kinds[first],
                packed[first],
            )
            continue
        write_row_levels(entry, tables[i], maps[i], depth + 1)
        kinds[i] = torch.tensor(row_kinds(entry, depth, levels))
        packed[i] = row_packed(entry)
    return LevelMetadata(tables, maps, kinds, packed, first_compact(kinds)).to(device)


def first_compact(kinds: torch.Tensor) -> int:
    """The first level any row of ``kinds`` [R, Lv] (host) reads as compact (Lv: none)."""
    compact = (kinds == int(LevelKind.COMPACT)).any(0).nonzero()
    return int(compact[0]) if compact.numel() else kinds.shape[1]


def write_row_levels(
    entry: SequenceLevels | None, tables: torch.Tensor, maps: torch.Tensor, levels: int
) -> None:
    """Write one row's page ids ``tables`` [Lv, P] and compact maps ``maps`` [Lv, Tp] (any
    device; -1 where absent) for its sequence's first ``levels`` levels. Into a GPU's
    buffers the copies are asynchronous, so writing them does not wait for the device."""
    if entry is None:
        return
    for level in range(min(levels, len(entry.pages), tables.shape[0])):
        if entry.pages[level]:
            pages = torch.tensor(entry.pages[level], dtype=torch.int32)
            copy_into(tables[level, : len(entry.pages[level])], pages)
        if entry.host_maps[level] is not None:
            copy_into(maps[level, : entry.rows], entry.host_maps[level])


def row_kinds(entry: SequenceLevels | None, depth: int, levels: int) -> list[int]:
    """Per level < ``levels``: how a row at ``depth`` reads it (``EMPTY`` past its
    depth or the sequence's levels: readers skip the level, whatever its table holds)."""
    kinds = [int(LevelKind.EMPTY)] * levels
    if entry is not None:
        for level in range(min(depth + 1, len(entry.pages), levels)):
            if entry.pages[level]:
                kind = LevelKind.DENSE if entry.maps[level] is None else LevelKind.COMPACT
                kinds[level] = int(kind)
    return kinds


def row_packed(entry: SequenceLevels | None) -> int:
    """Packed rows of the row's sequence (0: reads BF16 only)."""
    return 0 if entry is None else entry.rows


def level_version(entry: SequenceLevels | None) -> int | None:
    """Differs whenever the row's page ids or maps may differ (another entry, an append)."""
    return None if entry is None else entry.version


def level_widths(
    store: PackedKVStore, sequences: list[int | None], depths: list[int]
) -> tuple[int, int, int]:
    """(levels, pages, rows) the metadata of this batch needs: the deepest packed row's
    depth + 1 (the reader's LEVELS), the most pages of a level, the most packed rows."""
    entries = [store.sequences.get(s) if s is not None else None for s in sequences]
    known = [(e, d) for e, d in zip(entries, depths, strict=True) if e is not None]
    levels = max((d for _, d in known), default=0) + 1
    pages = max((len(p) for e, _ in known for p in e.pages), default=1)
    rows = max((e.rows for e, _ in known), default=1)
    return levels, max(pages, 1), max(rows, 1)
