"""A deliberately naive Ouro, written apart from the host, as the oracle for it.

No KV cache, no paging, no batching: every generated token recomputes every loop over the
whole sequence from the raw weight tensors. LAST_EXITED history is spelled out directly:
at loop d, a token that exited at e < d contributes the K/V it produced at loop e.
"""

from __future__ import annotations

import math

import torch

from flashloop_backend.host.config import OuroConfig


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    variance = (x.float() ** 2).mean(dim=-1, keepdim=True)
    return weight * (x.float() / torch.sqrt(variance + eps)).to(x.dtype)


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, H, D]: pairs (i, i + D/2) rotated by angle position * theta^(-2i/D)."""
    dim = x.shape[-1]
    half = dim // 2
    out = torch.empty_like(x, dtype=torch.float32)
    for i in range(half):
        angle = positions.double() * theta ** (-2.0 * i / dim)
        c, s = torch.cos(angle).float()[:, None], torch.sin(angle).float()[:, None]
        a, b = x[..., i].float(), x[..., i + half].float()
        out[..., i] = a * c - b * s
        out[..., i + half] = b * c + a * s
    return out.to(x.dtype)


class NaiveOuro:
    """``key_retention`` switches on sparse decode attention (RFC §3.2) for generated tokens:
    loop 2 records each token's reference with ``algorithms.sparse_reference_state`` and
    loops 3-4 use ``algorithms.sparse_correct``; prompt tokens stay dense."""

    def __init__(
        self,
        cfg: OuroConfig,
        weights: dict[str, torch.Tensor],
        key_retention: float | None = None,
        token_sparsity=None,
    ) -> None:
        self.cfg, self.w, self.key_retention = cfg, weights, key_retention
        self.token_sparsity = (
            token_sparsity if token_sparsity is not None and token_sparsity.enabled else None
        )
        self.prompt_length = 0

    def _drop_prompt_tokens(self, loop, history, exited, active):
        """Token-sparse prefill: window by window, keep the budgeted top changing tokens of
        the previous active set; the others leave after loop - 1 (LAST_EXITED)."""
        from flashloop_backend.algorithms import (
            retention_budget,
            select_tokens,
            token_change_scores,
        )

        ratio, size = self.token_sparsity.retention[loop], self.token_sparsity.window_size
        if loop < 2 or ratio >= 1.0:
            return active
        prompt = self.prompt_length
        scores = token_change_scores(history[loop - 1][:prompt], history[loop - 2][:prompt])
        kept = set()
        for start in range(0, prompt, size):
            end = min(prompt, start + size)
            eligible = torch.tensor([t in active for t in range(start, end)])
            budget = retention_budget(ratio, end - start, int(eligible.sum()))
            chosen = select_tokens(scores[start:end], eligible, budget)
            kept |= {start + i for i in range(end - start) if bool(chosen[i])}
        for t in active - kept:
            exited[t] = loop - 1
        return kept

    def _sparse_rows(self, attn, q, k, v, layer, loop, states):
        """Replace generated tokens' attention rows by the sparse-decode algorithm."""
        from flashloop_backend.algorithms import sparse_correct, sparse_reference_state

        for t in range(self.prompt_length, q.shape[0]):
            visible_k, visible_v = k[: t + 1], v[: t + 1]
            if loop == 1:
                states[(t, layer)] = sparse_reference_state(
                    q[t], visible_k, visible_v, self.key_retention
                )
            elif loop >= 2:
                attn[t] = sparse_correct(states[(t, layer)], q[t], visible_k, visible_v)
        return attn

    def _loop(self, h, kv_of_loop, exited, loop, states):
        """One loop over all layers for the whole sequence. kv_of_loop[layer] is filled."""
        cfg, w = self.cfg, self.w
        length = h.shape[0]
        positions = torch.arange(length)
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        for layer in range(cfg.num_hidden_layers):
            p = f"model.layers.{layer}."
            x = _rms(h, w[p + "input_layernorm.weight"], cfg.rms_norm_eps)
            q = (x @ w[p + "self_attn.q_proj.weight"].T).view(
                length, cfg.num_attention_heads, cfg.head_dim
            )
            k = (x @ w[p + "self_attn.k_proj.weight"].T).view(
                length, cfg.num_key_value_heads, cfg.head_dim
            )
            v = (x @ w[p + "self_attn.v_proj.weight"].T).view(
                length, cfg.num_key_value_heads, cfg.head_dim
            )
            q, k = _rotate(q, positions, cfg.rope_theta), _rotate(k, positions, cfg.rope_theta)
            # LAST_EXITED: tokens that exited before this loop show their exit loop's K/V.
            for t, e in exited.items():
                if e < loop:
                    k[t], v[t] = kv_of_loop[e][layer][0][t], kv_of_loop[e][layer][1][t]
            kv_of_loop[loop][layer] = (k, v)
            heads = []
            for head in range(cfg.num_attention_heads):
                kh, vh = k[:, head // group].float(), v[:, head // group].float()
                scores = (q[:, head].float() @ kh.T) / math.sqrt(cfg.head_dim)
                scores = scores.masked_fill(
                    torch.triu(torch.ones(length, length, dtype=torch.bool), 1), float("-inf")
                )
                heads.append(torch.softmax(scores, dim=-1) @ vh)
            attn = torch.stack(heads, dim=1)
            if self.key_retention is not None:
                attn = self._sparse_rows(attn, q, k, v, layer, loop, states)
            attn = attn.to(h.dtype).reshape(length, -1)
            attn = attn @ w[p + "self_attn.o_proj.weight"].T
            h = h + _rms(attn, w[p + "input_layernorm_2.weight"], cfg.rms_norm_eps)
            y = _rms(h, w[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
            gate = torch.nn.functional.silu(y @ w[p + "mlp.gate_proj.weight"].T)
            y = (gate * (y @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T
            h = h + _rms(y, w[p + "post_attention_layernorm_2.weight"], cfg.rms_norm_eps)
        return _rms(h, w["model.norm.weight"], cfg.rms_norm_eps)

    def final_hidden(
        self, tokens: list[int], exits: dict[int, int], may_exit: bool
    ) -> tuple[torch.Tensor, int]:
        """Hidden of the last token at its exit, and that exit loop (zero-based). ``exits``
        gives the exit loop of earlier generated tokens; prompt tokens run every loop, and
        only a generated last token (``may_exit``) can leave early."""
        cfg = self.cfg
        h = self.w["model.embed_tokens.weight"][torch.tensor(tokens)]
        kv_of_loop = [[None] * cfg.num_hidden_layers for _ in range(cfg.total_ut_steps)]
        exited = dict(exits)
        last, remaining = len(tokens) - 1, 1.0
        states: dict = {}
        history, active = [], set(range(self.prompt_length))
        for loop in range(cfg.total_ut_steps):
            if self.token_sparsity is not None:
                active = self._drop_prompt_tokens(loop, history, exited, active)
            new_h = self._loop(h, kv_of_loop, exited, loop, states)
            keep = torch.tensor(
                [exited.get(t, cfg.total_ut_steps) < loop for t in range(len(tokens))]
            )
            h = torch.where(keep[:, None], h, new_h)
            history.append(h.clone())
            early = may_exit and cfg.exits_early and loop < cfg.total_ut_steps - 1
            if early and last not in exited:
                logit = h[last].float() @ self.w["model.early_exit_gate.weight"][0].float()
                lam = float(torch.sigmoid(logit + self.w["model.early_exit_gate.bias"][0].float()))
                remaining *= 1.0 - lam
                if 1.0 - remaining >= cfg.early_exit_threshold:
                    exited[last] = loop
        return h[last], exited.get(last, cfg.total_ut_steps - 1)

    def generate(self, prompt: list[int], max_new_tokens: int) -> tuple[list[int], list[int]]:
        """Greedy tokens and each generated token's exit loop (the last sampled token has
        none: it never runs a loop)."""
        tokens, exits, out = list(prompt), {}, []
        self.prompt_length = len(prompt)  # the first output token is the first decode row
        for step in range(max_new_tokens):
            hidden, exit_loop = self.final_hidden(tokens, exits, may_exit=step > 0)
            if step > 0:
                exits[len(tokens) - 1] = exit_loop
            logits = hidden.float() @ self.w["lm_head.weight"].float().T
            token = int(torch.argmax(logits))
            out.append(token)
            tokens.append(token)
            if token == self.cfg.eos_token_id:
                break
        return out, [exits[len(prompt) + i] for i in range(len(out) - 1)]
