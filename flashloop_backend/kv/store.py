"""Packed INT4 KV storage (RFC §3.3, DESIGN §4): a base for depth 0 and residual levels for
deeper depths, paged by groups of G tokens (G = ``group_size``, 64 by default).

A page is one group of G consecutive rows of one level, all layers: ``blocks`` [pages,
L, Hkv, block bytes] uint8 holds one contiguous block per (page, layer, KV head) in the
byte order of encoding v3 (``kv.layout``: K and V codes token-major, K's per-channel
parameters, V's per-token records). A level of a sequence is a list of pages. A *dense*
level covers every logical row; a *compact* level (token-sparse prefill depths) stores
only the rows that recomputed it, packed in order, with a map logical row -> compact row
(-1: absent, the row inherits the previous reconstruction; an absent residual is never
code 0).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from flashloop_backend.algorithms import (
    QuantizedInt4,
    dequantize_int4,
    quantize_int4,
    unpack_codes,
)
from flashloop_backend.device_copy import to_device
from flashloop_backend.kv.layout import PackedLayout, pack_row, param_channels
from flashloop_backend.kv.rows import KVRows

# 3: one block per (page, layer, KV head), K and V codes token-major in the nibble order of
# ``kv.layout``; 2 (refused): separate pools, V codes channel-major
ENCODING_VERSION = 3


def encoding_descriptor(group_size: int, policy: str, tail_size: int, compact: bool) -> dict:
    """The versioned description of the packed format (goes into the effective config)."""
    return {
        "version": ENCODING_VERSION,
        "bits": 4,
        "byte_order": "one block per (page, layer, KV head): K codes [G][D/2], V codes "
        "[G][D/2] token-major (nibble order of kv.layout), K params [scale x D][min x D], "
        "V records [G][D/G][min, scale]",
        "k_groups": f"per channel across {group_size} token rows (post-RoPE)",
        "v_groups": f"per token row across {group_size} channels",
        "params": "float16 minimum and scale",
        "depths": "INT4 base at depth 0; INT4 residual against the reconstruction per depth",
        "token_sparse_depths": "compact residual rows + logical->compact map"
        if compact
        else "dense",
        "window_policy": policy,
        "tail_policy": f"bfloat16 tail of >= {tail_size} rows" if policy == "rolling" else "none",
    }


POOL_NAMES = ("blocks",)  # ``pools`` order
# the per-level tensor names of encoding 2's exports: named when a v2 export is offered
V2_POOL_NAMES = ("k_codes", "k_min", "k_scale", "v_codes", "v_min", "v_scale")


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


class OutOfPackedPagesError(MemoryError):
    """The packed pool cannot give a sequence the pages it asks for; nothing was taken."""


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


@dataclass
class SequenceLevels:
    """Where one sequence's levels live: pages per level and compact maps."""

    rows: int  # packed logical rows (a multiple of the group size)
    pages: list[list[int]] = field(default_factory=list)  # [level] -> page ids
    maps: list[torch.Tensor | None] = field(default_factory=list)  # [level] -> [rows] int32
    # the same maps on the host: per-batch reader metadata is planned there every step
    host_maps: list[torch.Tensor | None] = field(default_factory=list)
    version: int = 0  # the store's append count at this entry's last append (unique)
    # rows after each append -> every level's page count then (where a prefix may be shared)
    marks: dict[int, list[int]] = field(default_factory=dict)
    # a level appended on its own: its rows past ``rows`` (level -> rows ahead)
    ahead: dict[int, int] = field(default_factory=dict)
    # (level, first row) -> (rows, pages, compact rows) of a level's append that a later
    # level's append of the same rows reads its residuals against; gone once every level
    # holds those rows
    spans: dict[tuple[int, int], tuple[int, list[int], torch.Tensor | None]] = field(
        default_factory=dict
    )
    # level -> {its rows after an append of it -> its page count then}
    level_marks: dict[int, dict[int, int]] = field(default_factory=dict)

    def level_rows(self, level: int) -> int:
        """Logical rows stored at ``level`` (``rows`` plus those appended to it alone)."""
        return self.rows + self.ahead.get(level, 0)


