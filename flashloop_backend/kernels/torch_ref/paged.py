"""Torch reference kernels: the oracle every other implementation is tested against.

Written for clarity, not speed; runs on CPU and GPU; FP32 softmax and accumulation.
No host synchronisation: shapes come from tensor sizes, never from tensor values, except
in ``paged_prefill`` on the CPU, where rows that share a block table (a prompt's rows)
gather its pages once.
"""

from __future__ import annotations

import math

import torch

from flashloop_backend.kernels.validate import check_paged_inputs

CHUNK_ELEMENTS = 4 * 1024 * 1024  # gathered K elements per chunk of rows (16 MiB in FP32)


def _visible_softmax(scores, context_lengths):
    """Softmax of scores [R, Hkv, G, T] over each row's first ``context_lengths`` [R] keys,
    in FP32; a row with no visible key gets zeros (softmax over all -inf would give NaN)."""
    positions = torch.arange(scores.shape[-1], device=scores.device)
    visible = positions[None, :] < context_lengths.long()[:, None]  # [R, T]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.where(visible.any(dim=-1)[:, None, None, None], probs, torch.zeros_like(probs))


def _attend(q, keys, values, context_lengths, scale):
    """Rows q [R, Hq, D] against keys and values [R, T, Hkv, D] (each row its own) or
    [T, Hkv, D] (shared by every row), FP32: scores, the masked softmax, the weighted sum."""
    rows, num_q_heads, head_dim = q.shape
    num_kv_heads = keys.shape[-2]
    kv = "rtkd" if keys.dim() == 4 else "tkd"
    qf = q.float().reshape(rows, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
    scores = torch.einsum(f"rkgd,{kv}->rkgt", qf, keys) * scale
    probs = _visible_softmax(scores, context_lengths)
    out = torch.einsum(f"rkgt,{kv}->rkgd", probs, values)
    return out.reshape(rows, num_q_heads, head_dim)


def _rows(q, key_cache, value_cache, block_tables, context_lengths, scale):
    """The reference math for a few rows: gather each row's pages, mask, softmax in FP32."""
    rows, _, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    # Entries past a row's context may be -1 or stale: clamp to a legal id, then mask.
    tables = block_tables.long().clamp(0, num_blocks - 1)
    span = tables.shape[1] * block_size
    keys = key_cache[tables].reshape(rows, span, num_kv_heads, head_dim).float()
    values = value_cache[tables].reshape(rows, span, num_kv_heads, head_dim).float()
    return _attend(q, keys, values, context_lengths, scale)


def _rows_of_one_table(q, key_cache, value_cache, table, context_lengths, scale):
    """The same math for rows that share one block table [MB] (one sequence's rows): its
    pages are gathered once and every row's scores are one product with them."""
    head_dim = q.shape[-1]
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    pages = table.long().clamp(0, num_blocks - 1)
    span = pages.shape[0] * block_size
    keys = key_cache[pages].reshape(span, num_kv_heads, head_dim).float()
    values = value_cache[pages].reshape(span, num_kv_heads, head_dim).float()
    return _attend(q, keys, values, context_lengths, scale)


def _rows_by_table(q, key_cache, value_cache, block_tables, context_lengths, scale, chunk):
    """Rows grouped by their block table, each group's pages gathered once (the grouping
    reads the tables' values: on a GPU that would wait for the device, and in a captured
    graph it would fix one step's groups for every replay)."""
    tables, which = torch.unique(block_tables, dim=0, return_inverse=True)
    out = torch.empty(q.shape, dtype=torch.float32)
    for t in range(tables.shape[0]):
        rows = torch.nonzero(which == t).squeeze(1)
        for i in range(0, rows.numel(), chunk):
            mine = rows[i : i + chunk]
            out[mine] = _rows_of_one_table(
                q[mine], key_cache, value_cache, tables[t], context_lengths[mine], scale
            )
    return out


def paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Per-row causal paged attention (see :class:`~.ops.PagedAttention` for shapes)."""
    return _paged(q, key_cache, value_cache, block_tables, context_lengths, scale, False)


def paged_prefill(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """``paged_attention`` for prefill rows, the same math. On the CPU, rows that share a
    block table (a prompt's rows) gather its pages once; the grouping reads the tables'
    values, which a prefill step may (no graph captures one) and a decode step may not."""
    return _paged(q, key_cache, value_cache, block_tables, context_lengths, scale, True)


def _paged(q, key_cache, value_cache, block_tables, context_lengths, scale, by_table: bool):
    rows, num_q_heads, head_dim = check_paged_inputs(
        q, key_cache, value_cache, block_tables, context_lengths
    )
    block_size = key_cache.shape[1]
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if rows == 0:
        return q.new_empty((0, num_q_heads, head_dim))
    span = block_tables.shape[1] * block_size
    if by_table and q.device.type == "cpu":
        chunk = max(1, CHUNK_ELEMENTS // max(1, span * num_q_heads))  # rows of scores
        out = _rows_by_table(q, key_cache, value_cache, block_tables, context_lengths, scale, chunk)
        return out.to(q.dtype)
    # Rows are processed in chunks so the gathered per-row K/V copies stay small.
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
