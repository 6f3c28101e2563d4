"""flashloop_backend: FlashLoop as a pluggable attention backend for looped language models."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("flashloop-backend")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.1.0"

from .config import ConfigError, EffectiveConfig, FlashLoopConfig, load_config


def embedded_model_path():
    """Directory of the embedded default model (Ouro layout, byte-level, 4 loops)."""
    from .host.commands import embedded_model_path as path

    return path()


__all__ = [
    "ConfigError",
    "EffectiveConfig",
    "FlashLoopConfig",
    "__version__",
    "embedded_model_path",
    "load_config",
]