class PackedKVStore:
    """Page pools for every layer plus per-sequence level tables. Allocation is a free
    list; ``encode`` writes a whole prompt (all layers, all depths) at once. A sequence may
    :meth:`reserve` pages ahead: its appends draw on them first, and no other sequence's
    append can take them."""

    def __init__(
        self,
        num_pages: int,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        group_size: int = 64,
        device: torch.device | str = "cpu",
        layers_per_pass: int = 1,
    ) -> None:
        """``layers_per_pass``: layers an append encodes together (FP32 scratch grows with
        it, launches shrink; the result is the same bit for bit)."""
        if head_dim % group_size:
            raise ValueError(f"head_dim={head_dim} must be a multiple of group_size={group_size}")
        if layers_per_pass < 1:
            raise ValueError(f"layers_per_pass={layers_per_pass} must be >= 1")
        self.layers_per_pass = layers_per_pass
        self.group_size = group_size
        self.layout = PackedLayout(group_size, head_dim)
        self.shape = (num_layers, kv_heads, head_dim)
        self.blocks = torch.zeros(
            (num_pages, num_layers, kv_heads, self.layout.block_bytes),
            dtype=torch.uint8,
            device=device,
        )
        self._free = list(range(num_pages - 1, -1, -1))
        self._reserved: dict[int, int] = {}  # sequence -> free pages held for its appends
        self._holders: dict[int, int] = {}  # page -> its holders, for pages held by several
        self.sequences: dict[int, SequenceLevels] = {}
        self._appends = 0

    @property
    def pools(self) -> tuple[torch.Tensor, ...]:
        return (self.blocks,)

    def page_bytes(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.pools)

    @property
    def num_pages(self) -> int:
        return self.blocks.shape[0]

    def unreserved_pages(self) -> int:
        """Free pages that no sequence holds."""
        return len(self._free) - sum(self._reserved.values())

    def reserve(self, sequence: int, pages: int) -> None:
        """Hold ``pages`` more free pages for the sequence's appends, atomically: when the
        unheld free pages are fewer, ``OutOfPackedPagesError`` names them and nothing is held."""
        if pages < 0:
            raise ValueError(f"pages={pages} must be >= 0")
        free = self.unreserved_pages()
        if pages > free:
            raise OutOfPackedPagesError(
                f"packed KV for sequence {sequence} needs {pages} pages, {free} free of "
                f"{self.num_pages} ({len(self._free) - free} held by reservations)"
            )
        if pages:
            self._reserved[sequence] = self._reserved.get(sequence, 0) + pages

    def unreserve(self, sequence: int) -> int:
        """Give the pages still held for the sequence back to the pool; returns how many."""
        return self._reserved.pop(sequence, 0)

    def release(self, sequence: int) -> None:
        """Return the sequence's pages (those another holder shares stay) and what remains
        of its reservation."""
        self.unreserve(sequence)
        levels = self.sequences.pop(sequence, None)
        if levels is not None:
            for pages in levels.pages:
                self._give_back(pages)

    def _give_back(self, pages) -> None:
        for page in pages:
            holders = self._holders.pop(page, 1) - 1
            if holders:
                self._holders[page] = holders
            else:
                self._free.append(page)

    def _hold(self, pages) -> None:
        for page in pages:
            self._holders[page] = self._holders.get(page, 1) + 1

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

    def encode(
        self,
        sequence: int,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        active: list[torch.Tensor] | None = None,
        write: LevelWriter | None = None,
    ) -> None:
        """Encode a new sequence's first rows at every depth (see :meth:`append`)."""
        if sequence in self.sequences:
            raise ValueError(f"sequence {sequence} is already encoded; release it first")
        self.append(sequence, keys, values, active, write)

    def append(
        self,
        sequence: int,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        active: list[torch.Tensor] | None = None,
        write: LevelWriter | None = None,
    ) -> None:
        """:meth:`append_rows` of rows given as tensors: keys / values per depth
        [T, L, Hkv, D]."""
        if len(keys) != len(values):
            raise ValueError(f"{len(keys)} depths of K but {len(values)} of V")
        rows = [KVRows.contiguous(k, v) for k, v in zip(keys, values, strict=True)]
        self.append_rows(sequence, rows, active, write)

    def append_rows(
        self,
        sequence: int,
        rows_by_depth: list[KVRows | None],
        active: list[torch.Tensor] | None = None,
        write: LevelWriter | None = None,
    ) -> None:
        """Encode the sequence's next rows (a new sequence starts at row 0) at every depth
        given, through ``write`` (None: :func:`encode_levels_chain`, the torch oracle).

        rows_by_depth: per depth its T rows of K and V (T a multiple of the group size;
        depth d's logical history, so inactive rows repeat their exit depth's value), in
        place in paged pools or as tensors, or None for a level this append leaves alone.
        The levels given are consecutive and continue at the same row; every level below
        them was appended alone over exactly these rows before (its residuals are read from
        those pages), so a prompt may be packed level by level with the bytes of an append
        of every level at once. ``active``: per depth [T] bool rows that recomputed it
        (None: all). Residuals are taken against the running reconstruction of these rows,
        only over active rows. A level stays dense (no map) while every appended row has
        it; otherwise it becomes compact, and the rows appended now start a fresh page of
        it."""
        g = self.group_size
        written = [d for d, r in enumerate(rows_by_depth) if r is not None]
        shapes = [rows_by_depth[d].shape for d in written]
        rows = shapes[0][0] if shapes else 0
        if not shapes or rows % g or any(shape != shapes[0] for shape in shapes):
            raise ValueError(
                f"every depth needs the same [T, L, Hkv, D] with T a multiple of {g}; got {shapes}"
            )
        if written != list(range(written[0], written[-1] + 1)):
            raise ValueError(f"an append writes consecutive levels; got levels {written}")
        if tuple(shapes[0][1:]) != self.shape:
            raise ValueError(
                f"K/V rows must be [L, Hkv, D] = {list(self.shape)} like the store's pools; "
                f"got {list(shapes[0][1:])}"
            )
        levels = self.sequences.get(sequence)
        depths = len(rows_by_depth)
        if levels is not None and len(levels.pages) != depths:
            raise ValueError(f"sequence {sequence} has {len(levels.pages)} depths; got {depths}")
        start = 0 if levels is None else levels.level_rows(written[0])
        held = [0 if levels is None else levels.level_rows(d) for d in written]
        if any(h != start for h in held):
            raise ValueError(
                f"levels {written} of sequence {sequence} hold {held} rows: an append "
                "continues levels that hold the same rows"
            )
        below = {}  # level -> (rows, pages, compact rows) of its append of these rows
        for depth in range(written[0]):
            span = None if levels is None else levels.spans.get((depth, start))
            if span is None or span[0] != rows:
                raise ValueError(
                    f"level {depth} of sequence {sequence} has no append of rows "
                    f"[{start}, {start + rows}) to take level {written[0]}'s residuals against"
                )
            below[depth] = span
        # per depth: the rows that recomputed it, None when all did; on the host, where the
        # page counts and row maps are made (a device mask is read once here)
        presents = []
        for depth in range(depths):
            present = None
            if depth and active is not None:
                present = active[depth].cpu().nonzero().flatten()
            if depth in below:
                present = below[depth][2]
            presents.append(None if present is not None and present.numel() == rows else present)
        counts = [rows if p is None else p.numel() for p in presents]
        needed = sum(-(-counts[d] // g) for d in written)
        own = self._reserved.get(sequence, 0)
        if needed > own + self.unreserved_pages():  # up front: a failed append takes nothing
            raise OutOfPackedPagesError(
                f"packed KV for sequence {sequence} needs {needed} pages, "
                f"{own + self.unreserved_pages()} free of {self.num_pages} ({own} reserved for it)"
            )
        if own:  # its reservation first, then pages nobody holds
            self._reserved[sequence] = own - min(own, needed)
        if levels is None:
            levels = SequenceLevels(
                0, [[] for _ in range(depths)], [None] * depths, [None] * depths
            )
        pages = [
            list(below[d][1])
            if d in below
            else [self._free.pop() for _ in range(-(-counts[d] // g))]
            if d in written
            else []
            for d in range(depths)
        ]
        try:
            device = self.blocks.device
            on_device = [None if p is None else to_device(p, device) for p in presents]
            (write or encode_levels_chain)(self, rows_by_depth, on_device, pages)
        except BaseException:  # a refused write takes nothing: pages and reservation back
            for d in reversed(written):
                self._free.extend(reversed(pages[d]))
            if own:
                self._reserved[sequence] = own
            raise
        for depth in written:
            device = rows_by_depth[depth].device
            self._extend_level(levels, depth, pages[depth], presents[depth], rows, device)
            levels.ahead[depth] = levels.ahead.get(depth, 0) + rows
            levels.level_marks.setdefault(depth, {})[start + rows] = len(levels.pages[depth])
            if written[-1] < depths - 1:  # a later level's append reads these pages
                levels.spans[(depth, start)] = (rows, pages[depth], presents[depth])
        self._catch_up(levels)
        self._appends += 1
        levels.version = self._appends
        self.sequences[sequence] = levels

    @staticmethod
    def _catch_up(levels: SequenceLevels) -> None:
        """Move ``rows`` to the rows every level holds, with its mark where every level's
        append ended there, and forget the spans no level reads any more."""
        depths = len(levels.pages)
        done = min(levels.ahead.get(d, 0) for d in range(depths))
        if done:
            levels.rows += done
            levels.ahead = {d: a - done for d, a in levels.ahead.items() if a > done}
            counts = [levels.level_marks.get(d, {}).get(levels.rows) for d in range(depths)]
            if all(c is not None for c in counts):
                levels.marks[levels.rows] = counts
            levels.spans = {
                at: span for at, span in levels.spans.items() if at[1] + span[0] > levels.rows
            }
            levels.level_marks = {
                d: {r: c for r, c in marks.items() if r > levels.rows}
                for d, marks in levels.level_marks.items()
            }

    def encode_level(
        self, k, v, recon_k, recon_v, present, pages: list[int], layers: slice, quantize
    ):
        """Quantize one level of ``layers`` (k, v [T, Lb, Hkv, D], residuals against the
        running reconstruction, only the ``present`` rows when compact) into ``pages``;
        return the updated reconstruction."""
        g = self.group_size
        target_k = k.float() if recon_k is None else k.float() - recon_k
        target_v = v.float() if recon_v is None else v.float() - recon_v
        if present is not None:
            target_k, target_v = target_k[present], target_v[present]
        count = target_k.shape[0]
        padded = len(pages) * g
        if padded != count:  # a compact level's last group: repeat its last row
            fill = torch.arange(padded, device=k.device).clamp(max=count - 1)
            target_k, target_v = target_k[fill], target_v[fill]
        qk = quantize(target_k, g, 0)  # per channel across rows
        qv = quantize(target_v, g, -1)  # per row across channels
        self._write(pages, layers, qk, qv)
        dk, dv = dequantize_int4(qk)[:count], dequantize_int4(qv)[:count]
        return _accumulate(recon_k, recon_v, dk, dv, present)

    def add_level(self, recon_k, recon_v, pages: list[int], present, layers: slice):
        """The running reconstruction (FP32 [T, Lb, Hkv, D] or None before level 0) plus
        one stored level of ``layers`` read from its ``pages`` (its compact rows
        ``present``; None: dense), as :meth:`encode_level` adds the level it writes."""
        count = len(pages) * self.group_size if present is None else present.numel()
        dk, dv = (part[:count] for part in self._decode_pages(pages, layers))
        if recon_k is not None:
            dk, dv = dk.to(recon_k.device), dv.to(recon_k.device)
        return _accumulate(recon_k, recon_v, dk, dv, present)

    def _extend_level(
        self,
        levels: SequenceLevels,
        depth: int,
        pages: list[int],
        present: torch.Tensor | None,
        rows: int,
        device,
    ) -> None:
        """Add ``rows`` logical rows to one level: dense (``present`` None) or the compact
        rows ``present`` stored in ``pages``."""
        g = self.group_size
        mapping = levels.host_maps[depth]
        if present is None and mapping is None:
            levels.pages[depth].extend(pages)
            return
        if mapping is None:  # dense so far: its rows sit in page order
            mapping = torch.arange(levels.level_rows(depth), dtype=torch.int32)
        first = len(levels.pages[depth]) * g  # compact rows of this append start a fresh page
        block = torch.full((rows,), -1, dtype=torch.int32)
        if present is None:
            block = first + torch.arange(rows, dtype=torch.int32)
        else:  # built on the host; the device copy follows
            block[present] = first + torch.arange(present.numel(), dtype=torch.int32)
        levels.pages[depth].extend(pages)
        levels.host_maps[depth] = torch.cat([mapping, block])
        levels.maps[depth] = to_device(levels.host_maps[depth], device)

    def _write(self, pages: list[int], layers: slice, qk: QuantizedInt4, qv: QuantizedInt4) -> None:
        """``layers`` (Lb of them): qk codes [Lb, H, D, Pg, g/2] (groups along rows) and qv
        codes [T, Lb, H, D/g, g/2] (groups along channels), laid out as v3 blocks."""
        device = self.blocks.device
        lb = qk.codes.shape[0]
        _, heads, dim = self.shape
        g, count = self.group_size, len(pages)
        layout = self.layout
        k_codes = unpack_codes(qk).permute(3, 0, 1, 4, 2)  # [Pg, Lb, H, g tokens, D]
        columns = param_channels(dim, qk.scale.device)
        k_scale = qk.scale.permute(3, 0, 1, 2)[..., columns]  # [Pg, Lb, H, D]
        k_min = qk.minimum.permute(3, 0, 1, 2)[..., columns]
        v_codes = unpack_codes(qv).reshape(count, g, lb, heads, dim).permute(0, 2, 3, 1, 4)
        records = torch.stack((qv.minimum, qv.scale), -1)  # [T, Lb, H, D/g, 2]
        records = records.reshape(count, g, lb, heads, dim // g, 2).permute(0, 2, 3, 1, 4, 5)
        block = torch.cat(
            (
                pack_row(k_codes).flatten(-2),
                pack_row(v_codes).flatten(-2),
                k_scale.contiguous().view(torch.uint8),
                k_min.contiguous().view(torch.uint8),
                records.contiguous().view(torch.uint8).flatten(-3),
            ),
            dim=-1,
        )
        assert block.shape[-1] == layout.block_bytes
        index = to_device(torch.tensor(pages, dtype=torch.long), device)[:, None]
        at = (index, torch.arange(layers.start, layers.start + lb, device=device)[None, :])
        self.blocks[at] = block.to(device)

    def reconstruct(
        self, sequence: int, depth: int, layer: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FP32 K and V [T, Hkv, D] of ``sequence`` at ``depth`` and ``layer`` (the oracle
        the readers are tested against)."""
        levels = self.sequences[sequence]
        rows = levels.rows
        total_k = total_v = None
        for level in range(depth + 1):
            pages, mapping = levels.pages[level], levels.maps[level]
            if not pages:
                continue
            k, v = self._decode_pages(pages, layer)
            if mapping is None:
                total_k = k if total_k is None else total_k + k
                total_v = v if total_v is None else total_v + v
            else:
                present = mapping >= 0
                total_k[present] += k[mapping[present].long()]
                total_v[present] += v[mapping[present].long()]
        return total_k[:rows], total_v[:rows]

    def _decode_pages(
        self, pages: list[int], layers: int | slice
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """FP32 K and V [P * g, (Lb,) H, D] of ``pages`` at one layer or a slice of them."""
        index = to_device(torch.tensor(pages, dtype=torch.long), self.blocks.device)
        blocks = self.blocks[index, layers]  # [P, (Lb,) H, block bytes]
        k = self.layout.keys(blocks).movedim(-2, 1)  # [P, g, (Lb,) H, D]
        v = self.layout.values(blocks).movedim(-2, 1)
        return k.flatten(0, 1), v.flatten(0, 1)

    def accounting(self) -> dict:
        """Steady bytes of what is stored, from the tensors: payload (codes), parameters,
        maps, and the share per stored logical token and depth; pages used, still reserved
        for later appends, and in the pool."""
        layers, heads, _ = self.shape
        page_payload = layers * heads * self.layout.k_params  # K and V codes
        page_bytes = self.page_bytes()
        page_params = page_bytes - page_payload
        sequences = list(self.sequences.values())
        used = self.num_pages - len(self._free)  # a page several hold counts once
        held = len({p for s in sequences for level in s.pages for p in level})
        stored_maps = [m for s in sequences for m in s.maps if m is not None]
        maps = sum(m.numel() * m.element_size() for m in stored_maps)
        tokens = sum(s.rows for s in sequences)
        depths = max((len(s.pages) for s in sequences), default=0)
        pages_by_depth = [
            len({p for s in sequences if d < len(s.pages) for p in s.pages[d]})
            for d in range(depths)
        ]
        per_depth = [pages * page_bytes for pages in pages_by_depth]
        steady = held * page_bytes + maps  # what sequences hold (per depth adds up to it)
        return {
            "pages_used": used,
            "pages_held_by_shares_only": used - held,  # a prefix cache's holds, no sequence
            "pages_reserved": sum(self._reserved.values()),
            "pages_total": self.num_pages,
            "payload_bytes": held * page_payload,
            "param_bytes": held * page_params,
            "map_bytes": maps,
            "steady_bytes": steady,
            "logical_tokens": tokens,
            "steady_bytes_per_token": steady / tokens if tokens else 0.0,
            "bytes_per_token_by_depth": [b / tokens if tokens else 0.0 for b in per_depth],
        }


def _accumulate(recon_k, recon_v, dk, dv, present):
    """The running reconstruction plus one level's values (of its ``present`` rows when
    compact; the first level, dense, starts it)."""
    if present is None:
        return (dk, dv) if recon_k is None else (recon_k + dk, recon_v + dv)
    recon_k, recon_v = recon_k.clone(), recon_v.clone()
    recon_k[present] += dk
    recon_v[present] += dv
    return recon_k, recon_v


class LevelWriter(Protocol):
    """Writes every level of one append into its pages (the ``packed_kv_write`` op):
    ``rows`` per depth its K and V (:class:`~flashloop_backend.kv.rows.KVRows`, in place in
    paged pools or as tensors), None for a level not written (one stored before, read from
    its ``pages``, or one above the written ones, with no pages); ``presents`` per depth
    the rows of a compact level (None: dense); ``pages`` per depth its page ids. Residuals
    are taken against the reconstruction of the levels before, as
    :func:`encode_levels_chain` does."""

    def __call__(
        self,
        store: PackedKVStore,
        rows: list[KVRows | None],
        presents: list[torch.Tensor | None],
        pages: list[list[int]],
    ) -> None: ...


def encode_levels_chain(
    store: PackedKVStore,
    rows: list[KVRows | None],
    presents: list[torch.Tensor | None],
    pages: list[list[int]],
    quantize=quantize_int4,
) -> None:
    """The oracle :class:`LevelWriter`: ``store.layers_per_pass`` layers at a time (the FP32
    reconstruction and the gathered copies are theirs, not all layers'), each level
    quantized by ``quantize`` against the running reconstruction of its rows."""
    num_layers = store.shape[0]
    for first in range(0, num_layers, store.layers_per_pass):
        layers = slice(first, min(first + store.layers_per_pass, num_layers))
        recon_k = recon_v = None
        for depth, depth_rows in enumerate(rows):
            if pages[depth] and depth_rows is None:  # appended before: read its pages
                recon_k, recon_v = store.add_level(
                    recon_k, recon_v, pages[depth], presents[depth], layers
                )
            elif pages[depth]:
                k, v = depth_rows.gather(layers)
                recon_k, recon_v = store.encode_level(
                    k,
                    v,
                    recon_k,
                    recon_v,
                    present=presents[depth],
                    pages=pages[depth],
                    layers=layers,
                    quantize=quantize,
                )


def bytes_per_token_report(kv_heads: int, head_dim: int, group_size: int, num_depths: int) -> dict:
    """Steady packed bytes per token, per layer, from a one-page store's real tensors: a
    dense level costs one page per group; BF16 planes cost 2 x 2 x Hkv x D per depth."""
    store = PackedKVStore(1, 1, kv_heads, head_dim, group_size)
    level = store.page_bytes() / group_size
    bf16 = 2 * 2 * kv_heads * head_dim
    return {
        "packed_bytes_per_token_per_level_per_layer": level,
        "bf16_bytes_per_token_per_depth_per_layer": bf16,
        "dense_levels_ratio_vs_bf16": bf16 / level,
        "depths": num_depths,
        "note": "compact levels (token-sparse depths) cost pages only for active rows "
        "plus a 4-byte map entry per row",
    }
