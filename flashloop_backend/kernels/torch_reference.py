"""Torch reference kernels: the oracle every other implementation is tested against.

Written for clarity, not speed; runs on CPU and GPU; FP32 softmax and accumulation.
No host synchronisation: shapes come from tensor sizes, never from tensor values.
"""

from __future__ import annotations

import math

import torch

from .. import __version__
from ..capabilities import Capability, Support
from .ops import KernelImpl, KernelProvider, OpName
from .validate import check_paged_inputs

_FLOAT_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16})


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
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    if rows == 0:
        return q.new_empty((0, num_q_heads, head_dim))
    # Entries past a row's context may be -1 or stale: clamp to a legal id, then mask.
    tables = block_tables.long().clamp(0, num_blocks - 1)
    span = tables.shape[1] * block_size
    keys = key_cache[tables].reshape(rows, span, num_kv_heads, head_dim).float()
    values = value_cache[tables].reshape(rows, span, num_kv_heads, head_dim).float()
    group = num_q_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=2)
    values = values.repeat_interleave(group, dim=2)

    positions = torch.arange(span, device=q.device)
    visible = positions[None, :] < context_lengths.long()[:, None]  # [R, T]
    scores = torch.einsum("rhd,rthd->rht", q.float(), keys) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # Padding rows (no visible key) give NaN from softmax over all -inf: make them zero.
    probs = torch.where(visible.any(dim=-1)[:, None, None], probs, torch.zeros_like(probs))
    out = torch.einsum("rht,rthd->rhd", probs, values)
    return out.to(q.dtype)


SUPPORT = Support(
    devices=frozenset({"cpu", "cuda"}),
    dtypes=_FLOAT_DTYPES,
    capabilities=frozenset(
        {
            Capability.NONCONSECUTIVE_QUERIES,
            Capability.DEVICE_POSITIONS,
            Capability.ASYNC_SCHEDULING,
            Capability.PACKED_PREFILL,
        }
    ),
)


def provider() -> KernelProvider:
    return KernelProvider(
        name="torch_reference",
        version=__version__,
        priority=0,
        description="pure torch reference kernels (oracle; CPU and GPU)",
        impls={
            OpName.DENSE_ATTENTION: KernelImpl(OpName.DENSE_ATTENTION, paged_attention, SUPPORT),
            OpName.SPARSE_PREFILL: KernelImpl(OpName.SPARSE_PREFILL, paged_attention, SUPPORT),
        },
    )
