"""Host tensors onto the device without waiting for it.

A copy from pageable host memory to a GPU returns only once the copy is done, and the
copy is ordered after everything already queued on the stream, so the host waits for
the device to drain its queue. Planning code (block tables, page lists, row maps) that
copies that way cannot run ahead of the kernels it plans for. Through pinned memory the
copy is asynchronous and the host goes on.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``tensor`` (on the host) on ``device``: to a GPU through a pinned copy of it and an
    asynchronous copy (the pinned buffer is kept until the copy has run, and the caller
    may change ``tensor`` at once); elsewhere a plain ``to``."""
    device = torch.device(device)
    if device.type != "cuda" or tensor.device.type != "cpu":
        return tensor.to(device)
    return _staged(tensor).to(device, non_blocking=True)


def copy_into(target: torch.Tensor, source: torch.Tensor) -> None:
    """``target[...] = source`` for a ``source`` on the host: into a GPU ``target`` through
    a pinned copy and an asynchronous copy on the current stream (the caller may change
    ``source`` at once), elsewhere a plain copy."""
    if target.device.type != "cuda" or source.device.type != "cpu":
        target.copy_(source)
        return
    target.copy_(_staged(source.to(target.dtype)), non_blocking=True)


def _staged(tensor: torch.Tensor) -> torch.Tensor:
    """A pinned copy of host ``tensor`` that nothing else writes: the caching host allocator
    keeps it until the copies queued from it have run."""
    if tensor.is_pinned():
        return torch.empty_like(tensor, pin_memory=True).copy_(tensor)
    return tensor.pin_memory()
