"""The Ouro architecture with vllm-rlt's stage operations: prelude, recurrent, coda.

Parameter names match Ouro checkpoints (``model.layers.N.self_attn.q_proj.weight`` ...).
``recurrent`` runs one traversal of all layers for a batch of rows, each row with its own
absolute position and depth; attention (and the KV write) is delegated to a context the
host supplies, so the model never sees a cache layout.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from flashloop_backend.capabilities import SupportRequest
from flashloop_backend.host.config import OuroConfig
from flashloop_backend.host.layer_ops import (
    add_rms_norm,
    linear,
    rms_norm_reference,
    rope_qk,
    rope_reference,
    silu_mul,
)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(x, self.weight, self.eps)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP32 rotate-half tables for absolute positions: ([..., D], [..., D])."""
    inv_freq = 1.0 / theta ** (
        torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    )
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        # [q; k; v] weights (``fuse_projections``); a buffer so ``.to()`` moves it
        self.register_buffer("fused", None, persistent=False)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [..., hidden] -> post-RoPE q [..., Hq, D], k [..., Hkv, D], v [..., Hkv, D]."""
        if self.fused is not None and x.dim() == 2:  # one GEMM, one RoPE launch for q and k
            qkv = linear(x, self.fused)
            return rope_qk(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        lead = x.shape[:-1]
        q = self.q_proj(x).view(*lead, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(*lead, self.num_kv_heads, self.head_dim)
        return rope_reference(q, cos, sin), rope_reference(k, cos, sin), v


class MLP(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        # [gate; up] weights (``fuse_projections``); a buffer so ``.to()`` moves it
        self.register_buffer("fused", None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused is not None and x.dim() == 2:  # one GEMM, one SiLU x up launch
            return linear(silu_mul(linear(x, self.fused)), self.down_proj.weight)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _fuse(linears: list[nn.Linear]) -> torch.Tensor:
    """One weight [sum of outputs, in] holding ``linears``' weights, which become views of
    it: the fused GEMM and the checkpoint's names share one copy of the bytes."""
    fused = torch.cat([module.weight.detach() for module in linears])
    start = 0
    for module in linears:
        rows = module.weight.shape[0]
        module.weight = nn.Parameter(fused[start : start + rows], requires_grad=False)
        start += rows
    return fused


class DecoderLayer(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        eps = cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.input_layernorm_2 = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm_2 = RMSNorm(cfg.hidden_size, eps)

    def mlp_block(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(h)))


