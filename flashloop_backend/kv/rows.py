"""Rows of K and V at one depth, wherever they live: contiguous tensors, or in place in the
host's paged BF16 pools. The packed store encodes from either; a level writer that reads
the pools in place (the Triton one) needs no gathered copy of the prompt."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KVRows:
    """Rows [0, count) of K and V at one depth.

    keys / values [NB, L, BS, Hkv, D]: blocks of ``BS`` rows (paged pools, or one block of
    ``count`` rows for contiguous tensors); blocks [ceil(count / BS)] int64: the blocks
    holding the rows, in row order (row r is row r % BS of block blocks[r // BS]). Build
    with :meth:`contiguous` or :meth:`paged`."""

    keys: torch.Tensor
    values: torch.Tensor
    blocks: torch.Tensor
    count: int

    def __post_init__(self) -> None:
        if self.keys.dim() != 5 or self.values.shape != self.keys.shape:
            raise ValueError(
                "keys / values must be [blocks, L, block_size, Hkv, D] pools of one shape; got "
                f"{tuple(self.keys.shape)} / {tuple(self.values.shape)}"
            )
        if self.keys.stride(-1) != 1 or self.values.stride() != self.keys.stride():
            raise ValueError("keys / values need unit stride on D and the same strides")
        if self.blocks.dtype != torch.int64:  # block x block stride overflows 32 bits
            raise ValueError(f"blocks must be int64; got {self.blocks.dtype}")
        needed = -(-self.count // self.block_size) if self.count > 0 else 0
        if self.count < 0 or self.blocks.shape != (needed,):
            raise ValueError(
                f"{self.count} rows in blocks of {self.block_size} need blocks [{needed}]; "
                f"got {tuple(self.blocks.shape)}"
            )
        devices = {self.keys.device, self.values.device, self.blocks.device}
        if len(devices) != 1:
            raise ValueError(f"K, V and blocks span devices {sorted(map(str, devices))}")

    @staticmethod
    def contiguous(keys: torch.Tensor, values: torch.Tensor) -> KVRows:
        """Rows given as keys / values [T, L, Hkv, D] (one block of T rows)."""
        if keys.dim() != 4 or values.shape != keys.shape:
            raise ValueError(
                f"K/V rows must be [T, L, Hkv, D] of one shape; got {tuple(keys.shape)} / "
                f"{tuple(values.shape)}"
            )
        if keys.stride(-1) != 1 or values.stride() != keys.stride():
            keys, values = keys.contiguous(), values.contiguous()
        as_block = [t.permute(1, 0, 2, 3).unsqueeze(0) for t in (keys, values)]
        blocks = torch.zeros(1 if keys.shape[0] else 0, dtype=torch.long, device=keys.device)
        return KVRows(as_block[0], as_block[1], blocks, keys.shape[0])

    @staticmethod
    def paged(
        key_pool: torch.Tensor, value_pool: torch.Tensor, blocks: torch.Tensor, count: int
    ) -> KVRows:
        """Rows [0, count) of a paged plane: pools [NB, L, BS, Hkv, D], its blocks in order."""
        return KVRows(key_pool, value_pool, blocks, count)

    @property
    def block_size(self) -> int:
        return self.keys.shape[2]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """[T, L, Hkv, D] of the rows."""
        _, layers, _, heads, dim = self.keys.shape
        return self.count, layers, heads, dim

    @property
    def device(self) -> torch.device:
        return self.keys.device

    def gather(self, layers: slice = slice(None)) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the rows' K and V at ``layers``: each [T, Lb, Hkv, D]."""
        offsets = torch.arange(self.count, device=self.device)
        blocks = self.blocks[offsets // self.block_size]
        within = offsets % self.block_size
        return (
            self.keys[:, layers][blocks, :, within],
            self.values[:, layers][blocks, :, within],
        )
