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
    exact = device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
    codes, halves = store.blocks, store.blocks.view(torch.float16)
    for depth, present in enumerate(presents):
        if not pages[depth] or rows_by_depth[depth] is None:  # none, or read only
            continue
        source = rows_by_depth[depth]
        k, v = source.keys, source.values
        level_rows = _level_rows(present, rows, len(pages[depth]), g, device)
        encode_level_kernel[(len(pages[depth]), num_layers, kv_heads)](
            k,
            v,
            source.blocks,
            level_rows,
            slots,
            table,
            codes,
            halves,
            depth,
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
            GROUP=g,
            EXACT=exact,
            num_warps=tuning.num_warps,
            **({} if tuning.max_registers is None else {"maxnreg": tuning.max_registers}),
        )
