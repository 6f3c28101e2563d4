"""Per-depth paged KV cache with LAST_EXITED history (DESIGN §3).

K and V pools are shaped like vllm-rlt's, ``[num_blocks, num_layers, block_size, Hkv, D]``;
each request owns one block table per depth plane. A query at depth d reads plane d;
copy-on-exit finalization fills the deeper planes of a token that exited at e, so such
reads see version min(d, e).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashloop_backend.backends.base import KVRows
from flashloop_backend.device_copy import to_device
from flashloop_backend.host.layer_ops import write_kv


def plane_blocks(num_tokens: int, block_size: int, depths: int, carry_rows: int = 0) -> int:
    """The most blocks ``num_tokens`` positions on ``depths`` planes hold at once, the first
    ``carry_rows`` carried from plane to plane (one plane of them at a time)."""
    per_plane = -(-num_tokens // block_size)
    if not carry_rows:
        return per_plane * depths
    return per_plane + (depths - 1) * (per_plane - carry_rows // block_size)


class OutOfBlocksError(RuntimeError):
    """The pool cannot hold a request; nothing was allocated and no KV was touched."""


@dataclass
class _Tables:
    planes: list[list[int]] = field(default_factory=list)  # [depth][block index] -> block id
    capacity_tokens: int = 0
    carry_rows: int = 0  # leading rows whose blocks pass from plane to plane (reserve)
    carried_through: int = 0  # the deepest plane that has all its blocks
    carried_blocks: int = 0  # blocks the plane after it has taken so far
    # [depths, blocks] int32 host copy of ``planes``, rebuilt after a change: a step's batch
    # reads it instead of converting every plane's list again (one entry per block: long
    # contexts make long lists)
    cached: torch.Tensor | None = None


class PagedKVCache:
    def __init__(
        self,
        num_blocks: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        num_depths: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks={num_blocks} and block_size={block_size} must be positive"
            )
        # One extra block past the allocatable ones absorbs writes of padding rows (slot -1).
        shape = (num_blocks + 1, num_layers, block_size, num_kv_heads, head_dim)
        self.key_pool = torch.zeros(shape, dtype=dtype, device=device)
        self.value_pool = torch.zeros(shape, dtype=dtype, device=device)
        self.num_blocks, self.block_size, self.num_depths = num_blocks, block_size, num_depths
        self._free = list(range(num_blocks - 1, -1, -1))
        self._tables: dict[int, _Tables] = {}
        # request -> free blocks it will still take as its prompt's planes carry forward
        # (:meth:`carry_plane`); no other reservation may take them
        self._promised: dict[int, int] = {}
        # blocks with more than one holder (requests sharing a published prefix, the prefix
        # cache itself) -> holders; a block absent here has one
        self._holders: dict[int, int] = {}

    # ------------------------------------------------------------ allocation
    @property
    def free_blocks(self) -> int:
        """Free blocks no request has been promised (what a new reservation may take)."""
        return len(self._free) - self.promised_blocks

    @property
    def promised_blocks(self) -> int:
        """Free blocks promised to prompts whose planes carry forward."""
        return sum(self._promised.values())

    def blocks_needed(self, num_tokens: int, carry_rows: int = 0) -> int:
        """The most blocks ``num_tokens`` positions on every depth plane hold at once, the
        first ``carry_rows`` carried from plane to plane (:meth:`reserve`)."""
        return plane_blocks(num_tokens, self.block_size, self.num_depths, carry_rows)

    def reserve(
        self,
        request_id: int,
        num_tokens: int,
        shared: list[list[int]] | None = None,
        carry_rows: int = 0,
    ) -> None:
        """Make room for positions [0, num_tokens) on every plane, atomically. ``shared``
        (a new request only): per plane the blocks it starts with, held by others too (a
        published prefix); they count once more as held and are never written here.
        ``carry_rows`` (a new request only, a multiple of the block size): the leading
        prompt rows whose blocks pass from each plane to the next once the backend has
        stored that depth (:meth:`carry_plane`); only the first plane gets blocks now, and
        each later plane is promised the blocks past ``carry_rows``."""
        tables = self._tables.get(request_id)
        if shared is not None and tables is not None:
            raise ValueError(f"request {request_id} already has blocks; shared ones start a table")
        per_plane = -(-num_tokens // self.block_size)
        if carry_rows and (tables is not None or shared is not None):
            raise ValueError(f"request {request_id}: carry_rows starts a table of its own")
        if carry_rows % self.block_size or not 0 <= carry_rows <= per_plane * self.block_size:
            raise ValueError(
                f"carry_rows={carry_rows} must be a multiple of block_size={self.block_size} "
                f"within the request's {num_tokens} tokens"
            )
        have = len(tables.planes[0]) if tables is not None else len((shared or [[]])[0])
        missing = max(0, per_plane - have) * self.num_depths
        promise = 0
        if carry_rows:
            promise = self.blocks_needed(num_tokens, carry_rows) - per_plane
            missing = per_plane
        if missing + promise > self.free_blocks:
            raise OutOfBlocksError(
                f"request {request_id} needs {missing + promise} more KV blocks for "
                f"{num_tokens} tokens ({self.num_depths} depth planes x block_size "
                f"{self.block_size}); {self.free_blocks} of {self.num_blocks} are free"
                + (f" ({self.promised_blocks} promised)" if self._promised else "")
            )
        if tables is None:
            planes = [list(plane) for plane in shared] if shared else None
            tables = _Tables(planes or [[] for _ in range(self.num_depths)])
            self.retain([b for plane in tables.planes for b in plane])
            self._tables[request_id] = tables
        for depth, plane in enumerate(tables.planes):
            while len(plane) < per_plane:
                plane.append(-1 if carry_rows and depth else self._free.pop())
                tables.cached = None
        if promise:
            self._promised[request_id] = promise
        tables.carry_rows = carry_rows
        tables.capacity_tokens = max(tables.capacity_tokens, per_plane * self.block_size)

    def carried_rows(self, request_id: int) -> int:
        """The ``carry_rows`` the request was reserved with (0: every plane its own)."""
        return self._tables[request_id].carry_rows

    def carried_through(self, request_id: int) -> int:
        """The deepest plane of the request that has all its blocks."""
        tables = self._tables[request_id]
        return tables.carried_through if tables.carry_rows else self.num_depths - 1

    def carry_plane(
        self, request_id: int, depth: int, rows: int, whole: bool = False, copy_rows: int = 0
    ) -> None:
        """Plane ``depth + 1`` of a prompt reserved with ``carry_rows`` takes over plane
        ``depth``'s blocks of its first ``rows`` rows (at most ``carry_rows``; the backend
        has stored them; the next loop overwrites the rows it recomputes and reads the
        others as inherited) that it does not hold yet. With ``whole`` (``rows`` then
        ``carry_rows``) it also takes fresh blocks past them, drawn from the promise, the
        ones holding positions below ``copy_rows`` (the prompt's) a copy of plane
        ``depth``'s; later positions are written before they are read."""
        tables = self._tables[request_id]
        source, target = tables.planes[depth], tables.planes[depth + 1]
        carried = rows // self.block_size
        if (
            tables.carried_through != depth
            or rows % self.block_size
            or not 0 <= rows <= tables.carry_rows
            or (whole and rows != tables.carry_rows)
        ):
            raise ValueError(
                f"request {request_id}: plane {depth + 1} cannot take rows [0, {rows}) of "
                f"plane {depth} (whole={whole}; carry_rows={tables.carry_rows}, block_size="
                f"{self.block_size}; planes through {tables.carried_through} have every block)"
            )
        start = tables.carried_blocks  # a carry extends the blocks taken so far
        if carried > start:
            target[start:carried] = source[start:carried]
            source[start:carried] = [-1] * (carried - start)
            tables.carried_blocks, tables.cached = carried, None
        if not whole:
            return
        tables.carried_blocks, tables.cached = 0, None
        tables.carried_through = depth + 1
        fresh = [self._free.pop() for _ in source[carried:]]
        if fresh:
            self._promised[request_id] -= len(fresh)
            if not self._promised[request_id]:
                del self._promised[request_id]
        target[carried:] = fresh
        copied = max(0, -(-copy_rows // self.block_size) - carried)
        if copied:
            device = self.key_pool.device
            src = to_device(torch.tensor(source[carried : carried + copied]), device)
            dst = to_device(torch.tensor(fresh[:copied]), device)
            self.key_pool[dst] = self.key_pool[src]
            self.value_pool[dst] = self.value_pool[src]

    def retain(self, blocks: list[int]) -> None:
        """One more holder for each block (a published prefix, a request sharing it)."""
        for block in blocks:
            self._holders[block] = self._holders.get(block, 1) + 1

    def holders(self, block: int) -> int:
        """How many hold ``block`` (requests, the prefix cache); 1 for an unshared one."""
        return self._holders.get(block, 1)

    def give_back(self, blocks: list[int]) -> None:
        """One holder fewer for each block; a block nobody holds goes back to the pool."""
        for block in blocks:
            holders = self._holders.get(block, 1) - 1
            if holders > 1:
                self._holders[block] = holders
            elif holders == 1:
                del self._holders[block]
            else:
                self._free.append(block)

    def release(self, request_id: int) -> None:
        self._promised.pop(request_id, None)
        tables = self._tables.pop(request_id, None)
        if tables is not None:
            for plane in tables.planes:
                self.give_back([b for b in reversed(plane) if b >= 0])

    def drop_prefix(self, request_id: int, num_tokens: int) -> int:
        """Return the blocks holding positions [0, num_tokens) on every plane to the pool
        (their table entries become -1: nothing may read them through this cache again).
        ``num_tokens`` must be a multiple of the block size; returns the table entries
        dropped (a block others still hold stays with them)."""
        if num_tokens % self.block_size:
            raise ValueError(
                f"num_tokens={num_tokens} is not a multiple of block_size={self.block_size}"
            )
        freed = 0
        for plane in self._tables[request_id].planes:
            for index in range(num_tokens // self.block_size):
                if plane[index] >= 0:
                    self.give_back([plane[index]])
                    plane[index] = -1
                    freed += 1
        self._tables[request_id].cached = None
        return freed

    def plane_rows(
        self, request_id: int, start: int, end: int, depths: range | None = None
    ) -> list[KVRows | None]:
        """Every plane's K and V for positions [start, end), ``start`` on a block boundary,
        in place in the pools: per depth its rows (no copy), None for a depth outside
        ``depths`` (None: every depth)."""
        if start % self.block_size:
            raise ValueError(f"start={start} is not a multiple of block_size={self.block_size}")
        first, last = start // self.block_size, -(-end // self.block_size)
        device = self.key_pool.device
        out = []
        for depth, plane in enumerate(self._tables[request_id].planes):
            if depths is not None and depth not in depths:
                out.append(None)
                continue
            if any(block < 0 for block in plane[first:last]):  # checked on the host list
                raise ValueError(f"positions [{start}, {end}) of request {request_id} were freed")
            blocks = to_device(torch.tensor(plane[first:last], dtype=torch.long), device)
            out.append(KVRows.paged(self.key_pool, self.value_pool, blocks, end - start))
        return out

    def has(self, request_id: int) -> bool:
        return request_id in self._tables

    # ------------------------------------------------------------ addressing
    def slots(self, request_id: int, depth: int, positions: list[int]) -> list[int]:
        """Flat slot (block * block_size + offset) of each position on one depth plane."""
        tables = self._tables[request_id]
        for position in positions:
            if not 0 <= position < tables.capacity_tokens:
                raise IndexError(
                    f"position {position} is outside request {request_id}'s reserved "
                    f"{tables.capacity_tokens} tokens"
                )
        plane = tables.planes[depth]
        blocks = [plane[p // self.block_size] for p in positions]
        if blocks and min(blocks) < 0:  # a freed or not yet carried block: never written
            raise ValueError(
                f"request {request_id} has no block for positions {positions[:4]}... on plane "
                f"{depth} (freed, or not yet carried to it)"
            )
        return [
            b * self.block_size + p % self.block_size
            for b, p in zip(blocks, positions, strict=True)
        ]

    def block_table(self, request_id: int, depth: int) -> list[int]:
        return list(self._tables[request_id].planes[depth])

    def table_blocks(self, request_id: int) -> int:
        """Blocks in each of the request's block tables (every plane has as many)."""
        return len(self._tables[request_id].planes[0])

    def table_tensor(self, request_id: int) -> torch.Tensor:
        """[depths, blocks] int32 on the host: every plane's block table (-1: freed).
        Read-only: the same tensor is returned until the tables change."""
        tables = self._tables[request_id]
        if tables.cached is None:
            tables.cached = torch.tensor(tables.planes, dtype=torch.int32).reshape(
                self.num_depths, -1
            )
        return tables.cached

    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Strided per-layer views [num_blocks, block_size, Hkv, D] of the pools."""
        return self.key_pool[:, layer], self.value_pool[:, layer]

    # ------------------------------------------------------------ writes
    def write(
        self,
        layer: int,
        slots: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        use_triton: bool | None = None,
    ) -> None:
        """Store k/v [R, Hkv, D] at flat slots [R] (int64, -1 = skip) of one layer
        (``use_triton`` as :func:`~flashloop_backend.host.layer_ops.write_kv`'s)."""
        key_view, value_view = self.layer_views(layer)
        scratch = self.num_blocks * self.block_size
        write_kv(key_view, value_view, slots, k, v, scratch, use_triton)

    def finalize_exit(self, request_id: int, position: int, exit_depth: int) -> None:
        """Copy-on-exit: planes deeper than ``exit_depth`` take that plane's K/V (all layers)."""
        self.finalize_exits(request_id, [position], exit_depth)

    def finalize_exits(self, request_id: int, positions: list[int], exit_depth: int) -> None:
        """:meth:`finalize_exit` for many positions of one request, one copy per depth."""
        if not positions:
            return
        planes = self._tables[request_id].planes
        device = self.key_pool.device
        where = torch.tensor(positions, dtype=torch.long)
        blocks, offsets = where // self.block_size, to_device(where % self.block_size, device)
        src = to_device(torch.tensor(planes[exit_depth], dtype=torch.long)[blocks], device)
        for depth in range(exit_depth + 1, self.num_depths):
            dst = torch.tensor(planes[depth], dtype=torch.long)[blocks]
            if bool((dst < 0).all()):  # a plane that carries these rows later copies them
                continue
            dst = to_device(dst, device)
            self.key_pool[dst, :, offsets] = self.key_pool[src, :, offsets]
            self.value_pool[dst, :, offsets] = self.value_pool[src, :, offsets]

    def bytes_per_token(self) -> int:
        """Steady KV bytes one token occupies across all layers and depth planes."""
        per_block = self.key_pool[0].numel() * self.key_pool.element_size() * 2  # K and V
        return per_block * self.num_depths // self.block_size
