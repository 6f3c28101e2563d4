"""Attention backends registered under ``flashloop_backend.backends``."""

from .base import BackendSpec, SelectionInfo

__all__ = ["BackendSpec", "SelectionInfo"]
