"""What a ``flashloop_backend.backends`` entry point provides: a backend spec.

The entry point names a zero-argument callable returning a :class:`BackendSpec`. The spec
declares capabilities and reasons as data; ``create`` builds the callable backend object.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..capabilities import Capability, Environment, SupportRequest
from ..config import FlashLoopConfig

if TYPE_CHECKING:
    from ..registry import Registry


@dataclass(frozen=True)
class SelectionInfo:
    """vllm-rlt's selection record."""

    requested_backend: str
    selected_backend: str
    selection_reason: str


class DenseCallSurface:
    """vllm-rlt's dense call surface, served by the backend's ``dense_attention`` kernel."""

    dense_attention: Any  # a PagedAttention implementation

    def __call__(
        self, q, key_cache, value_cache, block_tables, context_lengths, scale: float | None = None
    ):
        """q [R, Hq, D], caches [NB, BS, Hkv, D], block_tables [R, MB], context_lengths [R]."""
        return self.dense_attention(q, key_cache, value_cache, block_tables, context_lengths, scale)


class BackendSpec(ABC):
    """Declaration and factory of one attention backend."""

    name: str
    version: str
    priority: int  # auto tries higher priority first
    description: str = ""

    @abstractmethod
    def capabilities(
        self, registry: Registry, config: FlashLoopConfig, env: Environment, device: str
    ) -> frozenset[Capability]:
        """Capabilities this backend delivers on ``device`` of this machine."""

    @abstractmethod
    def not_supported_reasons(
        self, request: SupportRequest, config: FlashLoopConfig, registry: Registry, env: Environment
    ) -> list[str]:
        """Every reason this backend cannot serve ``request`` with ``config`` here."""

    @abstractmethod
    def create(
        self,
        request: SupportRequest,
        config: FlashLoopConfig,
        registry: Registry,
        info: SelectionInfo,
    ) -> Any:
        """Build the backend object (only after ``not_supported_reasons`` returned none)."""

    def kernel_choices(
        self, request: SupportRequest, config: FlashLoopConfig, registry: Registry
    ) -> dict[str, str]:
        """op name -> kernel implementation this backend would use (for the effective config)."""
        return {}
