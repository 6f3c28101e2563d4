"""Blockwise online-softmax paged attention: an example ``flashloop_backend`` kernel plugin."""

from __future__ import annotations

import math

import torch

from flashloop_backend.capabilities import Capability, Support
from flashloop_backend.kernels import KernelImpl, KernelProvider, OpName
from flashloop_backend.kernels.validate import check_paged_inputs

__version__ = "0.1.0"


def blockwise_paged_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lengths: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Same contract as ``flashloop_backend.kernels.PagedAttention``; one block per step."""
    rows, num_q_heads, head_dim = check_paged_inputs(
        q, key_cache, value_cache, block_tables, context_lengths
    )
    num_blocks, block_size, num_kv_heads, _ = key_cache.shape
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    group = num_q_heads // num_kv_heads
    qf = q.float()
    running_max = torch.full((rows, num_q_heads), float("-inf"), device=q.device)
    running_sum = torch.zeros((rows, num_q_heads), device=q.device)
    acc = torch.zeros((rows, num_q_heads, head_dim), device=q.device)
    lengths = context_lengths.long()
    offsets = torch.arange(block_size, device=q.device)
    for b in range(block_tables.shape[1]):
        ids = block_tables[:, b].long().clamp(0, num_blocks - 1)
        k = key_cache[ids].float().repeat_interleave(group, dim=2)  # [R, BS, Hq, D]
        v = value_cache[ids].float().repeat_interleave(group, dim=2)
        visible = (b * block_size + offsets)[None, :] < lengths[:, None]  # [R, BS]
        s = torch.einsum("rhd,rthd->rht", qf, k) * scale
        s = s.masked_fill(~visible[:, None, :], float("-inf"))
        new_max = torch.maximum(running_max, s.amax(dim=-1))
        safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
        p = torch.exp(s - safe_max[..., None])
        correction = torch.exp(running_max - safe_max)
        running_sum = running_sum * correction + p.sum(dim=-1)
        acc = acc * correction[..., None] + torch.einsum("rht,rthd->rhd", p, v)
        running_max = new_max
    out = acc / running_sum.clamp(min=1e-30)[..., None]
    return out.to(q.dtype)


def provider() -> KernelProvider:
    support = Support(
        devices=frozenset({"cpu", "cuda"}),
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        capabilities=frozenset({Capability.DEVICE_POSITIONS, Capability.NONCONSECUTIVE_QUERIES}),
    )
    return KernelProvider(
        name="example_blockwise",
        version=__version__,
        priority=-10,
        description="example plugin: blockwise online-softmax torch paged attention",
        impls={
            OpName.DENSE_ATTENTION: KernelImpl(
                OpName.DENSE_ATTENTION, blockwise_paged_attention, support
            )
        },
    )
