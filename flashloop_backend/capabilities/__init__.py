"""Capabilities as data: names, declarations and ``not_supported_reasons``."""

from flashloop_backend.capabilities.names import VLLM_RLT_FLAGS, Capability
from flashloop_backend.capabilities.support import (
    Environment,
    Support,
    SupportRequest,
    dtype_name,
    module_available,
    not_supported_reasons,
)

__all__ = [
    "VLLM_RLT_FLAGS",
    "Capability",
    "Environment",
    "Support",
    "SupportRequest",
    "dtype_name",
    "module_available",
    "not_supported_reasons",
]
