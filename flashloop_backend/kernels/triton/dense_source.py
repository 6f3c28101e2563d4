"""Loop-2 dense source with selection statistics: the Triton paged attention writes every
visible key's scaled logit once and the natural-log LSE; one top-K over a composite
(logit, -position) key then selects exactly K keys per (row, head), ties to the earlier
position, without sorting all probabilities. Sizes come from shapes only (no host sync).

Validated against the torch reference under the Triton interpreter; not yet registered
in the triton provider: it becomes the default once its H200 tests and timings exist.
"""

from __future__ import annotations

import torch

from ..torch_sparse_decode import selected_counts
from .paged_decode import paged_attention_triton

LOW32 = 0xFFFFFFFF


def order_key(logits: torch.Tensor) -> torch.Tensor:
    """int64 keys whose order is (logit descending, position ascending) under ``topk``.
    FP32 bit patterns map to signed ints with the same order (negative values flip their
    magnitude bits); the low 32 bits hold the inverted position."""
    bits = logits.contiguous().view(torch.int32).long()
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    positions = torch.arange(logits.shape[-1], device=logits.device)
    return (ordered << 32) | (LOW32 - positions)


def dense_source_triton(
    q, key_cache, value_cache, block_tables, context_lengths, ratio, k_bucket, scale=None
):
    """The ``DenseSource`` contract (see ``ops.py``): (out, indices, mass, output, contribution)."""
    rows, num_q_heads, _ = q.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    span = block_tables.shape[1] * block_size
    logits = torch.full(
        (rows, num_q_heads, span), float("-inf"), device=q.device, dtype=torch.float32
    )
    lse = torch.empty((rows, num_q_heads), device=q.device, dtype=torch.float32)
    output = paged_attention_triton(q, key_cache, value_cache, block_tables, context_lengths, scale,
                                    logits=logits, lse=lse, out_dtype=torch.float32)  # fmt: skip
    width = min(k_bucket, span)
    top = torch.topk(order_key(logits), width, dim=-1, sorted=True).indices  # [R, Hq, width]
    valid = (
        torch.arange(width, device=q.device)[None, None, :]
        < selected_counts(context_lengths, ratio)[:, None, None]
    )
    chosen = torch.where(valid, torch.exp(torch.gather(logits, 2, top) - lse[..., None]), 0.0)
    page_col = (top // block_size).reshape(rows, -1)
    blocks = torch.gather(block_tables.long().clamp(min=0), 1, page_col).reshape(top.shape)
    kv_head = (torch.arange(num_q_heads, device=q.device) // (num_q_heads // num_kv_heads))[
        None, :, None
    ]
    values = value_cache[
        blocks.clamp(max=value_cache.shape[0] - 1), top % block_size, kv_head
    ].float()
    contribution = torch.einsum("rhk,rhkd->rhd", chosen, values)
    indices = torch.full((rows, num_q_heads, k_bucket), -1, dtype=torch.int32, device=q.device)
    indices[..., :width] = torch.where(valid, top, -1).to(torch.int32)
    return output.to(q.dtype), indices, chosen.sum(-1), output, contribution
