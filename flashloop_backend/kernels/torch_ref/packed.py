"""Torch reference for decode attention over packed INT4 KV (the oracle of the Triton
reader): every row's history is reconstructed explicitly, then attended densely.
Shapes as :class:`~.ops.PackedDecode`; the store layout is ``kv.store``'s."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from flashloop_backend.kernels.validate import correction_target
from flashloop_backend.kv.layout import nibble_of_channel, param_slot
from flashloop_backend.kv.levels import LevelKind, LevelMetadata

if TYPE_CHECKING:
    from flashloop_backend.kv.store import PackedKVStore


def _level_rows(store, layer: int, pages: torch.Tensor, rows: torch.Tensor):
    """K and V [R, T, Hkv, D] FP32 of a level's rows ``rows`` [R, T] (-1 absent: zeros)
    through its page ids ``pages`` [R, P]: every page's block decoded from the v3 bytes
    (``kv.layout``), then each row's values taken from its page at its place in the group."""
    g, layout = store.group_size, store.layout
    heads, dim = store.shape[1], store.shape[2]
    device = rows.device
    blocks = store.blocks[:, layer][pages.long().clamp(min=0)]  # [R, P, H, block bytes]
    halves = blocks.view(torch.float16)  # [R, P, H, block bytes / 2]
    nibble = nibble_of_channel(dim, device)
    shift = (4 * (nibble % 2)).to(torch.uint8)
    token = torch.arange(g, device=device)[:, None]
    row_byte = token * layout.row_bytes + nibble[None, :] // 2  # [G, D]
    k_code = ((blocks[..., row_byte] >> shift) & 15).float()  # [R, P, H, G, D]
    v_code = ((blocks[..., layout.v_codes + row_byte] >> shift) & 15).float()
    slot = param_slot(dim, device)
    k_scale = halves[..., layout.k_params // 2 + slot].float()[..., None, :]
    k_min = halves[..., layout.k_params // 2 + dim + slot].float()[..., None, :]
    k = k_min + k_scale * k_code
    d = torch.arange(dim, device=device)[None, :]
    record = layout.v_params // 2 + token * (2 * layout.v_groups) + 2 * (d // g)  # [G, D]
    v = halves[..., record].float() + halves[..., record + 1].float() * v_code
    count, columns = blocks.shape[:2]
    k = k.permute(0, 1, 3, 2, 4).reshape(count, columns * g, heads, dim)
    v = v.permute(0, 1, 3, 2, 4).reshape(count, columns * g, heads, dim)
    at = rows.clamp(min=0).long()[..., None, None].expand(-1, -1, heads, dim)
    mask = (rows >= 0)[..., None, None]
    return (
        torch.where(mask, torch.gather(k, 1, at), 0.0),
        torch.where(mask, torch.gather(v, 1, at), 0.0),
    )


def packed_history(store, layer, meta, key_cache, value_cache, block_tables, dtype):
    """Every row's logical K and V [R, span, Hkv, D] (FP32 holding ``dtype`` values):
    reconstructed from the store below the row's packed length, BF16 pages above."""
    tables, maps, kinds = meta.tables, meta.maps, meta.kinds
    packed = meta.packed_lengths.long()
    rows = packed.shape[0]
    block_size, kv_heads, head_dim = key_cache.shape[1], key_cache.shape[2], key_cache.shape[3]
    span = max(block_tables.shape[1] * block_size, maps.shape[2])
    device = key_cache.device
    t = torch.arange(span, device=device)[None, :].expand(rows, -1)
    keys = torch.zeros(rows, span, kv_heads, head_dim, device=device)
    values = torch.zeros_like(keys)
    in_packed = t < packed[:, None]
    for level in range(tables.shape[1]):
        kind = kinds[:, level].long()[:, None]
        compact = torch.gather(maps[:, level].long(), 1, t.clamp(max=maps.shape[2] - 1))
        level_rows = torch.where(kind == LevelKind.COMPACT, compact, t)
        level_rows = torch.where((kind == LevelKind.EMPTY) | ~in_packed, -1, level_rows)
        k, v = _level_rows(store, layer, tables[:, level], level_rows)
        keys, values = keys + k, values + v
    column = (t // block_size).clamp(max=block_tables.shape[1] - 1)
    page = torch.gather(block_tables.long().clamp(min=0), 1, column).clamp(
        max=key_cache.shape[0] - 1
    )
    tail_k = key_cache[page, t % block_size].float()
    tail_v = value_cache[page, t % block_size].float()
    # the dots run in the input dtype, like the kernels: reconstructions round to it first
    keys = torch.where(in_packed[..., None, None], keys.to(dtype).float(), tail_k)
    values = torch.where(in_packed[..., None, None], values.to(dtype).float(), tail_v)
    return keys, values


def _per_query_head(x: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    return x.repeat_interleave(num_q_heads // x.shape[2], dim=2)


def _only_rows(needed: torch.Tensor, fn, q, meta, block_tables, *per_row):
    """Run ``fn`` on the rows ``needed`` [R] bool only and scatter into zeros: every op
    is called over the whole batch with other rows' lengths masked to 0, and rebuilding
    their histories would dominate this reference. (Reads the mask on the host: the
    reference is the oracle, not the graph-safe path.)"""
    rows = q.shape[0]
    if meta.tables.shape[0] != rows or meta.packed_lengths.shape != (rows,):
        raise ValueError(  # as the Triton wrapper checks: every query row has its metadata
            f"metadata rows/levels disagree: tables {tuple(meta.tables.shape)}, kinds "
            f"{tuple(meta.kinds.shape)}, packed {tuple(meta.packed_lengths.shape)} for {rows} rows"
        )
    index = needed.nonzero().flatten()
    sub_meta = meta.rows(index)
    result = fn(q[index], sub_meta, block_tables[index], *(t[index] for t in per_row))
    if isinstance(result, tuple):
        return tuple(_scatter(t, index, q.shape[0]) for t in result)
    return _scatter(result, index, q.shape[0])


def _scatter(t: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
    fill = -1 if t.dtype == torch.int32 else 0
    full = torch.full((rows, *t.shape[1:]), fill, dtype=t.dtype, device=t.device)
    full[index] = t
    return full


def packed_decode_reference(
    q: torch.Tensor,
    store: PackedKVStore,
    layer: int,
    meta: LevelMetadata,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    scale: float | None = None,
    few_rows: bool = False,
) -> torch.Tensor:
    """``packed_decode`` (arguments and shapes as :class:`~.ops.PackedDecode`; the launch
    hint ``few_rows`` changes nothing here)."""

    def run(q, meta, block_tables, context_lengths):
        return _decode_rows(
            q, store, layer, meta, key_cache, value_cache, block_tables, context_lengths, scale
        )

    return _only_rows(context_lengths > 0, run, q, meta, block_tables, context_lengths)


def _decode_rows(
    q, store, layer, meta, key_cache, value_cache, block_tables, context_lengths, scale
):
    rows, num_q_heads, head_dim = q.shape
    if rows == 0:
        return torch.empty_like(q)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    keys, values = packed_history(store, layer, meta, key_cache, value_cache, block_tables, q.dtype)
    keys, values = _per_query_head(keys, num_q_heads), _per_query_head(values, num_q_heads)
    logits = torch.einsum("rhd,rthd->rht", q.float(), keys) * scale
    t = torch.arange(keys.shape[1], device=q.device)
    visible = (t[None, :] < context_lengths.long()[:, None])[:, None, :]
    probs = torch.nan_to_num(
        torch.softmax(logits.masked_fill(~visible, float("-inf")), -1), nan=0.0
    )
    return torch.einsum("rht,rthd->rhd", probs, values).to(q.dtype)


def packed_dense_source(
    q: torch.Tensor,
    store: PackedKVStore,
    layer: int,
    meta: LevelMetadata,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    key_retention: float,
    k_bucket: int,
    scale: float | None = None,
) -> tuple[torch.Tensor, ...]:
    """``dense_source`` over packed KV: the loop-2 statistics of the reconstructed history
    (same outputs as :func:`~.torch_ref.sparse_decode.dense_source`; arguments as
    :class:`~.ops.PackedDenseSource`)."""

    def run(q, meta, block_tables, context_lengths):
        return _source_rows(
            q,
            store,
            layer,
            meta,
            key_cache,
            value_cache,
            block_tables,
            context_lengths,
            key_retention,
            k_bucket,
            scale,
        )

    return _only_rows(context_lengths > 0, run, q, meta, block_tables, context_lengths)


def _source_rows(
    q,
    store,
    layer,
    meta,
    key_cache,
    value_cache,
    block_tables,
    context_lengths,
    key_retention,
    k_bucket,
    scale,
):
    from flashloop_backend.kernels.torch_ref.sparse_decode import source_statistics

    rows, num_q_heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    keys, values = packed_history(store, layer, meta, key_cache, value_cache, block_tables, q.dtype)
    if rows == 0:
        empty = q.new_zeros((0, num_q_heads, head_dim), dtype=torch.float32)
        indices = torch.zeros((0, num_q_heads, k_bucket), dtype=torch.int32, device=q.device)
        return q.new_empty((0, num_q_heads, head_dim)), indices, empty[..., 0], empty, empty
    keys, values = _per_query_head(keys, num_q_heads), _per_query_head(values, num_q_heads)
    stats = source_statistics(q, keys, values, context_lengths, key_retention, k_bucket, scale)
    return (stats[0].to(q.dtype), *stats[1:])


def packed_sparse_correction(
    q: torch.Tensor,
    store: PackedKVStore,
    layer: int,
    meta: LevelMetadata,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    indices: torch.Tensor,
    mass: torch.Tensor,
    output: torch.Tensor,
    contribution: torch.Tensor,
    scale: float | None = None,
    base: torch.Tensor | None = None,
    serves: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sparse_correction`` over packed KV: the selected keys read from the reconstructed
    history of this depth (only those positions enter the softmax; arguments as
    :class:`~.ops.PackedSparseCorrection`). Returns [R, Hq, D] in q's dtype: ``base``
    with the rows where ``serves`` holds written, when given."""
    if base is not None or serves is not None:
        target = correction_target(q, base, serves)
        paged = (key_cache, value_cache, block_tables, indices, mass, output, contribution)
        corrected = packed_sparse_correction(q, store, layer, meta, *paged, scale)
        return torch.where(serves[:, None, None], corrected, target, out=target)

    def run(q, meta, block_tables, indices, mass, output, contribution):
        return _correction_rows(
            q,
            store,
            layer,
            meta,
            key_cache,
            value_cache,
            block_tables,
            indices,
            mass,
            output,
            contribution,
            scale,
        )

    needed = (indices >= 0).flatten(1).any(1)
    result = _only_rows(needed, run, q, meta, block_tables, indices, mass, output, contribution)
    # a row with no selected key keeps the formula's value with an empty S: O_ref - C_ref
    empty = (output.float() - contribution.float()).to(q.dtype)
    return torch.where(needed[:, None, None], result, empty)


def _correction_rows(
    q,
    store,
    layer,
    meta,
    key_cache,
    value_cache,
    block_tables,
    indices,
    mass,
    output,
    contribution,
    scale,
):
    rows, num_q_heads, head_dim = q.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    keys, values = packed_history(store, layer, meta, key_cache, value_cache, block_tables, q.dtype)
    keys, values = _per_query_head(keys, num_q_heads), _per_query_head(values, num_q_heads)
    valid = indices >= 0
    where = indices.long().clamp(min=0)  # [R, Hq, Kb]
    heads = torch.arange(num_q_heads, device=q.device)[None, :, None]
    selected_k = keys[
        torch.arange(rows, device=q.device)[:, None, None], where, heads
    ]  # [R, Hq, Kb, D]
    selected_v = values[torch.arange(rows, device=q.device)[:, None, None], where, heads]
    logits = torch.einsum("rhd,rhkd->rhk", q.float(), selected_k) * scale
    local = torch.nan_to_num(torch.softmax(logits.masked_fill(~valid, float("-inf")), -1), nan=0.0)
    fresh = torch.einsum("rhk,rhkd->rhd", local, selected_v)
    return (output - contribution + mass[..., None] * fresh).to(q.dtype)
