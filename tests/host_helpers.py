"""Tiny random Ouro models for host tests."""

from __future__ import annotations

import dataclasses

import torch

from flashloop_backend.host import OuroConfig, OuroModel

TINY = OuroConfig(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=96,
    vocab_size=61,
    rope_theta=10000.0,
    total_ut_steps=4,
    max_position_embeddings=256,
)


def tiny_model(seed: int = 0, **overrides) -> OuroModel:
    cfg = dataclasses.replace(TINY, **overrides)
    gen = torch.Generator().manual_seed(seed)
    model = OuroModel(cfg)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if (
                name.endswith("layernorm.weight")
                or name.endswith("layernorm_2.weight")
                or name.endswith("norm.weight")
            ):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    return model.eval()
