"""A sequence's packed rows moving between owners, as :class:`~flashloop_backend.kv.store.
PackedKVStore` methods: shared with later sequences that start with the same rows (prefix
reuse; pages held by several), and exported to or imported from host tensors (snapshots,
PD handoff)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashloop_backend.kv.encoding import ENCODING_VERSION, POOL_NAMES, V2_POOL_NAMES
from flashloop_backend.kv.sequence_levels import OutOfPackedPagesError, SequenceLevels


@dataclass(frozen=True)
class SharedRows:
    """The first ``rows`` rows of a stored sequence, held for other sequences to start
    from: ``pages`` [level] -> its pages of those rows, ``maps`` [level] -> the compact
    level's [rows] int32 map on the host (None: dense). A compact level's rows are shared
    only whole: the pages of its appends up to ``rows``."""

    rows: int
    pages: tuple[tuple[int, ...], ...]
    maps: tuple[torch.Tensor | None, ...]

    @property
    def compact(self) -> bool:
        return any(m is not None for m in self.maps)


def _int_pair(tensors: dict[str, torch.Tensor], key: str) -> tuple[int, int]:
    value = tensors.get(key)
    if value is None or value.shape != (2,) or value.dtype not in (torch.int32, torch.int64):
        found = None if value is None else f"{value.dtype} {list(value.shape)}"
        raise ValueError(f"packed tensor {key!r} must be int32 or int64 [2]; found {found}")
    first, second = (int(v) for v in value.tolist())
    if first < 0 or second < 1:
        raise ValueError(f"packed tensor {key!r} = {[first, second]}: rows >= 0, depths >= 1")
    return first, second


def _checked_map(mapping: torch.Tensor | None, depth: int, rows: int, capacity: int):
    """A level's logical -> compact map, or None for a dense level (whose pages must then
    cover every row)."""
    if mapping is None:
        if capacity < rows:
            raise ValueError(f"dense packed level {depth} holds {capacity} rows; needs {rows}")
        return None
    if mapping.dtype != torch.int32 or mapping.shape != (rows,):
        raise ValueError(
            f"packed tensor 'level{depth}.map' must be int32 [{rows}]; found "
            f"{mapping.dtype} {list(mapping.shape)}"
        )
    if rows and not bool(((mapping >= -1) & (mapping < capacity)).all()):
        raise ValueError(f"packed tensor 'level{depth}.map' points outside [-1, {capacity})")
    return mapping.clone()


class SequenceTransfer:
    """Sharing, adopting, exporting and importing a sequence's levels (a mixin of
    :class:`~flashloop_backend.kv.store.PackedKVStore`: it uses the store's pools, free
    list, holders and sequence tables)."""

    def share(self, sequence: int, rows: int) -> SharedRows | None:
        """Hold the sequence's first ``rows`` rows for other sequences to start from: whole
        groups of dense levels; with a compact level, exactly the rows of its appends up to
        ``rows`` (a compact level's pages follow its appends, so only rows that ended an
        append are shared; None otherwise, or when none are stored). :meth:`drop` gives
        the hold back."""
        levels = self.sequences.get(sequence)
        if levels is None:
            return None
        compact = any(m is not None for m in levels.host_maps)
        rows = min(rows, levels.rows) // self.group_size * self.group_size
        if not rows or (compact and rows not in levels.marks):
            return None
        counts = levels.marks.get(rows) or [rows // self.group_size] * len(levels.pages)
        pages = tuple(tuple(level[:n]) for level, n in zip(levels.pages, counts, strict=True))
        maps = tuple(None if m is None else m[:rows].clone() for m in levels.host_maps)
        self._hold(page for level in pages for page in level)
        return SharedRows(rows, pages, maps)

    def drop(self, shared: SharedRows) -> None:
        """Give back a hold of :meth:`share` (a page nothing else holds returns to the pool)."""
        self._give_back(page for level in shared.pages for page in level)

    def frees_on_drop(self, shared: SharedRows) -> bool:
        """Whether :meth:`drop` would return a page to the pool (one only this hold has)."""
        return any(self._holders.get(p, 1) == 1 for level in shared.pages for p in level)

    def adoptable(self, shared: SharedRows, rows: int) -> int:
        """The rows of ``shared`` a sequence that may adopt ``rows`` of them takes: whole
        groups, all of them or (with a compact level) none unless it takes all."""
        rows = min(rows, shared.rows) // self.group_size * self.group_size
        return 0 if shared.compact and rows != shared.rows else rows

    def adopt(self, sequence: int, shared: SharedRows, rows: int) -> int:
        """Start a new sequence with :meth:`adoptable` rows of ``shared``, held, not
        copied. Returns the rows adopted (0: none, nothing stored)."""
        if sequence in self.sequences:
            raise ValueError(f"sequence {sequence} is already stored; release it first")
        rows = self.adoptable(shared, rows)
        if not rows:
            return 0
        groups = rows // self.group_size
        pages = [
            list(level if m is not None else level[:groups])
            for level, m in zip(shared.pages, shared.maps, strict=True)
        ]
        self._hold(page for level in pages for page in level)
        device = self.blocks.device
        maps = [None if m is None else m.to(device) for m in shared.maps]
        levels = SequenceLevels(
            rows, pages, maps, [None if m is None else m.clone() for m in shared.maps]
        )
        levels.marks[rows] = [len(level) for level in pages]
        self._appends += 1
        levels.version = self._appends
        self.sequences[sequence] = levels
        return rows

    def export_sequence(self, sequence: int) -> dict[str, torch.Tensor]:
        """The sequence's stored levels as CPU tensors, the input of :meth:`import_sequence`
        in any store of the same geometry: ``levels`` [2] (logical rows, depths), per level d
        its pages gathered in level order (``level{d}.blocks`` [pages, L, Hkv, block bytes]
        uint8, encoding v3) and, for a compact level, ``level{d}.map`` [rows]
        int32. Empty when nothing is stored for it."""
        levels = self.sequences.get(sequence)
        if levels is None:
            return {}
        out = {"levels": torch.tensor([levels.rows, len(levels.pages)])}
        for depth, pages in enumerate(levels.pages):
            index = torch.tensor(pages, dtype=torch.long, device=self.blocks.device)
            for name, pool in zip(POOL_NAMES, self.pools, strict=True):
                out[f"level{depth}.{name}"] = pool[index].cpu()
            if levels.host_maps[depth] is not None:
                out[f"level{depth}.map"] = levels.host_maps[depth].clone()
        return out

    def import_sequence(self, sequence: int, tensors: dict[str, torch.Tensor]) -> None:
        """Store what :meth:`export_sequence` gave, on new pages drawn from the sequence's
        reservation first (as an append's). Every tensor is checked against this store's
        geometry before a page is taken; a refusal (``ValueError`` naming the tensor,
        ``OutOfPackedPagesError``) takes nothing."""
        if sequence in self.sequences:
            raise ValueError(f"sequence {sequence} is already stored; release it first")
        rows, depths = _int_pair(tensors, "levels")
        g = self.group_size
        if rows % g:
            raise ValueError(f"packed tensor 'levels' has {rows} rows, not whole groups of {g}")
        older = sorted(n for n in tensors if n.rpartition(".")[2] in V2_POOL_NAMES)
        if older:
            raise ValueError(
                f"packed tensors {older[:3]} are encoding version 2's (separate pools, V "
                f"codes channel-major); this store holds encoding version {ENCODING_VERSION} "
                "blocks (level<d>.blocks): re-export the request from a version-3 store"
            )
        counts, maps = [], []
        for depth in range(depths):
            for name, pool in zip(POOL_NAMES, self.pools, strict=True):
                key = f"level{depth}.{name}"
                got = tensors.get(key)
                if got is None or got.dtype != pool.dtype or got.shape[1:] != pool.shape[1:]:
                    found = None if got is None else f"{got.dtype} {list(got.shape)}"
                    raise ValueError(
                        f"packed tensor {key!r} must be {pool.dtype} [pages, "
                        f"{', '.join(map(str, pool.shape[1:]))}]; found {found}"
                    )
                if name == POOL_NAMES[0]:
                    counts.append(got.shape[0])
                elif got.shape[0] != counts[-1]:
                    raise ValueError(
                        f"packed tensor {key!r} has {got.shape[0]} pages, "
                        f"level{depth}.{POOL_NAMES[0]} {counts[-1]}"
                    )
            maps.append(_checked_map(tensors.get(f"level{depth}.map"), depth, rows, counts[-1] * g))
        needed = sum(counts)
        own = self._reserved.get(sequence, 0)
        if needed > own + self.unreserved_pages():
            raise OutOfPackedPagesError(
                f"packed KV for sequence {sequence} needs {needed} pages, "
                f"{own + self.unreserved_pages()} free of {self.num_pages} ({own} reserved for it)"
            )
        if own:
            self._reserved[sequence] = own - min(own, needed)
        device = self.blocks.device
        levels = SequenceLevels(rows, [], [], [])
        for depth, count in enumerate(counts):
            pages = [self._free.pop() for _ in range(count)]
            index = torch.tensor(pages, dtype=torch.long, device=device)
            for name, pool in zip(POOL_NAMES, self.pools, strict=True):
                pool[index] = tensors[f"level{depth}.{name}"].to(device)
            levels.pages.append(pages)
            levels.host_maps.append(maps[depth])
            levels.maps.append(None if maps[depth] is None else maps[depth].to(device))
        self._appends += 1
        levels.version = self._appends
        self.sequences[sequence] = levels
