"""vllm-rlt adapter for flashloop_backend's registry (see README.md)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

import torch

from flashloop_backend.capabilities import VLLM_RLT_FLAGS, Capability, SupportRequest
from flashloop_backend.config import FlashLoopConfig
from flashloop_backend.registry import AUTO, Registry

__version__ = "0.1.0"
VLLM_RLT_MODULE = "vllm_rlt.attention.backend"


@dataclass(frozen=True)
class BackendCapabilities:
    """vllm-rlt's three capability flags."""

    packed_prefill: bool
    cuda_graphs: bool
    async_scheduling: bool


@dataclass(frozen=True)
class BackendInfo:
    requested_backend: str
    selected_backend: str
    selection_reason: str


def _required(required_capabilities: Any) -> frozenset[Capability]:
    if required_capabilities is None:
        return frozenset()
    if all(hasattr(required_capabilities, flag.value) for flag in VLLM_RLT_FLAGS):
        return frozenset(f for f in VLLM_RLT_FLAGS if getattr(required_capabilities, f.value))
    if isinstance(required_capabilities, str | Capability):
        required_capabilities = [required_capabilities]
    names = []
    for item in required_capabilities:
        try:
            names.append(Capability(item))
        except ValueError:
            raise ValueError(
                f"unknown capability {item!r}; known: {[c.value for c in Capability]}"
            ) from None
    return frozenset(names)


class RegistryBackend:
    """A registry-selected backend behind vllm-rlt's call surface."""

    def __init__(self, inner: Any, capabilities: BackendCapabilities, info: BackendInfo) -> None:
        self._inner, self.capabilities, self.info = inner, capabilities, info

    def __call__(self, q, key_cache, value_cache, block_tables, context_lengths) -> torch.Tensor:
        """One query per row: q [R, Hq, D]; caches [NB, BS, Hkv, D]; block_tables [R, MB];
        context_lengths [R] (position + 1, 0 for padding rows)."""
        return self._inner(q, key_cache, value_cache, block_tables, context_lengths)

    def prefill(
        self, q, key_cache, value_cache, block_tables, context_lengths, cu_seqlens_q, max_seqlen_q
    ) -> torch.Tensor:
        """Packed prefill: sequence s owns q rows cu_seqlens_q[s]:cu_seqlens_q[s+1], which are
        its last (cu[s+1]-cu[s]) positions; block_tables [S, MB] and context_lengths [S] are
        per sequence. Expanded to per-row queries on the device (no host sync)."""
        rows = q.shape[0]
        counts = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
        seq_of_row = torch.repeat_interleave(
            torch.arange(counts.numel(), device=q.device), counts, output_size=rows
        )
        row_in_seq = torch.arange(rows, device=q.device) - cu_seqlens_q[:-1].long()[seq_of_row]
        first = context_lengths.long() - counts
        row_lengths = (first[seq_of_row] + row_in_seq + 1).to(context_lengths.dtype)
        return self._inner(q, key_cache, value_cache, block_tables[seq_of_row], row_lengths)


def create_backend(
    backend: str,
    device: str | torch.device,
    dtype: torch.dtype,
    head_dim: int,
    block_size: int,
    *,
    required_capabilities: Any = (),
    config: FlashLoopConfig | None = None,
    registry: Registry | None = None,
) -> RegistryBackend:
    """vllm-rlt's factory signature, resolved through flashloop_backend's registry."""
    registry = registry or Registry.discover()
    request = SupportRequest(
        device=torch.device(device).type, dtype=dtype, head_dim=head_dim, block_size=block_size,
        num_q_heads=1, num_kv_heads=1, required=_required(required_capabilities),
    )  # fmt: skip
    selection = registry.select_backend(backend, request, config or FlashLoopConfig())
    inner = selection.spec.create(request, config or FlashLoopConfig(), registry, selection.info)
    have = selection.spec.capabilities(
        registry, config or FlashLoopConfig(), registry.env, request.device
    )
    caps = BackendCapabilities(*(flag in have for flag in VLLM_RLT_FLAGS))
    info = BackendInfo(
        selection.info.requested_backend,
        selection.info.selected_backend,
        selection.info.selection_reason,
    )
    return RegistryBackend(inner, caps, info)


_ORIGINAL: dict[str, Any] = {}


def install(module: Any = None) -> None:
    """Route vllm-rlt's ``create_backend`` through the registry for the names it knows."""
    target = module or importlib.import_module(VLLM_RLT_MODULE)
    original = _ORIGINAL.setdefault(target.__name__, target.create_backend)

    def routed(backend, device, dtype, head_dim, block_size, *, required_capabilities=()):
        registry = Registry.discover()
        if backend == AUTO or backend in registry.backend_names():
            return create_backend(
                backend, device, dtype, head_dim, block_size,
                required_capabilities=required_capabilities, registry=registry,
            )  # fmt: skip
        return original(
            backend,
            device,
            dtype,
            head_dim,
            block_size,
            required_capabilities=required_capabilities,
        )

    target.create_backend = routed


def uninstall(module: Any = None) -> None:
    target = module or importlib.import_module(VLLM_RLT_MODULE)
    if target.__name__ in _ORIGINAL:
        target.create_backend = _ORIGINAL.pop(target.__name__)


__all__ = [
    "BackendCapabilities",
    "BackendInfo",
    "RegistryBackend",
    "create_backend",
    "install",
    "uninstall",
]
