"""Wrapper for the Triton sparse-correction kernel: validates, splits the selected keys
over programs from shapes only (no host sync), merges splits, applies the correction."""

from __future__ import annotations

import math

import torch

from flashloop_backend.kernels.triton.paged_decode import merge_splits, sm_count, split_buffers
from flashloop_backend.kernels.validate import correction_target

KEYS_PER_SPLIT_MIN = 64
PROGRAMS_PER_SM = 2


def selected_key_splits(
    rows: int, heads: int, bucket: int, device: torch.device, programs_per_sm: int = PROGRAMS_PER_SM
) -> tuple[int, int]:
    """(splits, keys per split) of a kernel over each (row, head)'s ``bucket`` selected
    keys: about ``programs_per_sm`` programs per SM, at least ``KEYS_PER_SPLIT_MIN`` keys
    per split."""
    want = max(1, math.ceil(programs_per_sm * sm_count(device) / max(1, rows * heads)))
    splits = max(1, min(want, math.ceil(bucket / KEYS_PER_SPLIT_MIN)))
    return splits, math.ceil(bucket / splits)


def sparse_correction_triton(
    q,
    key_cache,
    value_cache,
    block_tables,
    indices,
    mass,
    output,
    contribution,
    scale=None,
    base=None,
    serves=None,
):
    """O = O_ref - C_ref + m * softmax(q k_S^T * scale) v_S (the ``SparseCorrection`` contract).

    q [R, Hq, D]; key_cache/value_cache [NB, BS, Hkv, D] (unit stride on D); block_tables
    [R, MB] int32; indices [R, Hq, Kb] int32 absolute positions (-1 unused); mass [R, Hq];
    output, contribution [R, Hq, D] FP32. Returns [R, Hq, D] in q's dtype: ``base`` with
    the rows where ``serves`` holds written, when given (``correction_into_base``).
    """
    from flashloop_backend.kernels.triton.sparse_decode_jit import sparse_correction_split_kernel

    rows, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = key_cache.shape
    expected = {
        "indices": (rows, num_q_heads),
        "mass": (rows, num_q_heads),
        "output": (rows, num_q_heads, head_dim),
        "contribution": (rows, num_q_heads, head_dim),
    }
    for name, tensor in (
        ("indices", indices),
        ("mass", mass),
        ("output", output),
        ("contribution", contribution),
    ):
        if tuple(tensor.shape[: len(expected[name])]) != expected[name]:
            raise ValueError(
                f"{name} must start with shape {expected[name]}; got {tuple(tensor.shape)}"
            )
        if name != "indices" and tensor.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 (the reference state); got {tensor.dtype}")
    output, contribution = output.contiguous(), contribution.contiguous()
    if cache_dim != head_dim or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q [R, {num_q_heads}, {head_dim}] does not fit KV cache heads/dim "
            f"{num_kv_heads}/{cache_dim}"
        )
    if head_dim < 16 or head_dim & (head_dim - 1) or block_size & (block_size - 1):
        raise ValueError(
            f"head_dim={head_dim} (power of two >= 16) and block_size={block_size} "
            "(power of two) required"
        )
    if indices.dtype != torch.int32 or indices.stride(-1) != 1:
        indices = indices.to(torch.int32).contiguous()
    block_tables = block_tables.contiguous()
    out = correction_target(q, base, serves)
    if rows == 0:
        return out
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    bucket = indices.shape[-1]
    splits, keys_per_split = selected_key_splits(rows, num_q_heads, bucket, q.device)
    part_out, part_max, part_sum = split_buffers(rows, num_q_heads, splits, head_dim, q.device)
    sparse_correction_split_kernel[(rows, num_q_heads, splits)](
        q,
        key_cache,
        value_cache,
        block_tables,
        indices,
        part_out,
        part_max,
        part_sum,
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
        indices.stride(0),
        indices.stride(1),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_max.stride(0),
        part_max.stride(1),
        keys_per_split,
        bucket,
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_K=64,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )
    correction = (output, contribution, mass)
    return merge_splits(part_out, part_max, part_sum, out, correction=correction, serves=serves)
