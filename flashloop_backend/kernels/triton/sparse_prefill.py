"""Wrapper for tiled prefill attention over nonconsecutive queries (the ``PagedAttention``
contract, served for ``sparse_prefill``): rows that share a block table are cut into tiles
of BLOCK_M on the device (no host sync), each tile runs flash attention over its table."""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch

from flashloop_backend.kernels.triton.paged_decode import merge_splits, sm_count, split_buffers
from flashloop_backend.kernels.validate import check_triton_paged, tensor_versions


@dataclass(frozen=True)
class PrefillTuning:
    """Launch shape: the best of the 32K sweep (``scripts/sweep_sparse_prefill.py``,
    results/README.md); ``max_registers`` caps registers per thread (ptxas spills past
    it; None: no cap), so that two CTAs can share an SM. A launch of few tiles splits each
    tile's keys (at least ``min_keys_per_split`` a split) into as many splits as keep it
    within ``programs_per_sm`` programs per SM (:func:`key_splits`)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 2
    min_keys_per_split: int = 256
    programs_per_sm: int = 2
    max_registers: int | None = 128


DEFAULT_PREFILL = PrefillTuning()


def key_splits(tiles: int, heads: int, span: int, sms: int, tuning: PrefillTuning) -> int:
    """Key splits of a launch of ``tiles`` x ``heads`` programs over keys spanning ``span``
    positions: the most that keep it within one wave of ``programs_per_sm`` programs per SM
    (a launch that fills the wave unsplit is not split: a second wave and the merge cost
    more than they save), each split at least ``min_keys_per_split`` keys."""
    fit = tuning.programs_per_sm * sms // max(1, tiles * heads)
    return max(1, min(fit, math.ceil(span / tuning.min_keys_per_split)))


def tile_starts(block_tables: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([R + 1] int32 first row of each tile, then R for every unused tile; [1] int32 tile
    count), both on the device.

    Consecutive rows with identical block-table rows form a segment; a tile starts at
    every segment start and every ``block_m`` rows inside a segment."""
    rows = block_tables.shape[0]
    device = block_tables.device
    index = torch.arange(rows, device=device)
    new_segment = torch.ones(rows, dtype=torch.bool, device=device)
    if rows > 1:
        new_segment[1:] = (block_tables[1:] != block_tables[:-1]).any(dim=1)
    segment_first = torch.cummax(torch.where(new_segment, index, 0), 0).values
    starts_tile = (index - segment_first) % block_m == 0
    tile_of_row = torch.cumsum(starts_tile.int(), 0) - 1
    starts = torch.full((rows + 2,), rows, dtype=torch.int32, device=device)
    dump = torch.full_like(tile_of_row, rows + 1)
    starts.index_put_((torch.where(starts_tile, tile_of_row, dump),), index.int())
    return starts[: rows + 1], starts_tile.sum(dtype=torch.int32).reshape(1)


# The tile starts of the last block tables planned: every layer of a traversal passes the
# same, unmodified tensor, which is planned once instead of at every layer. The tensor is
# held by a weak reference (a step's tables must not outlive it) and matched by identity
# and version; inference tensors keep no version, so they are planned every call.
_LAST_TILES: list = []


def planned_tile_starts(
    block_tables: torch.Tensor, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tile_starts`, reused while ``block_tables`` is the very tensor planned last
    and unmodified since."""
    versions = tensor_versions(block_tables)
    if versions is None:
        return tile_starts(block_tables, block_m)
    if _LAST_TILES:
        tables, planned_versions, planned_m, plan = _LAST_TILES[0]
        same = tables() is block_tables and planned_versions == versions
        if same and planned_m == block_m:
            return plan
    plan = tile_starts(block_tables, block_m)
    _LAST_TILES[:] = [(weakref.ref(block_tables), versions, block_m, plan)]
    return plan


def sparse_prefill_triton(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    scale: float | None = None,
    tuning: PrefillTuning = DEFAULT_PREFILL,
) -> torch.Tensor:
    """Per-row causal paged attention for query rows at arbitrary absolute positions.

    q [R, Hq, D]; key_cache/value_cache [NB, BS, Hkv, D] (unit stride on D); block_tables
    [R, MB] int32; context_lengths [R] int32 (position + 1; 0 = padding, output zeros).
    Rows of one sequence should be consecutive (they then share tiles); any order is
    correct. Returns [R, Hq, D] in q's dtype."""
    from flashloop_backend.kernels.triton.sparse_prefill_jit import sparse_prefill_kernel

    rows, num_q_heads, head_dim, block_tables = check_triton_paged(
        q, key_cache, value_cache, block_tables, context_lengths
    )
    _, block_size, num_kv_heads, _ = key_cache.shape
    out = torch.empty_like(q)
    if rows == 0:
        return out
    starts, num_tiles = planned_tile_starts(block_tables, tuning.block_m)
    # one program per tile of a single segment; tiles added by segment starts are taken
    # in turn by the same programs (the tile count is only known on the device). Few
    # tiles (a chunk of sparse rows) split their keys over the slots one wave leaves.
    programs = math.ceil(rows / tuning.block_m)
    span = block_tables.shape[1] * block_size
    splits = key_splits(programs, num_q_heads, span, sm_count(q.device), tuning)
    # one split writes its output itself; several leave partial states for merge_splits
    direct = splits == 1
    part_out, part_max, part_sum = split_buffers(
        0 if direct else rows, num_q_heads, splits, head_dim, q.device
    )
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    sparse_prefill_kernel[(programs, num_q_heads, splits)](
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lengths,
        starts,
        num_tiles,
        part_out,
        part_max,
        part_sum,
        out,
        scale,
        q.stride(0),
        q.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_max.stride(0),
        part_max.stride(1),
        out.stride(0),
        out.stride(1),
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=tuning.block_m,
        BLOCK_N=tuning.block_n,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DIRECT=direct,
        num_warps=tuning.num_warps,
        num_stages=tuning.num_stages,
        **({} if tuning.max_registers is None else {"maxnreg": tuning.max_registers}),
    )
    return out if direct else merge_splits(part_out, part_max, part_sum, out)
