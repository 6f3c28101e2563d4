"""Attention backends registered under ``flashloop_backend.backends``, and the typed
interface the host calls (:mod:`flashloop_backend.backends.base`)."""

from flashloop_backend.backends.base import (
    AttentionBackend,
    EngineCapacity,
    GraphStep,
    OutOfPackedPagesError,
    RequestKV,
)
from flashloop_backend.registry.spec import BackendSpec, SelectionInfo

__all__ = [
    "AttentionBackend",
    "BackendSpec",
    "EngineCapacity",
    "GraphStep",
    "OutOfPackedPagesError",
    "RequestKV",
    "SelectionInfo",
]
