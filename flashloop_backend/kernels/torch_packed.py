"""Torch reference for decode attention over packed INT4 KV (the oracle of the Triton
reader): every row's history is reconstructed explicitly, then attended densely.
Shapes as :class:`~.ops.PackedDecode`; the store layout is ``packed_kv``'s."""

from __future__ import annotations

import math

import torch

LEVEL_COMPACT, LEVEL_EMPTY = 1, 2


def _level_rows(store, layer: int, pages: torch.Tensor, rows: torch.Tensor):
    """K and V [R, T, Hkv, D] FP32 of a level's rows ``rows`` [R, T] (-1 absent: zeros)
    through its page ids ``pages`` [R, P]."""
    g = store.group_size
    present = rows >= 0
    page = torch.gather(pages.long(), 1, (rows.clamp(min=0) // g)).clamp(min=0)  # [R, T]
    within = rows.clamp(min=0) % g
    heads, dim = store.shape[1], store.shape[2]
    h = torch.arange(heads, device=rows.device)[None, None, :, None]
    d = torch.arange(dim, device=rows.device)[None, None, None, :]
    p4, w4 = page[..., None, None], within[..., None, None]
    k_byte = store.k_codes[p4, layer, h, d, w4 // 2]  # [R, T, H, D]: only the byte needed
    k_code = ((k_byte >> (4 * (w4 % 2)).to(torch.uint8)) & 15).float()
    k = store.k_min[page, layer].float() + store.k_scale[page, layer].float() * k_code
    channel = torch.arange(dim, device=rows.device)
    v_bytes = store.v_codes[page, layer, within][..., channel // 2]  # [R, T, H, D]
    v_code = ((v_bytes >> (4 * (channel % 2)).to(torch.uint8)) & 15).float()
    group = channel // g
    v_min = store.v_min[page, layer, within][..., group].float()
    v_scale = store.v_scale[page, layer, within][..., group].float()
    v = v_min + v_scale * v_code
    mask = present[..., None, None]
    return torch.where(mask, k, 0.0), torch.where(mask, v, 0.0)


def packed_decode_reference(q, store, layer, meta, key_cache, value_cache, block_tables,
                            context_lengths, scale=None) -> torch.Tensor:  # fmt: skip
    rows, num_q_heads, head_dim = q.shape
    if rows == 0:
        return torch.empty_like(q)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    tables, maps, kinds = meta["level_tables"], meta["level_maps"], meta["level_kinds"]
    packed = meta["packed_lengths"].long()
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    span = max(block_tables.shape[1] * block_size, maps.shape[2])
    t = torch.arange(span, device=q.device)[None, :].expand(rows, -1)
    keys = torch.zeros(rows, span, kv_heads, head_dim, device=q.device)
    values = torch.zeros_like(keys)
    in_packed = t < packed[:, None]
    for level in range(tables.shape[1]):
        kind = kinds[:, level].long()[:, None]
        compact = torch.gather(maps[:, level].long(), 1, t.clamp(max=maps.shape[2] - 1))
        level_rows = torch.where(kind == LEVEL_COMPACT, compact, t)
        level_rows = torch.where((kind == LEVEL_EMPTY) | ~in_packed, -1, level_rows)
        k, v = _level_rows(store, layer, tables[:, level], level_rows)
        keys, values = keys + k, values + v
    page = torch.gather(
        block_tables.long().clamp(min=0), 1, (t // block_size).clamp(max=block_tables.shape[1] - 1)
    )
    tail_k = key_cache[page.clamp(max=key_cache.shape[0] - 1), t % block_size].float()
    tail_v = value_cache[page.clamp(max=key_cache.shape[0] - 1), t % block_size].float()
    # the dots run in the input dtype, like the kernels: reconstructions round to it first
    keys = torch.where(in_packed[..., None, None], keys.to(q.dtype).float(), tail_k)
    values = torch.where(in_packed[..., None, None], values.to(q.dtype).float(), tail_v)
    group = num_q_heads // kv_heads
    keys, values = keys.repeat_interleave(group, 2), values.repeat_interleave(group, 2)
    logits = torch.einsum("rhd,rthd->rht", q.float(), keys) * scale
    visible = (t < context_lengths.long()[:, None])[:, None, :]
    probs = torch.nan_to_num(
        torch.softmax(logits.masked_fill(~visible, float("-inf")), -1), nan=0.0
    )
    return torch.einsum("rht,rthd->rhd", probs, values).to(q.dtype)
