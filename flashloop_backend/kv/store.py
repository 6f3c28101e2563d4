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

import torch

from flashloop_backend.device_copy import to_device
from flashloop_backend.kv.codec import LevelWriter, ReferenceCodec, encode_levels_chain
from flashloop_backend.kv.layout import PackedLayout
from flashloop_backend.kv.rows import KVRows
from flashloop_backend.kv.sequence_levels import OutOfPackedPagesError, SequenceLevels
from flashloop_backend.kv.transfer import SequenceTransfer


class PackedKVStore(SequenceTransfer, ReferenceCodec):
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
