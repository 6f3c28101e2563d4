"""The packed append in one kernel per level (``packed_kv_write``, the ``LevelWriter``
contract of ``kv.store``): every (page, layer, KV head) of a level reads its rows where
they are (the host's paged pools in place), reconstructs them from the levels already
written, quantizes the residual and writes the page, bit for bit what
``encode_levels_chain`` writes, without its gathered copies, FP32 history and re-layouts."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from flashloop_backend.device_copy import to_device
from flashloop_backend.kv.rows import KVRows
from flashloop_backend.kv.store import PackedKVStore


@dataclass(frozen=True)
class EncodeTuning:
    """Launch of the level writer (one program per page, layer and KV head):
    ``num_warps``, and ``max_registers`` per thread (None: no cap; ptxas spills past it).
    The default is the launch measured on the H200 (results/README.md, "Packed conversion
    in one kernel per level"; ``scripts/profile_conversion.py --encode-launches`` times
    launches)."""

    num_warps: int = 16
    max_registers: int | None = None


DEFAULT_ENCODE = EncodeTuning()


def _level_rows(
    present: torch.Tensor | None, rows: int, pages: int, group: int, device
) -> torch.Tensor:
    """int32 [pages * group]: the append's row in each slot of a level's pages; a compact
    level's last page repeats its last row, as the chain pads it."""
    if present is None:
        return torch.arange(rows, dtype=torch.int32, device=device)
    fill = torch.arange(pages * group, device=device).clamp(max=present.numel() - 1)
    return present[fill].to(torch.int32)


@dataclass(frozen=True)
class LevelLaunch:
    """One level a writer launches: its depth, the rows it reads (``KVRows``, in place),
    the append's row in each slot of its pages ([pages * G] int32) and its page count."""

    depth: int
    source: KVRows
    rows: torch.Tensor
    pages: int


def plan_level_writes(
    store: PackedKVStore,
    rows_by_depth: list[KVRows],
    presents: list[torch.Tensor | None],
    pages: list[list[int]],
) -> tuple[torch.Tensor, torch.Tensor, list[LevelLaunch]]:
    """The level writers' shared plan of one append (the ``packed_kv_write`` contract):
    (slots [Lv, T] int32, a row's slot in each level's pages, -1 where absent; the page
    table [Lv, P] int32 on the store's device; the levels to write, in order). Checks
    every written depth's rows against the store's shape and device."""
    g = store.group_size
    num_layers, kv_heads, head_dim = store.shape
    if g < 16 or g & (g - 1) or head_dim & (head_dim - 1):
        raise ValueError(
            f"group_size={g} and head_dim={head_dim} must be powers of two, the group >= 16 "
            "(Triton tiles)"
        )
    rows = next(r for r in rows_by_depth if r is not None).count
    device = store.blocks.device
    for depth, depth_rows in enumerate(rows_by_depth):
        if depth_rows is None:
            continue
        if depth_rows.device != device:
            raise ValueError(f"depth {depth}: K/V on {depth_rows.device}, the store on {device}")
        if depth_rows.shape != (rows, num_layers, kv_heads, head_dim):
            raise ValueError(
                f"depth {depth}: K/V must be [{rows}, {num_layers}, {kv_heads}, {head_dim}]; "
                f"got {list(depth_rows.shape)}"
            )
    depths = len(rows_by_depth)
    slots = torch.full((depths, rows), -1, dtype=torch.int32, device=device)
    table = torch.full((depths, max(1, *map(len, pages))), -1, dtype=torch.int32)
    for depth, present in enumerate(presents):
        count = rows if present is None else present.numel()
        where = slice(None) if present is None else present
        slots[depth, where] = torch.arange(count, dtype=torch.int32, device=device)
        if pages[depth]:
            table[depth, : len(pages[depth])] = torch.tensor(pages[depth], dtype=torch.int32)
    table = to_device(table, device)  # built on the host: no wait for the queued steps
    launches = [
        LevelLaunch(
            depth,
            rows_by_depth[depth],
            _level_rows(present, rows, len(pages[depth]), g, device),
            len(pages[depth]),
        )
        for depth, present in enumerate(presents)
        if pages[depth] and rows_by_depth[depth] is not None  # else none, or read only
    ]
    return slots, table, launches


def encode_levels_triton(
    store: PackedKVStore,
    rows_by_depth: list[KVRows],
    presents: list[torch.Tensor | None],
    pages: list[list[int]],
    tuning: EncodeTuning = DEFAULT_ENCODE,
) -> None:
    """rows_by_depth per depth its T rows of K and V (read in place), None for a level
    already stored (read from its pages) or not written; presents per depth the compact
    level's rows [Nd] (None: dense); pages per depth its page ids. Levels are written in
    order: each reads the ones before."""
    from flashloop_backend.kernels.triton.encode_jit import encode_level_kernel

    num_layers, kv_heads, head_dim = store.shape
    slots, table, launches = plan_level_writes(store, rows_by_depth, presents, pages)
    device = store.blocks.device
    exact = device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
    codes, halves = store.blocks, store.blocks.view(torch.float16)
    for launch in launches:
        source = launch.source
        k, v = source.keys, source.values
        encode_level_kernel[(launch.pages, num_layers, kv_heads)](
            k,
            v,
            source.blocks,
            launch.rows,
            slots,
            table,
            codes,
            halves,
            launch.depth,
            source.block_size,
            slots.stride(0),
            table.stride(0),
            k.stride(0),
            k.stride(2),
            k.stride(1),
            k.stride(3),
            codes.stride(0),
            codes.stride(1),
            HEAD_DIM=head_dim,
            GROUP=store.group_size,
            EXACT=exact,
            num_warps=tuning.num_warps,
            **({} if tuning.max_registers is None else {"maxnreg": tuning.max_registers}),
        )
