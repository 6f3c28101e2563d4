"""Torch reference kernels: the oracle every other implementation is tested against.

Written for clarity, not speed; runs on CPU and GPU; FP32 softmax and accumulation.
No host synchronisation: shapes come from tensor sizes, never from tensor values.
"""

from __future__ import annotations

import math

import torch

from flashloop_backend.kernels.validate import check_paged_inputs

CHUNK_ELEMENTS = 4 * 1024 * 1024  # gathered K elements per chunk of rows (16 MiB in FP32)


def _rows(q, key_cache, value_cache, block_tables, context_lengths, scale):
    """The reference math for a few rows: gather each row's pages, mask, softmax in FP32."""
    rows, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    # Entries past a row's context may be -1 or stale: clamp to a legal id, then mask.
    tables = block_tables.long().clamp(0, num_blocks - 1)
    span = tables.shape[1] * block_size
    keys = key_cache[tables].reshape(rows, span, num_kv_heads, head_dim).float()
    values = value_cache[tables].reshape(rows, span, num_kv_heads, head_dim).float()
    group = num_q_heads // num_kv_heads
    qf = q.float().reshape(rows, num_kv_heads, group, head_dim)
    positions = torch.arange(span, device=q.device)
    visible = positions[None, :] < context_lengths.long()[:, None]  # [R, T]
    scores = torch.einsum("rkgd,rtkd->rkgt", qf, keys) * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Padding rows (no visible key) give NaN from softmax over all -inf: make them zero.
    probs = torch.where(visible.any(dim=-1)[:, None, None, None], probs, torch.zeros_like(probs))
    out = torch.einsum("rkgt,rtkd->rkgd", probs, values)
    return out.reshape(rows, num_q_heads, head_dim)


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Per-row causal paged attention (see :class:`~.ops.PagedAttention` for shapes)."""
    rows, num_q_heads, head_dim = check_paged_inputs(
        q, key_cache, value_cache, block_tables, context_lengths
    )
    block_size = key_cache.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if rows == 0:
        return q.new_empty((0, num_q_heads, head_dim))
    # Rows are processed in chunks so the gathered per-row K/V copies stay small.
    span = block_tables.shape[1] * block_size
    chunk = max(1, CHUNK_ELEMENTS // max(1, span * num_q_heads * head_dim))
    out = torch.cat(
        [
            _rows(
                q[i : i + chunk],
                key_cache,
                value_cache,
                block_tables[i : i + chunk],
                context_lengths[i : i + chunk],
                scale,
            )
            for i in range(0, rows, chunk)
        ]
    )
    return out.to(q.dtype)