class AttentionContext(Protocol):
    """Supplied by the host for one traversal: writes this layer's K/V for every row, then
    returns attention over each row's own history. q [R, Hq, D], k/v [R, Hkv, D]."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class OuroBackbone(nn.Module):
    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.early_exit_gate = nn.Linear(cfg.hidden_size, 1)


class OuroModel(nn.Module):
    """Ouro for causal LM: ``model.*`` backbone plus an untied ``lm_head``."""

    def __init__(self, cfg: OuroConfig) -> None:
        super().__init__()
        self.config = cfg
        # fused projections and the layer kernels (on CUDA); False: the reference path
        self.fused = False
        self.model = OuroBackbone(cfg)
        # this rank's share of the heads (host/tensor_parallel.py); None: the whole model
        self.tensor_parallel = None
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def fuse_projections(self) -> None:
        """Concatenate each layer's q/k/v and gate/up weights for inference: one GEMM each,
        the checkpoint's parameters viewing the fused weights (no second copy). Call it
        after moving the model to its device and dtype."""
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.fused = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            mlp.fused = _fuse([mlp.gate_proj, mlp.up_proj])
        self.fused = True

    def support_request(self, block_size: int = 16) -> SupportRequest:
        """What this model asks of an attention backend: its attention shapes, its device
        and dtype, and the KV cache's ``block_size``."""
        param, cfg = next(self.parameters()), self.config
        return SupportRequest(
            device=param.device.type,
            dtype=param.dtype,
            head_dim=cfg.head_dim,
            block_size=block_size,
            num_q_heads=cfg.num_attention_heads,
            num_kv_heads=cfg.num_key_value_heads,
        )

    @property
    def layer_kernels(self) -> bool | None:
        """``use_triton`` of the per-layer ops (``layer_ops``) and the KV write: None (the
        kernels on CUDA) once fused, False (the torch references) before."""
        return None if self.fused else False

    # ------------------------------------------------------------ stage operations
    def prelude(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token ids [R] -> hidden [R, hidden]."""
        return self.model.embed_tokens(token_ids)

    def recurrent(
        self, hidden: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        """One loop over every layer, then the end-of-loop norm: [R, hidden] -> [R, hidden]."""
        cfg = self.config
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        layers, eps = self.model.layers, cfg.rms_norm_eps
        # the sandwich norms fused pairwise: each residual add with the norm of what is
        # added and the norm the next block reads (the next layer's, or the loop's last)
        kernels = self.layer_kernels
        h, x = add_rms_norm(hidden, None, None, layers[0].input_layernorm.weight, eps, kernels)
        for index, layer in enumerate(layers):
            q, k, v = layer.self_attn.qkv(x, cos, sin)
            attn = ctx.attend(index, q, k, v)
            attn = attn.reshape(attn.shape[0], -1)
            o_proj = layer.self_attn.o_proj
            attn = linear(attn, o_proj.weight) if self.fused else o_proj(attn)
            if self.tensor_parallel is not None:  # row-parallel o_proj: partial sums
                attn = self.tensor_parallel.all_reduce(attn)
            norm_2, post = layer.input_layernorm_2.weight, layer.post_attention_layernorm.weight
            h, x = add_rms_norm(h, attn, norm_2, post, eps, kernels)
            last = index + 1 == len(layers)
            after = self.model.norm if last else layers[index + 1].input_layernorm
            mlp = layer.mlp(x)
            if self.tensor_parallel is not None:  # row-parallel down_proj: partial sums
                mlp = self.tensor_parallel.all_reduce(mlp)
            h, x = add_rms_norm(
                h, mlp, layer.post_attention_layernorm_2.weight, after.weight, eps, kernels
            )
        return x

    def coda(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden [R, hidden] -> logits [R, vocab] (FP32)."""
        return self.lm_head(hidden).float()

    def exit_lambda(self, hidden: torch.Tensor) -> torch.Tensor:
        """Per-row exit hazard sigmoid(gate) [R] in FP32 after a loop."""
        return torch.sigmoid(self.model.early_exit_gate(hidden).float().squeeze(-1))

    # ------------------------------------------------------------ training path
    def full_forward(
        self, token_ids: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Whole sequences [B, T] through every loop with dense causal attention (training
        and offline analysis). Returns per-loop normed hidden [B, T, hidden] and gate logits
        [B, T]."""
        cfg = self.config
        batch, length = token_ids.shape
        positions = torch.arange(length, device=token_ids.device)
        cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta)
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        h = self.model.embed_tokens(token_ids)
        hiddens, gates = [], []
        for _ in range(cfg.total_ut_steps):
            for layer in self.model.layers:
                q, k, v = layer.self_attn.qkv(layer.input_layernorm(h), cos, sin)
                q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
                k = k.repeat_interleave(group, dim=1)
                v = v.repeat_interleave(group, dim=1)
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                attn = layer.self_attn.o_proj(attn.transpose(1, 2).reshape(batch, length, -1))
                h = layer.mlp_block(h + layer.input_layernorm_2(attn))
            h = self.model.norm(h)
            hiddens.append(h)
            gates.append(self.model.early_exit_gate(h).squeeze(-1))
        return hiddens, gates


def exit_distribution(gate_logits: list[torch.Tensor]) -> torch.Tensor:
    """Ouro's exit pdf from per-loop gate logits: p_t = λ_t Π_{j<t}(1-λ_j), the last loop
    takes the remaining mass. Returns [..., loops] in FP32."""
    remaining = torch.ones_like(gate_logits[0], dtype=torch.float32)
    pdf = []
    for index, logit in enumerate(gate_logits):
        lam = torch.sigmoid(logit.float())
        if index < len(gate_logits) - 1:
            pdf.append(lam * remaining)
            remaining = remaining * (1 - lam)
        else:
            pdf.append(remaining)
    return torch.stack(pdf, dim=-1)
