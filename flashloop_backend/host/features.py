"""Engine-side settings of the FlashLoop features: geometry checks against the host and the
packed-KV bookkeeping (which rows to pack when, and which of them computed each depth)."""

from __future__ import annotations

import torch

from ..backends.packed_state import PackedState
from ..config import ConfigError
from .kvcache import OutOfBlocksError, PagedKVCache
from .requests import Request

# Rows packed per gather: the conversion copies the chunk's BF16 K/V of every layer and
# depth first (4,096 rows of Ouro-1.4B: 3.2 GB; a whole 32K prompt was 25.8 GB at once).
# A multiple of every group size (compact levels start a fresh page per chunk).
PACK_CHUNK_ROWS = 4096


def token_sparsity(backend, cfg, prefill_chunk: int):
    """The backend's token-sparse prefill settings, checked against the engine's geometry."""
    config = getattr(backend, "config", None)
    if config is None or not config.token_sparse_prefill.enabled:
        return None
    sparsity = config.token_sparse_prefill
    if config.num_loops != cfg.total_ut_steps:
        raise ConfigError(
            f"num_loops={config.num_loops} differs from the model's total_ut_steps={cfg.total_ut_steps}"
        )
    if prefill_chunk % sparsity.window_size:
        raise ConfigError(
            f"prefill_chunk={prefill_chunk} must hold whole selection windows: make it a multiple of "
            f"token_sparse_prefill.window_size={sparsity.window_size}"
        )
    return sparsity


def kv_quantization(backend, block_size: int):
    """The backend's KV quantization settings (or None), checked against the cache."""
    config = getattr(backend, "config", None)
    if config is None or not config.kv_residual_quantization.enabled:
        return None
    quant = config.kv_residual_quantization
    if quant.group_size % block_size:
        raise ConfigError(
            f"kv_residual_quantization.group_size={quant.group_size} must be a multiple of the "
            f"KV block_size={block_size}: packed groups free whole BF16 blocks"
        )
    return quant


def default_packed_pages(quant, num_blocks: int, block_size: int, loops: int) -> int:
    """Pages to pack the most tokens the BF16 pool holds (its blocks spread over every
    depth plane) at every depth: whatever request the BF16 pool can hold fits this pool."""
    tokens = num_blocks // loops * block_size
    bound = PackedState.page_bound(
        tokens, 0, loops, quant.group_size, quant.policy, quant.tail_size
    )
    return max(1, bound)


def refuse_unpackable(packed, prompt_length: int, max_new_tokens: int, loops: int) -> None:
    """Raise ``OutOfBlocksError`` for a request whose packed pages exceed the whole pool."""
    pages = packed.pages_needed(prompt_length, max_new_tokens, loops)
    if pages > packed.store.num_pages:
        raise OutOfBlocksError(
            f"a request of {prompt_length} prompt + {max_new_tokens} new tokens needs {pages} "
            f"packed KV pages but the whole packed pool has {packed.store.num_pages}; raise "
            f"packed_pages or shorten the request"
        )


def pack_rows(kv: PagedKVCache, packed, r: Request, end: int, sparse: bool, loops: int) -> None:
    """Pack rows [already packed, end) of every depth into ``packed`` (the backend's
    ``PackedState``) and free their BF16 blocks: the store becomes their only copy."""
    start = packed.packed_rows(r.id)
    if end <= start:
        return
    keys, values = kv.gather_planes(r.id, start, end)
    packed.append(r.id, keys, values, active_rows(r, start, end, sparse, loops, kv.key_pool.device))
    kv.drop_prefix(r.id, end)


def pack_prompt(kv: PagedKVCache, packed, r: Request, sparse: bool, loops: int,
                chunk: int = PACK_CHUNK_ROWS) -> None:  # fmt: skip
    """Encode a completed prompt's whole groups at every depth (all but the BF16 tail under
    ``rolling``), ``chunk`` rows at a time so the conversion peak stays bounded."""
    if chunk <= 0 or chunk % packed.group_size:
        raise ValueError(f"chunk={chunk} must be a multiple of group_size={packed.group_size}")
    end = packed.prompt_rows(len(r.prompt))
    for stop in range(packed.packed_rows(r.id) + chunk, end, chunk):
        pack_rows(kv, packed, r, stop, sparse, loops)
    pack_rows(kv, packed, r, end, sparse, loops)
    packed.prompt_packed(r.id)


def flush_tail(kv: PagedKVCache, packed, r: Request, sparse: bool, loops: int) -> None:
    """``rolling``: move whole groups of final rows from the BF16 tail to the store."""
    final_rows = len(r.prompt) + len(r.exit_depths)
    while packed.flush_due(r.id, final_rows):
        pack_rows(kv, packed, r, packed.packed_rows(r.id) + packed.group_size, sparse, loops)


def active_rows(
    r: Request, start: int, end: int, sparse: bool, loops: int, device
) -> list[torch.Tensor] | None:
    """Per depth [end - start] bool: rows that computed that depth (prompt rows by the
    token-sparse schedule, generated rows by their exit depth); None if all did."""
    prompt = len(r.prompt)
    depths = []  # built on the host, moved once decided
    for depth in range(loops):
        if sparse:
            prompt_part = r.schedule.active_history[depth][start : min(end, prompt)].cpu()
        else:
            prompt_part = torch.ones(max(0, min(end, prompt) - start), dtype=torch.bool)
        exits = torch.tensor(r.exit_depths[max(start, prompt) - prompt : max(0, end - prompt)])
        depths.append(torch.cat([prompt_part, exits >= depth]))
    if all(bool(a.all()) for a in depths):
        return None
    return [a.to(device) for a in depths]
