"""Kernel ops, providers and implementations (torch reference, Triton, FlashInfer)."""

from .ops import KernelImpl, KernelProvider, OpName, PagedAttention

__all__ = ["KernelImpl", "KernelProvider", "OpName", "PagedAttention"]
