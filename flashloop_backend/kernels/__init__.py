"""Kernel ops, providers and implementations (torch reference, Triton, FlashInfer)."""

from flashloop_backend.kernels.ops import KernelImpl, KernelProvider, OpName, PagedAttention

__all__ = ["KernelImpl", "KernelProvider", "OpName", "PagedAttention"]
