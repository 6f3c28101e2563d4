"""flashloop_backend: FlashLoop as a pluggable attention backend for looped language models.

The face: configure (:class:`FlashLoopConfig`, :func:`load_config`), ask what a machine
can serve (:class:`SupportRequest`, :class:`Capability`, :func:`select_backend`,
:func:`resolve`), build a backend (:func:`create_backend`), and run a model through the
host (:class:`LLM`). Names that need torch load on first use, so importing the package
(and the CLI's ``--help``) stays fast.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from flashloop_backend._version import __version__
from flashloop_backend.config import (
    ConfigError,
    EffectiveConfig,
    FlashLoopConfig,
    UnservableError,
    load_config,
)

_LAZY = {
    "Capability": "flashloop_backend.capabilities",
    "SupportRequest": "flashloop_backend.capabilities",
    "RowMode": "flashloop_backend.dispatch",
    "Registry": "flashloop_backend.registry",
    "create_backend": "flashloop_backend.registry",
    "resolve": "flashloop_backend.registry",
    "select_backend": "flashloop_backend.registry",
    "LLM": "flashloop_backend.host.llm",
    "SamplingParams": "flashloop_backend.host.requests",
    "embedded_model_path": "flashloop_backend.host.embedded",
}

__all__ = [
    "ConfigError",
    "EffectiveConfig",
    "FlashLoopConfig",
    "UnservableError",
    "__version__",
    "load_config",
    *sorted(_LAZY),
]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_LAZY[name]), name)
