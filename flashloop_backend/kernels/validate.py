"""Input checks shared by kernel wrappers: say what was expected, never launch on bad input."""

from __future__ import annotations

import torch


def check_paged_inputs(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
) -> tuple[int, int, int]:
    """Validate the paged-attention call surface; return (rows, query heads, head dim)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [rows, heads, head_dim]; got shape {tuple(q.shape)}")
    rows, num_q_heads, head_dim = q.shape
    if key_cache.dim() != 4:
        raise ValueError(
            "key_cache must be [num_blocks, block_size, kv_heads, head_dim]; "
            f"got shape {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache shape {tuple(value_cache.shape)} != key_cache shape "
            f"{tuple(key_cache.shape)}"
        )
    num_kv_heads, cache_head_dim = key_cache.shape[2], key_cache.shape[3]
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim={head_dim} but the KV cache has head_dim={cache_head_dim}")
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"query heads ({num_q_heads}) must be a positive multiple of KV heads ({num_kv_heads})"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != rows:
        raise ValueError(
            f"block_tables must be [rows={rows}, max_blocks]; got shape {tuple(block_tables.shape)}"
        )
    if block_tables.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"block_tables must be int32 or int64; got {block_tables.dtype}")
    if context_lengths.shape != (rows,):
        raise ValueError(
            f"context_lengths must be [rows={rows}]; got shape {tuple(context_lengths.shape)}"
        )
    if context_lengths.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"context_lengths must be int32 or int64; got {context_lengths.dtype}")
    devices = {t.device for t in (q, key_cache, value_cache, block_tables, context_lengths)}
    if len(devices) != 1:
        raise ValueError(f"all inputs must be on one device; got {sorted(map(str, devices))}")
    if key_cache.dtype != q.dtype or value_cache.dtype != q.dtype:
        raise ValueError(
            f"q dtype {q.dtype} must match KV cache dtypes {key_cache.dtype}/{value_cache.dtype}"
        )
    return rows, num_q_heads, head_dim


def check_triton_paged(q, key_cache, value_cache, block_tables, context_lengths):
    """:func:`check_paged_inputs` plus what Triton paged kernels need: a power-of-two head
    dim >= 16 and unit stride on it. Returns (rows, query heads, head dim, block tables
    with unit stride on their last axis)."""
    rows, num_q_heads, head_dim = check_paged_inputs(
        q, key_cache, value_cache, block_tables, context_lengths
    )
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim={head_dim} must be a power of two >= 16 for the triton kernel")
    for name, t in (("q", q), ("key_cache", key_cache), ("value_cache", value_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride on head_dim; got strides {t.stride()}")
    if block_tables.stride(-1) != 1:  # rows may share one table through a zero row stride
        block_tables = block_tables.contiguous()
    return rows, num_q_heads, head_dim, block_tables


def check_unit_last_stride(needer: str, **buffers: torch.Tensor) -> None:
    """Each of ``buffers`` (by name) has unit stride on its last axis, as ``needer`` reads
    or writes its rows."""
    for name, t in buffers.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{needer} needs {name} with a contiguous last dim")


def tensor_versions(*tensors: torch.Tensor) -> tuple[int, ...] | None:
    """The tensors' version counters, for plans reused while their inputs are the very
    tensors planned and unmodified; None for inference tensors, which keep none."""
    if any(t.is_inference() for t in tensors):
        return None
    return tuple(t._version for t in tensors)


def correction_target(
    q: torch.Tensor, base: torch.Tensor | None, serves: torch.Tensor | None
) -> torch.Tensor:
    """Where a correction merges into: ``base`` [R, Hq, D] (q's shape and dtype,
    contiguous; written in place at the rows where ``serves`` [R] bool holds) or a new
    tensor like ``q``."""
    check_paired(base, serves)
    if base is None:
        return torch.empty_like(q)
    if base.shape != q.shape or base.dtype != q.dtype or not base.is_contiguous():
        raise ValueError(
            f"base must be contiguous {tuple(q.shape)} {q.dtype} like q; got "
            f"{tuple(base.shape)} {base.dtype} (contiguous: {base.is_contiguous()})"
        )
    check_serves(serves, q.shape[0])
    return base


def check_serves(serves: torch.Tensor, rows: int) -> None:
    """``serves`` must be [rows] bool: the rows a merge writes."""
    if serves.dtype != torch.bool or serves.shape != (rows,):
        raise ValueError(f"serves must be [{rows}] bool; got {tuple(serves.shape)} {serves.dtype}")


def check_paired(base: torch.Tensor | None, serves: torch.Tensor | None) -> None:
    """A correction writes into ``base`` only at the rows ``serves`` names: both or neither."""
    if (base is None) != (serves is None):
        raise ValueError("base and serves go together: give both or neither")
