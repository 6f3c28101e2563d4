"""Torch reference kernels for sparse decode attention over paged KV (the oracle for the
Triton versions). Shapes: R rows, Hq query heads, Hkv KV heads, D head dim, T positions,
Kb selected-key bucket; paged inputs as in :class:`~.ops.PagedAttention`."""

from __future__ import annotations

import math

import torch

from flashloop_backend.algorithms import key_retention_fraction
from flashloop_backend.kernels.validate import check_paged_inputs, correction_target

CHUNK_ELEMENTS = 4 * 1024 * 1024


def selected_counts(context_lengths: torch.Tensor, key_retention: float) -> torch.Tensor:
    """[R] int64 K = max(1, ceil(key_retention * T)) per row of ``context_lengths`` [R]
    (``algorithms.selected_count``, integer arithmetic on ``key_retention_fraction``), 0
    for rows without context."""
    num, den = key_retention_fraction(key_retention)
    lengths = context_lengths.long()
    return torch.minimum((lengths * num + den - 1) // den, lengths).clamp(min=0)


def dense_source(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    key_retention: float,
    k_bucket: int,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """Loop-2 attention plus selection statistics for every row (the ``DenseSource``
    contract: paged inputs as :class:`~.ops.PagedAttention`, K = max(1,
    ceil(key_retention * T)) keys kept, ``k_bucket`` Kb >= K).

    Returns (out [R, Hq, D] q.dtype, indices [R, Hq, Kb] int32 absolute positions by
    descending probability (-1 past the row's K), mass [R, Hq], output [R, Hq, D] and
    contribution [R, Hq, D], all FP32). Ties go to the earlier position."""
    rows, num_q_heads, head_dim = check_paged_inputs(
        q, key_cache, value_cache, block_tables, context_lengths
    )
    span = block_tables.shape[1] * key_cache.shape[1]
    if rows and k_bucket < min(span, math.ceil(key_retention * span)):
        raise ValueError(
            f"k_bucket={k_bucket} cannot hold ceil({key_retention} * {span}) selected keys"
        )
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    chunk = max(1, CHUNK_ELEMENTS // max(1, span * num_q_heads * head_dim))
    parts = [
        _source_rows(
            q[i : i + chunk],
            key_cache,
            value_cache,
            block_tables[i : i + chunk],
            context_lengths[i : i + chunk],
            key_retention,
            k_bucket,
            scale,
        )
        for i in range(0, rows, chunk)
    ]
    if not parts:
        empty = q.new_zeros((0, num_q_heads, head_dim), dtype=torch.float32)
        indices = torch.zeros((0, num_q_heads, k_bucket), dtype=torch.int32, device=q.device)
        return q.new_empty((0, num_q_heads, head_dim)), indices, empty[..., 0], empty, empty
    out, indices, mass, output, contribution = (torch.cat(t) for t in zip(*parts, strict=True))
    return out.to(q.dtype), indices, mass, output, contribution


def _gather(cache, block_tables, rows, span, num_q_heads):
    blocks = block_tables.long().clamp(0, cache.shape[0] - 1)
    x = cache[blocks].reshape(rows, span, cache.shape[2], cache.shape[3]).float()
    return x.repeat_interleave(num_q_heads // cache.shape[2], dim=2)  # [R, T, Hq, D]


def _source_rows(
    q, key_cache, value_cache, block_tables, context_lengths, key_retention, k_bucket, scale
):
    rows, num_q_heads, _ = q.shape
    span = block_tables.shape[1] * key_cache.shape[1]
    keys = _gather(key_cache, block_tables, rows, span, num_q_heads)
    values = _gather(value_cache, block_tables, rows, span, num_q_heads)
    return source_statistics(q, keys, values, context_lengths, key_retention, k_bucket, scale)


def source_statistics(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    context_lengths: torch.Tensor,
    key_retention: float,
    k_bucket: int,
    scale: float,
) -> tuple[torch.Tensor, ...]:
    """The loop-2 statistics of q [R, Hq, D] from explicit K/V [R, T, Hq, D] FP32 and
    context_lengths [R]: (output, indices, mass, output, contribution) as
    :func:`dense_source` returns them (output in FP32)."""
    rows, num_q_heads, _ = q.shape
    span = keys.shape[1]
    visible = torch.arange(span, device=q.device)[None, :] < context_lengths.long()[:, None]
    logits = torch.einsum("rhd,rthd->rht", q.float(), keys) * scale
    probs = torch.softmax(logits.masked_fill(~visible[:, None, :], float("-inf")), dim=-1)
    probs = torch.nan_to_num(probs, nan=0.0)  # rows without context
    output = torch.einsum("rht,rthd->rhd", probs, values)
    width = min(k_bucket, span)
    order = torch.sort(-probs, dim=-1, stable=True).indices[..., :width]  # [R, Hq, width]
    counts = selected_counts(context_lengths, key_retention)
    valid = torch.arange(width, device=q.device)[None, None, :] < counts[:, None, None]
    chosen = torch.where(valid, torch.gather(probs, 2, order), 0.0)
    chosen_values = torch.gather(
        values.permute(0, 2, 1, 3), 2, order[..., None].expand(-1, -1, -1, values.shape[-1])
    )
    contribution = torch.einsum("rhk,rhkd->rhd", chosen, chosen_values)
    indices = torch.full((rows, num_q_heads, k_bucket), -1, dtype=torch.int32, device=q.device)
    # in position order, as the readers of the selection take it (unused slots last)
    ordered = torch.where(valid, order, span).sort(dim=-1).values
    indices[..., :width] = torch.where(ordered < span, ordered, -1).to(torch.int32)
    return output, indices, chosen.sum(-1), output, contribution


def sparse_correction(
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
    """Later-loop decode: O = O_ref - C_ref + m * softmax(q k_S^T) v_S with k_S, v_S read
    from this depth's pages at the absolute positions ``indices`` [R, Hq, Kb] (-1 unused).
    Returns [R, Hq, D] in q's dtype: ``base`` with the rows where ``serves`` holds
    written, when given (``correction_into_base``)."""
    if base is not None or serves is not None:
        target = correction_target(q, base, serves)
        corrected = sparse_correction(
            q, key_cache, value_cache, block_tables, indices, mass, output, contribution, scale
        )
        return torch.where(serves[:, None, None], corrected, target, out=target)
    rows, num_q_heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    valid = indices >= 0
    pos = indices.long().clamp(min=0)
    table_col = (pos // block_size).clamp(max=block_tables.shape[1] - 1)
    blocks = torch.gather(block_tables.long(), 1, table_col.reshape(rows, -1)).reshape(pos.shape)
    blocks = blocks.clamp(0, key_cache.shape[0] - 1)
    kv_head = (torch.arange(num_q_heads, device=q.device) // (num_q_heads // num_kv_heads))[
        None, :, None
    ]
    keys = key_cache[blocks, pos % block_size, kv_head].float()  # [R, Hq, Kb, D]
    values = value_cache[blocks, pos % block_size, kv_head].float()
    logits = torch.einsum("rhd,rhkd->rhk", q.float(), keys) * scale
    local = torch.nan_to_num(
        torch.softmax(logits.masked_fill(~valid, float("-inf")), dim=-1), nan=0.0
    )
    fresh = torch.einsum("rhk,rhkd->rhd", local, values)
    return (output - contribution + mass[..., None] * fresh).to(q.dtype)
