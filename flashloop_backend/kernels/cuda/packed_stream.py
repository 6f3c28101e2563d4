"""Wrapper of the CUDA streaming packed reader (``packed_stream.cu``): the
``packed_decode`` contract for BF16 queries and caches, head_dim 128, dense levels. Splits
come from shapes only; the Triton merge combines them. Rows whose metadata may hold
compact levels (token-sparse depths) take the Triton reader, which reads them."""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import torch

from flashloop_backend.kernels.cuda import loader
from flashloop_backend.kernels.triton.packed_decode import (
    check_packed_inputs,
    packed_decode_triton,
    stream_splits,
)
from flashloop_backend.kernels.triton.paged_decode import merge_splits, split_buffers
from flashloop_backend.kernels.validate import check_paged_inputs
from flashloop_backend.kv.levels import LevelMetadata
from flashloop_backend.kv.store import PackedKVStore


@dataclass(frozen=True)
class StreamTuning:
    """Launch of the streaming reader: about ``ctas_per_sm`` CTAs per SM over the rows'
    heads and splits; ``warps`` per CTA and ``stages`` ring buffers per warp, each a
    group's blocks at every level read (shared memory: warps x stages x levels x block
    bytes); None: by level count (``launch_shape``: 4 warps, two stages for one level,
    one from two levels, the fastest at 32K x 16 on the H200, results/README.md);
    ``split_copy``: with one stage, each group's blocks are copied in a K half and a V
    half, the next group's K half issued once this group's is read; None: from three
    levels (``copies_in_halves``; results/README.md, "ninth session"); ``level_chunk``:
    with one stage, each group's copy goes in units of that many levels' K or V half
    through a ring of ``ring_units`` units per warp (a warp holds a few units, not every
    level of a group, so two CTAs fit an SM at four levels); None: at four levels with
    ``split_copy`` unset, units of one level in a ring of three (``chunk_levels``; the
    fastest at 32K x 16 on the H100, results/README.md, "Eleventh session"); 0: never.
    ``whole_waves``: the split count fitted to the CTAs an SM holds (``wave_splits``: fewer
    splits where a last wave of a few CTAs would cost a tenth more)."""

    ctas_per_sm: float = 2
    warps: int | None = None
    stages: int | None = None
    split_copy: bool | None = None
    level_chunk: int | None = None
    ring_units: int = 3
    whole_waves: bool = True


DEFAULT_STREAM = StreamTuning()


INT_FIELDS = (
    *("q_row", "q_head", "t_row", "t_level", "kind_row"),
    *("k_block", "k_slot", "k_head", "v_block", "v_slot", "v_head", "bt_row"),
    *("o_row", "o_head", "o_split", "s_row", "s_head"),
    *("groups_per_split", "group_q", "block_size"),
)


class _Params(ctypes.Structure):
    # the C layout of Params in packed_stream.cu
    _fields_ = [
        ("q", ctypes.c_void_p),
        ("blocks", ctypes.c_void_p),
        ("page_bytes", ctypes.c_int64),
        ("tables", ctypes.c_void_p),
        ("kinds", ctypes.c_void_p),
        ("packed", ctypes.c_void_p),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("lengths", ctypes.c_void_p),
        ("part_out", ctypes.c_void_p),
        ("part_max", ctypes.c_void_p),
        ("part_sum", ctypes.c_void_p),
        ("scale", ctypes.c_float),
        *((name, ctypes.c_int) for name in INT_FIELDS),
    ]


def launch_shape(levels: int, tuning: StreamTuning) -> tuple[int, int]:
    """(warps per CTA, ring stages per warp) of a read of ``levels`` levels."""
    warps = tuning.warps or 4
    stages = tuning.stages or (2 if levels == 1 else 1)
    return warps, stages


def copies_in_halves(levels: int, tuning: StreamTuning) -> bool:
    """Whether a read of ``levels`` levels copies each group in a K and a V half (one
    stage only, not in level units)."""
    _, stages = launch_shape(levels, tuning)
    split = levels >= 3 if tuning.split_copy is None else tuning.split_copy
    return split and stages == 1 and not chunk_levels(levels, tuning)


def chunk_levels(levels: int, tuning: StreamTuning) -> int:
    """Levels per copy unit of a read of ``levels`` levels (0: whole blocks or halves)."""
    _, stages = launch_shape(levels, tuning)
    # an explicit split_copy asks for halves or whole blocks: units only when it is unset
    default = 1 if levels == 4 and stages == 1 and tuning.split_copy is None else 0
    chunk = default if tuning.level_chunk is None else tuning.level_chunk
    if chunk < 0:
        raise ValueError(f"level_chunk={chunk}: levels per copy unit are 0 (no units) or more")
    if chunk and (stages != 1 or levels % chunk):
        raise ValueError(
            f"level_chunk={chunk} needs one ring stage (got {stages}) and divides the "
            f"levels read ({levels})"
        )
    if chunk and not 2 <= tuning.ring_units <= 2 * levels // chunk + 1:
        raise ValueError(
            f"ring_units={tuning.ring_units}: 2 to {2 * levels // chunk + 1} at "
            f"{levels} levels in units of {chunk}"
        )
    return chunk


