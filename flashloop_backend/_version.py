"""The installed distribution's version (the source tree's when it is not installed)."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("flashloop-backend")
except PackageNotFoundError:
    __version__ = "0.1.0"
