"""What one request costs in an engine, and the pools a KV memory budget buys.

A request holds, from admission until its prompt has run every loop and been packed, its
BF16 reservation on every depth plane (prompt + new tokens) and, under KV quantization,
the packed pages reserved for it; after the packing only the BF16 blocks the packing
leaves (the rows past its last whole group and the new tokens) and its pages. When the
engine carries planes (no prefix cache), the rows the backend packs are stored one depth
at a time as each loop ends and their blocks pass on to the next loop's plane: a prompt
then holds one plane of them at a time, plus the rows past them on every plane. A budget
therefore holds ``prefill_requests`` prompts in flight at their prefill cost and every
other request at its decode cost: the BF16 pool is sized for that mix and the packed pool
for every request's pages, so the same bytes admit more requests when the backend packs.
The token-state slot's backend state (the loop-2 references) counts per request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashloop_backend.backends.base import AttentionBackend, EngineCapacity
from flashloop_backend.host.kvcache import plane_blocks


@dataclass(frozen=True)
class Footprint:
    """One request of ``prompt`` + ``new_tokens``: ``prefill_blocks`` BF16 blocks (every
    plane) until its prompt is packed, ``decode_blocks`` after, of ``block_bytes`` each;
    ``packed_pages`` of ``page_bytes``; ``slot_bytes`` of backend state."""

    prompt: int
    new_tokens: int
    prefill_blocks: int
    decode_blocks: int
    block_bytes: int
    packed_pages: int
    page_bytes: int
    slot_bytes: int

    @property
    def prefill_bytes(self) -> int:
        return self._bytes(self.prefill_blocks)

    @property
    def decode_bytes(self) -> int:
        return self._bytes(self.decode_blocks)

    def _bytes(self, blocks: int) -> int:
        return blocks * self.block_bytes + self.packed_pages * self.page_bytes + self.slot_bytes


def planning_capacity(cfg, max_context: int, block_size: int, device) -> EngineCapacity:
    """An :class:`EngineCapacity` of model config ``cfg`` (``OuroConfig``) to plan with:
    its shapes, ``max_context`` and ``block_size``; no pool size (nothing is allocated)."""
    return EngineCapacity(
        max_slots=1,
        max_context=max_context,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim,
        loops=cfg.total_ut_steps,
        num_blocks=0,
        block_size=block_size,
        device=device,
    )


def footprint(
    backend: AttentionBackend,
    capacity: EngineCapacity,
    prompt: int,
    new_tokens: int,
    dtype_bytes: int = 2,
    carry_planes: bool = True,
) -> Footprint:
    """:class:`Footprint` of a request under an engine shaped like ``capacity`` (its pool
    sizes are not read) with a BF16 cache of ``dtype_bytes`` per element, carrying its
    prompt's packed rows from plane to plane or not (an engine with a prefix cache)."""
    c = capacity
    cost = backend.request_cost(c, prompt, new_tokens)
    per_plane = math.ceil((prompt + new_tokens) / c.block_size)
    if cost.packed_rows % c.block_size:
        raise ValueError(
            f"packed rows {cost.packed_rows} are not whole KV blocks of {c.block_size}"
        )
    block_bytes = c.block_size * c.num_layers * c.num_kv_heads * c.head_dim * 2 * dtype_bytes
    carried = cost.packed_rows if carry_planes else 0
    past = per_plane - cost.packed_rows // c.block_size  # blocks every plane keeps
    return Footprint(
        prompt,
        new_tokens,
        plane_blocks(prompt + new_tokens, c.block_size, c.loops, carried),
        c.loops * past,
        block_bytes,
        cost.packed_pages,
        cost.page_bytes,
        cost.slot_bytes,
    )


@dataclass(frozen=True)
class PoolPlan:
    """Pools for ``requests`` concurrent requests of one :class:`Footprint` within
    ``budget_bytes``, ``prefill_requests`` of them in prefill at once: ``num_blocks`` BF16
    blocks, ``packed_pages`` pages, ``max_slots`` token-state slots; ``used_bytes`` the
    pools' bytes (the scratch slot's included)."""

    budget_bytes: int
    prefill_requests: int
    requests: int
    num_blocks: int
    packed_pages: int
    max_slots: int
    used_bytes: int


def plan_pools(
    budget_bytes: int, request: Footprint, prefill_requests: int = 1, slots_per_request: int = 1
) -> PoolPlan:
    """The most requests ``budget_bytes`` holds: ``prefill_requests`` at their prefill
    cost, the rest at their decode cost, each with ``slots_per_request`` token-state slots
    (a speculating request holds one per block row), and one more slot's state (the
    backend's scratch slot) (raises ``ValueError`` naming both when not even one request
    fits)."""
    if prefill_requests < 1 or slots_per_request < 1:
        raise ValueError(
            f"prefill_requests={prefill_requests} and slots_per_request={slots_per_request} "
            "must be >= 1"
        )
    scratch = request.slot_bytes
    extra = (slots_per_request - 1) * request.slot_bytes
    prefill, decode = request.prefill_bytes + extra, request.decode_bytes + extra
    budget = budget_bytes - scratch
    if budget < prefill:
        raise ValueError(
            f"a KV memory budget of {budget_bytes} bytes cannot hold one request of "
            f"{request.prompt} + {request.new_tokens} tokens: its prefill needs {prefill} bytes"
        )
    in_flight = min(prefill_requests, budget // prefill)
    requests = in_flight + (budget - in_flight * prefill) // decode
    blocks = in_flight * request.prefill_blocks + (requests - in_flight) * request.decode_blocks
    used = in_flight * prefill + (requests - in_flight) * decode + scratch
    return PoolPlan(
        budget_bytes,
        in_flight,
        requests,
        blocks,
        requests * request.packed_pages,
        requests * slots_per_request,
        used,
    )


def requests_that_fit(
    backend: AttentionBackend, cfg, context: int, new_tokens: int, budget_bytes: int
) -> tuple[int, Footprint]:
    """(requests of ``context`` tokens, ``new_tokens`` of them generated, that
    ``budget_bytes`` holds with one prefilling at a time under ``backend`` and model config
    ``cfg`` with a BF16 cache in blocks of 16; 0 when not one fits, one request's
    :class:`Footprint`)."""
    import torch

    shape = planning_capacity(cfg, context, 16, torch.device("cpu"))
    cost = footprint(backend, shape, context - new_tokens, new_tokens)
    try:
        return plan_pools(budget_bytes, cost).requests, cost
    except ValueError:
        return 0, cost
