"""The ``torch`` dense reference backend: vllm-rlt's dense call surface on CPU and GPU.

No FlashLoop features: every row attends densely to its own depth plane. It is the
baseline the host's equivalence tests and the ``flashloop`` all-off path are checked
against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import __version__
from ..capabilities import Capability, Environment, SupportRequest, not_supported_reasons
from ..config import FlashLoopConfig
from ..dispatch import BatchView, RowMode
from ..kernels.torch_reference import SUPPORT, paged_attention
from .base import BackendSpec, SelectionInfo

if TYPE_CHECKING:
    from ..registry import Registry


class TorchDenseSpec(BackendSpec):
    name = "torch"
    version = __version__
    priority = 10
    description = "dense paged attention in plain torch (reference; CPU and GPU)"

    def capabilities(
        self, registry: Registry, config: FlashLoopConfig, env: Environment, device: str
    ) -> frozenset[Capability]:
        if SUPPORT.machine_reasons(device, env):
            return frozenset()
        return SUPPORT.capabilities_on(device)

    def not_supported_reasons(
        self, request: SupportRequest, config: FlashLoopConfig, registry: Registry, env: Environment
    ) -> list[str]:
        reasons = not_supported_reasons(SUPPORT, request, env)
        if config.enabled_features():
            reasons.append(
                f"FlashLoop features {list(config.enabled_features())} are enabled; "
                "the torch backend is dense only (use backend 'flashloop')"
            )
        return reasons

    def create(
        self,
        request: SupportRequest,
        config: FlashLoopConfig,
        registry: Registry,
        info: SelectionInfo,
    ) -> TorchDenseBackend:
        return TorchDenseBackend(SUPPORT.capabilities_on(request.device), info)


class TorchDenseBackend:
    def __init__(self, capabilities: frozenset[Capability], info: SelectionInfo) -> None:
        self.capabilities = capabilities
        self.info = info

    def __call__(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lengths: torch.Tensor,
        scale: float | None = None,
    ) -> torch.Tensor:
        """q [R, Hq, D], caches [NB, BS, Hkv, D], block_tables [R, MB], context_lengths [R]."""
        return paged_attention(q, key_cache, value_cache, block_tables, context_lengths, scale)

    def forward(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        view: BatchView,
        reference_ready: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Dense attention for every row of ``view``; inactive and padding rows get zeros."""
        modes = view.row_modes.long()
        skip = (modes == RowMode.INACTIVE) | (modes == RowMode.PAD)
        lengths = torch.where(skip, torch.zeros_like(view.context_lengths), view.context_lengths)
        return paged_attention(q, key_cache, value_cache, view.row_block_tables(), lengths, scale)


def factory() -> TorchDenseSpec:
    return TorchDenseSpec()
