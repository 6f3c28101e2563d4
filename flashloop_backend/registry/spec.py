"""What a ``flashloop_backend.backends`` entry point provides: a backend spec.

The entry point names a zero-argument callable returning a :class:`BackendSpec`. The spec
declares capabilities and reasons as data; ``create`` builds the backend object the host
calls. The registry names that object only as :class:`BuiltBackend`: the interface hosts
call sits a layer above (``backends/base.py``), and the registry imports nothing of it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from flashloop_backend.capabilities import Capability, Environment, SupportRequest
from flashloop_backend.config import FlashLoopConfig

if TYPE_CHECKING:
    from flashloop_backend.registry import Registry


@dataclass(frozen=True)
class SelectionInfo:
    """vllm-rlt's selection record."""

    requested_backend: str
    selected_backend: str
    selection_reason: str


class BuiltBackend(Protocol):
    """What :meth:`BackendSpec.create` returns: every backend is an
    ``AttentionBackend`` (``backends/base.py``), the interface hosts call; the registry
    hands it over and reads only what it was built from."""

    config: FlashLoopConfig
    info: SelectionInfo


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
    ) -> BuiltBackend:
        """Build the backend object (only after ``not_supported_reasons`` returned none)."""

    def kernel_choices(
        self, request: SupportRequest, config: FlashLoopConfig, registry: Registry
    ) -> dict[str, str]:
        """op name -> kernel implementation this backend would use (for the effective config)."""
        return {}

    def kv_encoding(self, config: FlashLoopConfig) -> Mapping[str, str | int] | None:
        """The versioned packed-KV encoding descriptor this backend stores ``config``'s KV
        in (None: it stores none), for the effective config."""
        return None
