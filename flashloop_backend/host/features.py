"""Engine-side settings of the FlashLoop features: the token-sparse schedule's geometry
checks, and a request's BF16 KV as the engine lends it to the backend (which rows computed
each depth)."""

from __future__ import annotations

import torch

from flashloop_backend.backends.base import AttentionBackend, KVRows
from flashloop_backend.config import ConfigError, TokenSparsePrefillConfig
from flashloop_backend.host.kvcache import PagedKVCache
from flashloop_backend.host.requests import Request


def token_sparsity(
    backend: AttentionBackend, prefill_chunk: int
) -> TokenSparsePrefillConfig | None:
    """The backend's token-sparse prefill settings, checked against the engine's geometry."""
    config = backend.config
    if not config.token_sparse_prefill.enabled:
        return None
    sparsity = config.token_sparse_prefill  # num_loops vs the model: the backend's reserve
    if prefill_chunk % sparsity.window_size:
        raise ConfigError(
            f"prefill_chunk={prefill_chunk} must hold whole selection windows: make it a "
            f"multiple of token_sparse_prefill.window_size={sparsity.window_size}"
        )
    return sparsity


class HostRequestKV:
    """One request's BF16 KV as the engine lends it to the backend
    (:class:`~flashloop_backend.backends.base.RequestKV`): the paged planes, which rows
    computed each depth, and freeing the blocks of rows the backend stored itself."""

    def __init__(self, kv: PagedKVCache, request: Request, sparse: bool, loops: int) -> None:
        self.kv, self.request, self.sparse, self.loops = kv, request, sparse, loops
        self.prompt_length, self.num_depths = len(request.prompt), loops

    @property
    def final_rows(self) -> int:
        return self.prompt_length + len(self.request.exit_depths)

    def planes(self, start: int, end: int, depths: range | None = None) -> list[KVRows | None]:
        return self.kv.plane_rows(self.request.id, start, end, depths)

    def active(self, start: int, end: int) -> list[torch.Tensor] | None:
        return active_rows(self.request, start, end, self.sparse, self.loops)

    def drop(self, end: int) -> None:
        self.kv.drop_prefix(self.request.id, end)


def active_rows(
    r: Request, start: int, end: int, sparse: bool, loops: int
) -> list[torch.Tensor] | None:
    """Per depth [end - start] bool on the host: rows that computed that depth (prompt
    rows by the token-sparse schedule, generated rows by their exit depth); None if all
    did. A depth the prompt has not reached yet counts every row (nothing of it is stored
    yet)."""
    prompt = len(r.prompt)
    depths = []
    for depth in range(loops):
        if sparse and depth < len(r.schedule.active_history):
            prompt_part = r.schedule.active_on_host(depth)[start : min(end, prompt)]
        else:
            prompt_part = torch.ones(max(0, min(end, prompt) - start), dtype=torch.bool)
        exits = torch.tensor(r.exit_depths[max(start, prompt) - prompt : max(0, end - prompt)])
        depths.append(torch.cat([prompt_part, exits >= depth]))
    if all(bool(a.all()) for a in depths):
        return None
    return depths
