"""Dense baseline backends: ``torch`` (reference), ``triton`` and ``flashinfer``.

Each is one kernel provider's ``dense_attention`` behind vllm-rlt's dense call surface,
with no FlashLoop features. They are the baselines every FlashLoop speed ratio is measured
against, and the host's dense paths.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .. import __version__
from ..capabilities import Capability, Environment, SupportRequest, not_supported_reasons
from ..config import FlashLoopConfig
from ..dispatch import BatchView, RowMode
from ..kernels.ops import KernelImpl, OpName
from .base import BackendSpec, DenseCallSurface, SelectionInfo

if TYPE_CHECKING:
    from ..registry import Registry


class DenseBackendSpec(BackendSpec):
    """A dense backend built from the ``dense_attention`` op of one kernel provider."""

    def __init__(self, name: str, provider: str, priority: int, description: str) -> None:
        self.name, self.provider, self.priority = name, provider, priority
        self.version, self.description = __version__, description

    def _impl(self, registry: Registry) -> tuple[KernelImpl | None, list[str]]:
        reasons = registry.kernel_reasons(self.provider, OpName.DENSE_ATTENTION, SupportRequest())
        if self.provider not in registry.kernels:
            return None, reasons
        return registry.kernels[self.provider].impls.get(OpName.DENSE_ATTENTION), reasons

    def capabilities(
        self, registry: Registry, config: FlashLoopConfig, env: Environment, device: str
    ) -> frozenset[Capability]:
        impl, _ = self._impl(registry)
        if impl is None or impl.support.machine_reasons(device, env):
            return frozenset()
        return impl.support.capabilities_on(device)

    def not_supported_reasons(
        self, request: SupportRequest, config: FlashLoopConfig, registry: Registry, env: Environment
    ) -> list[str]:
        impl, reasons = self._impl(registry)
        if impl is None:
            return [f"kernel provider {self.provider!r} is unusable: {'; '.join(reasons)}"]
        reasons = not_supported_reasons(impl.support, request, env)
        if config.enabled_features():
            reasons.append(
                f"FlashLoop features {list(config.enabled_features())} are enabled; "
                f"the {self.name} backend is dense only (use backend 'flashloop')"
            )
        return reasons

    def create(
        self,
        request: SupportRequest,
        config: FlashLoopConfig,
        registry: Registry,
        info: SelectionInfo,
    ) -> DenseBackend:
        impl, _ = self._impl(registry)
        assert impl is not None  # not_supported_reasons ran first
        return DenseBackend(impl, impl.support.capabilities_on(request.device), info)

    def kernel_choices(
        self, request: SupportRequest, config: FlashLoopConfig, registry: Registry
    ) -> dict[str, str]:
        return {OpName.DENSE_ATTENTION.value: self.provider}


class DenseBackend(DenseCallSurface):
    def __init__(
        self, impl: KernelImpl, capabilities: frozenset[Capability], info: SelectionInfo
    ) -> None:
        self.impl, self.capabilities, self.info = impl, capabilities, info
        self.dense_attention = impl.fn

    def graph_blockers(self) -> list[str]:
        """Why a CUDA graph cannot capture this backend's decode traversal (none: it can)."""
        if Capability.CUDA_GRAPHS in self.capabilities:
            return []
        return [
            f"dense_attention runs on {self.info.selected_backend!r}, which does not declare "
            f"{Capability.CUDA_GRAPHS.value!r} here (declared: {sorted(c.value for c in self.capabilities)})"
        ]

    def forward(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        view: BatchView,
        layer: int = 0,
        scale: float | None = None,
    ) -> torch.Tensor:
        """Dense attention for every row of ``view``; inactive and padding rows get zeros."""
        modes = view.row_modes.long()
        skip = (modes == RowMode.INACTIVE) | (modes == RowMode.PAD)
        lengths = torch.where(skip, torch.zeros_like(view.context_lengths), view.context_lengths)
        return self.impl.fn(q, key_cache, value_cache, view.row_block_tables(), lengths, scale)


def torch_factory() -> DenseBackendSpec:
    return DenseBackendSpec(
        "torch",
        "torch_reference",
        10,
        "dense paged attention in plain torch (reference; CPU and GPU)",
    )


def triton_factory() -> DenseBackendSpec:
    return DenseBackendSpec(
        "triton",
        "triton",
        80,
        "dense paged attention in Triton (GPU; split-K, FP32 online softmax)",
    )


def flashinfer_factory() -> DenseBackendSpec:
    return DenseBackendSpec(
        "flashinfer",
        "flashinfer",
        90,
        "dense paged attention through FlashInfer (GPU; optional extra)",
    )
