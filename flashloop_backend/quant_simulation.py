"""Quality of the INT4 base + residual encoding, measured by simulation.

After a request's prompt has run every loop, its K/V on every depth plane is replaced by
what a packed reader would reconstruct under the ``fixed_prompt`` policy (RFC §6.4):
INT4 base for loop 1, compact residuals against the reconstruction for each later loop
(only rows that recomputed it), K grouped per channel across token rows, V per token
across channels; generated tokens stay BF16. Storage stays in the BF16 planes, so this
measures quality only and saves no memory.
"""

from __future__ import annotations

import torch

from .config import ConfigError, KVResidualQuantizationConfig
from .reference import encode_compact_chain, reconstruct_compact


def fake_quantize_prompt(engine, request, quant: KVResidualQuantizationConfig) -> None:
    """Engine ``on_prompt_done`` hook: rewrite the prompt's K/V with its reconstruction."""
    kv, length = engine.kv, len(request.prompt)
    history = request.schedule.active_history
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


def split_quantization(config):
    """(config without KV quantization, its settings or None) for simulated evaluation."""
    quant = config.kv_residual_quantization
    if not quant.enabled:
        return config, None
    if quant.policy != "fixed_prompt":
        raise ConfigError(
            f"kv_residual_quantization.policy={quant.policy!r} cannot be simulated; supported: ['fixed_prompt']"
        )
    data = config.model_dump(mode="json")
    data["kv_residual_quantization"]["enabled"] = False
    return type(config).from_dict(data), quant
