"""Wrapper of the CUDA level writer (``encode_level.cu``): the ``packed_kv_write`` contract
(``kv.codec.LevelWriter``), one launch per written level over (page, layer, KV head), the
pages bit for bit those of the torch chain and of the Triton level writer."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from flashloop_backend.kernels.cuda import loader
from flashloop_backend.kernels.triton.encode import plan_level_writes
from flashloop_backend.kv.rows import KVRows
from flashloop_backend.kv.store import PackedKVStore

GROUPS = (32, 64, 128)


@dataclass(frozen=True)
class LevelWriterTuning:
    """Launch of the CUDA level writer: ``rows_per_thread`` (each thread owns one code word
    of that many rows, so a CTA has 16 x group / rows threads) and ``min_ctas`` (CTAs per
    SM the registers must allow; a CTA of 1,024 threads is held to one, where two would cap
    it at 32 registers and spill). The default is the launch measured fastest
    (``scripts/profile_conversion.py --cuda-launches``, results/README.md)."""

    rows_per_thread: int = 4
    min_ctas: int = 1


DEFAULT_LEVEL_WRITER = LevelWriterTuning()


class _Params(ctypes.Structure):
    # the C layout of Params in encode_level.cu
    _fields_ = [
        *((name, ctypes.c_void_p) for name in "k v blocks rows slots pages store".split()),
        *((name, ctypes.c_int64) for name in "x_block x_row x_layer x_head".split()),
        ("page_bytes", ctypes.c_int64),
        ("layer_bytes", ctypes.c_int64),
        *((name, ctypes.c_int) for name in "level block_rows slot_level page_level".split()),
    ]


def unsupported(store: PackedKVStore, dtype: torch.dtype) -> str | None:
    """Why this writer cannot write ``store``'s pages from rows of ``dtype`` (None: it can)."""
    if dtype != torch.bfloat16:
        return f"K/V must be bfloat16 (got {dtype})"
    if store.shape[2] != 128:
        return f"head_dim={store.shape[2]} (the CUDA level writer writes head_dim 128)"
    if store.group_size not in GROUPS:
        return f"group_size={store.group_size} (the CUDA level writer writes {GROUPS})"
    return None


def encode_levels_cuda(
    store: PackedKVStore,
    rows_by_depth: list[KVRows | None],
    presents: list[torch.Tensor | None],
    pages: list[list[int]],
    tuning: LevelWriterTuning = DEFAULT_LEVEL_WRITER,
) -> None:
    """The ``LevelWriter`` contract: ``rows_by_depth`` per depth its T rows of K and V (read
    in place), None for a level already stored (read from its pages) or not written;
    ``presents`` per depth the compact level's rows [Nd] (None: dense); ``pages`` per depth
    its page ids. Levels are written in order: each reads the ones before."""
    given = {depth: r for depth, r in enumerate(rows_by_depth) if r is not None}
    if not given:
        return
    dtypes = {x.dtype for r in given.values() for x in (r.keys, r.values)}
    reason = unsupported(store, next((d for d in dtypes if d != torch.bfloat16), torch.bfloat16))
    if reason is not None:
        raise ValueError(f"encode_levels_cuda: {reason}")
    for depth, rows in given.items():  # the kernel reads channel pairs as 4-byte words
        k, v = rows.keys, rows.values
        if any(x.data_ptr() % 4 or x.storage_offset() % 2 for x in (k, v)) or any(
            stride % 2 for stride in k.stride()[:-1]
        ):
            raise ValueError(
                f"depth {depth}: K/V must start at an even element with even strides; "
                f"got offsets {k.storage_offset()}, {v.storage_offset()} and strides {k.stride()}"
            )
    if tuning.rows_per_thread not in (1, 2, 4) or tuning.min_ctas < 1:
        raise ValueError(
            f"rows_per_thread={tuning.rows_per_thread} must be 1, 2 or 4 and "
            f"min_ctas={tuning.min_ctas} at least 1"
        )
    slots, table, launches = plan_level_writes(store, rows_by_depth, presents, pages)
    if not launches:
        return
    num_layers, kv_heads, _ = store.shape
    group = store.group_size
    threads = 16 * group // tuning.rows_per_thread
    if threads > 1024:
        raise ValueError(
            f"group_size={group} at rows_per_thread={tuning.rows_per_thread} needs {threads} "
            "threads a CTA (at most 1024)"
        )
    defines = {
        "HEAD_DIM": 128,
        "GROUP": group,
        "ROWS": tuning.rows_per_thread,
        "MIN_CTAS": 1 if threads == 1024 else tuning.min_ctas,
    }
    kernel = loader.build_file("encode_level", defines)
    blocks = store.blocks
    for launch in launches:
        source = launch.source
        row_blocks = source.blocks.contiguous()  # read by index: unit stride
        k, v = source.keys, source.values
        params = _Params(
            *(k.data_ptr(), v.data_ptr(), row_blocks.data_ptr(), launch.rows.data_ptr()),
            *(slots.data_ptr(), table.data_ptr(), blocks.data_ptr()),
            *(k.stride(0), k.stride(2), k.stride(1), k.stride(3)),
            *(blocks.stride(0), blocks.stride(1)),
            *(launch.depth, source.block_size, slots.stride(0), table.stride(0)),
        )
        kernel((launch.pages, num_layers, kv_heads), (threads, 1, 1), [params])
