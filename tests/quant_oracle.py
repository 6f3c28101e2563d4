"""Test oracle for the packed KV path: after a prompt has run every loop, its K/V on every
depth plane is overwritten with the reference reconstruction (``encode_compact_chain``)
of the ``fixed_prompt`` policy: whole groups only, INT4 base for loop 1, compact residuals
against the reconstruction for rows that recomputed a later loop, K grouped per channel
across rows, V per row across channels. The packed store and reader must give the same.
"""

from __future__ import annotations

import torch

from flashloop_backend.algorithms import encode_compact_chain, reconstruct_compact
from flashloop_backend.config import KVResidualQuantizationConfig


def fake_quantize_prompt(engine, request, quant: KVResidualQuantizationConfig) -> None:
    """Engine ``on_prompt_done`` hook: rewrite the prompt's K/V with its reconstruction."""
    kv = engine.kv
    length = len(request.prompt) // quant.group_size * quant.group_size
    history = [a[:length] for a in request.schedule.active_history]
    positions = list(range(length))
    slots = [
        torch.tensor(kv.slots(request.id, depth, positions), device=kv.key_pool.device)
        for depth in range(kv.num_depths)
    ]
    for layer in range(kv.key_pool.shape[1]):
        for pool, dim in ((kv.key_pool, 0), (kv.value_pool, -1)):
            view = pool[:, layer]  # [NB, BS, Hkv, D]
            versions = [view[s // kv.block_size, s % kv.block_size].float() for s in slots]
            chain = encode_compact_chain(versions, history, quant.group_size, dim)
            for depth, s in enumerate(slots):
                view[s // kv.block_size, s % kv.block_size] = reconstruct_compact(chain, depth).to(
                    pool.dtype
                )