def shared_bytes(levels: int, group: int, head_dim: int, tuning: StreamTuning) -> int:
    warps, stages = launch_shape(levels, tuning)
    chunk = chunk_levels(levels, tuning)
    half = (head_dim * (group + 8)) // 2  # one level's K or V half: codes and parameters
    ring = tuning.ring_units * chunk * half if chunk else stages * levels * 2 * half
    return warps * ring + warps * (head_dim + 2) * 4


def _kernel(levels: int, group: int, head_dim: int, tuning: StreamTuning) -> loader.CudaKernel:
    warps, stages = launch_shape(levels, tuning)
    defines = {
        "HEAD_DIM": head_dim,
        "GROUP": group,
        "LEVELS": levels,
        "WARPS": warps,
        "STAGES": stages,
        "SPLIT_COPY": int(copies_in_halves(levels, tuning)),
    }
    chunk = chunk_levels(levels, tuning)
    if chunk:  # a ring size without units would only build the same kernel again
        defines |= {"LEVEL_CHUNK": chunk, "RING_UNITS": tuning.ring_units}
    shared = shared_bytes(levels, group, head_dim, tuning)
    return loader.build_file("packed_stream", defines, shared)


def unsupported(q, store: PackedKVStore, key_cache) -> str | None:
    """Why this reader cannot serve these inputs (None: it can)."""
    if q.dtype != torch.bfloat16 or key_cache.dtype != torch.bfloat16:
        return f"q and caches must be bfloat16 (got {q.dtype}, {key_cache.dtype})"
    if q.shape[-1] != 128:
        return f"head_dim={q.shape[-1]} (the CUDA reader reads head_dim 128)"
    if store.group_size not in (32, 64, 128):
        return f"group_size={store.group_size} (the CUDA reader reads 32, 64, 128)"
    return None


def packed_decode_cuda(
    q,
    store: PackedKVStore,
    layer: int,
    meta: LevelMetadata,
    key_cache,
    value_cache,
    block_tables,
    context_lengths,
    scale: float | None = None,
    few_rows: bool = False,
    tuning: StreamTuning = DEFAULT_STREAM,
) -> torch.Tensor:
    """The ``PackedDecode`` contract (q [R, Hq, D] -> [R, Hq, D] in q's dtype), read by the
    CUDA streaming kernel; ``few_rows``: one CTA per (row, head)."""
    rows, num_q_heads, head_dim = check_paged_inputs(
        q, key_cache, value_cache, block_tables, context_lengths
    )
    check_packed_inputs(q, store, meta, key_cache)
    levels = meta.tables.shape[1]
    reason = unsupported(q, store, key_cache)
    if reason is not None:
        raise ValueError(f"packed_decode_cuda: {reason}")
    if meta.compact_from < levels:  # the Triton reader reads compact levels
        return packed_decode_triton(
            q,
            store,
            layer,
            meta,
            key_cache,
            value_cache,
            block_tables,
            context_lengths,
            scale,
            few_rows=few_rows,
        )
    out = torch.empty_like(q)
    if rows == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    _, block_size, num_kv_heads, _ = key_cache.shape
    g = store.group_size
    per_sm = 0 if few_rows else tuning.ctas_per_sm
    warps, _ = launch_shape(levels, tuning)
    kernel = _kernel(levels, g, head_dim, tuning)
    shared = shared_bytes(levels, g, head_dim, tuning)
    resident = kernel.resident_ctas(warps * 32, shared) if tuning.whole_waves else None
    splits, per_split = stream_splits(
        q, store, meta, block_tables, block_size, None, per_sm, resident, warps
    )
    part_out, part_max, part_sum = split_buffers(rows, num_q_heads, splits, head_dim, q.device)
    codes = store.blocks[:, layer]
    block_tables = block_tables.contiguous()
    q = q if q.stride(-1) == 1 else q.contiguous()
    pointer = lambda t: t.data_ptr()  # noqa: E731
    params = _Params(
        pointer(q),
        pointer(codes),
        codes.stride(0),
        pointer(meta.tables),
        pointer(meta.kinds),
        pointer(meta.packed_lengths),
        pointer(key_cache),
        pointer(value_cache),
        pointer(block_tables),
        pointer(context_lengths),
        pointer(part_out),
        pointer(part_max),
        pointer(part_sum),
        scale,
        q.stride(0),
        q.stride(1),
        meta.tables.stride(0),
        meta.tables.stride(1),
        meta.kinds.stride(0),
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
        per_split,
        num_q_heads // num_kv_heads,
        block_size,
    )
    kernel((splits, num_q_heads, rows), (warps * 32, 1, 1), [params], shared)
    return merge_splits(part_out, part_max, part_sum, out)
