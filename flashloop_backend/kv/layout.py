"""The byte layout of a packed page block, encoding v3 (DESIGN §4): one contiguous block
per (page, layer, KV head) of one level, G = ``group_size`` tokens, D = ``head_dim``:

  K codes   [G tokens][D/2 B]   token-major; K grouped per channel across the G tokens
  V codes   [G tokens][D/2 B]   token-major; V grouped per token across G channels
  K params  [scale x D][min x D]           FP16, in code-column order (below)
  V params  [G tokens][D/G groups][min, scale]  FP16: one record per token

A row's bytes hold two codes each, in an order made for tensor-core operands. The D/2
bytes of a row are four lane segments of D/8 bytes (lane j = 0..3 of a quad); word m of
segment j covers channels 32 m .. 32 m + 31, and its bytes 0..3 hold in their low nibbles
channels 32 m + 2 j + (0, 8, 1, 9) and in their high nibbles those + 16 (rows of 16
codes, too short for lane segments: byte b holds channels b and b + 8). One masked
``lop3`` of a word against 0x000F000F then yields channels (32 m + 2 j, + 1) as two FP16
halves, the word shifted by 8 yields (+ 8, + 9), and against 0x00F000F0 the same pairs
+ 16: exactly the B fragments lane j of an m16n8k16 ``mma`` needs for k-steps 2 m and
2 m + 1. A reader that does not use tensor cores holds a row as two tiles of D/2 codes:
column i of "A" is the low nibble of byte 4 (i // 4) + (0, 2, 1, 3)[i % 4] and column i
of "B" its high nibble (``param_channels`` gives their channels). K's scales and minima
are stored in that column order, A's D/2 then B's, so a reader loads them contiguously.
The order is this encoding's, fixed at write time; ``pack_row``, ``unpack_row`` and
``param_channels`` are its definition.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from flashloop_backend.device_copy import to_device

# channel of byte b's low nibble in a word, relative to 32 m + 2 j (the high nibble: + 16)
BYTE_CHANNEL = (0, 8, 1, 9)
# the bytes of a word in the order of a reader's columns (the lop3 halves' order)
COLUMN_BYTES = (0, 2, 1, 3)


def _check_dim(dim: int) -> None:
    if dim % 32 and dim != 16:
        raise ValueError(f"head_dim={dim} must be 16 or a multiple of 32 (4 lanes x 4-byte words)")


def high_offset(dim: int) -> int:
    """How many channels a byte's high nibble lies above its low one: 16, or for rows of
    16 codes (too short for lane segments; no tensor-core reader serves them) 8."""
    return 16 if dim >= 32 else dim // 2


def low_channel(byte: int, dim: int) -> int:
    """The channel in the low nibble of byte ``byte`` of a row of ``dim`` codes (rows of
    16 codes: byte b holds channels b and b + 8)."""
    if dim < 32:
        return byte
    segment = dim // 8
    lane, word, b = byte // segment, (byte % segment) // 4, byte % 4
    return 32 * word + 2 * lane + BYTE_CHANNEL[b]


@cache
def _channel_of_nibble(dim: int) -> tuple[int, ...]:
    """Channel of nibble n = 2 b + h (byte b, h 0 low / 1 high) of a row of ``dim`` codes."""
    high = high_offset(dim)
    return tuple(low_channel(b, dim) + high * h for b in range(dim // 2) for h in range(2))


def channel_of_nibble(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [dim]: the channel each nibble of a row holds, nibbles in byte order (low
    nibble of byte 0, high nibble of byte 0, low nibble of byte 1, ...)."""
    _check_dim(dim)
    return to_device(torch.tensor(_channel_of_nibble(dim), dtype=torch.long), device)


def column_byte(column: int) -> int:
    """The byte of a row that column ``column`` of A and B reads."""
    return 4 * (column // 4) + COLUMN_BYTES[column % 4]


@cache
def _param_channels(dim: int) -> tuple[int, ...]:
    columns = [low_channel(column_byte(i), dim) for i in range(dim // 2)]
    return (*columns, *(c + high_offset(dim) for c in columns))


def param_channels(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [dim]: the channel of each K parameter in a block (A's columns, then B's)."""
    _check_dim(dim)
    return to_device(torch.tensor(_param_channels(dim), dtype=torch.long), device)


def param_slot(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [dim]: where each channel's K parameter sits (the inverse of
    ``param_channels``)."""
    slots = torch.empty(dim, dtype=torch.long, device=device)
    slots[param_channels(dim, device)] = torch.arange(dim, device=device)
    return slots


def nibble_of_channel(dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """int64 [dim]: the nibble (2 byte + 0 low / 1 high) of a row that holds each channel."""
    order = channel_of_nibble(dim, device)
    nibbles = torch.empty_like(order)
    nibbles[order] = torch.arange(dim, device=order.device)
    return nibbles


def pack_row(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., D] (values 0..15, channel order) -> uint8 [..., D/2] in the v3 order."""
    nibbles = codes[..., channel_of_nibble(codes.shape[-1], codes.device)].to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_row(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., D/2] in the v3 order -> codes [..., D] (uint8, channel order)."""
    nibbles = torch.stack((packed & 15, packed >> 4), -1).flatten(-2)
    order = channel_of_nibble(nibbles.shape[-1], packed.device)
    codes = torch.empty_like(nibbles)
    codes[..., order] = nibbles
    return codes


@dataclass(frozen=True)
class PackedLayout:
    """Offsets and sizes of one v3 block, in bytes; every region starts 128-B aligned when
    ``head_dim`` is a multiple of 16 (D (G + 8) bytes in all)."""

    group_size: int
    head_dim: int

    def __post_init__(self) -> None:
        if (self.head_dim % 32 and self.head_dim != 16) or self.head_dim % self.group_size:
            raise ValueError(
                f"head_dim={self.head_dim} must be 16 or a multiple of 32, and a multiple of "
                f"group_size={self.group_size}"
            )

    @property
    def row_bytes(self) -> int:
        return self.head_dim // 2

    @property
    def v_codes(self) -> int:
        return self.group_size * self.row_bytes

    @property
    def k_params(self) -> int:
        return 2 * self.v_codes

    @property
    def v_params(self) -> int:
        return self.k_params + 4 * self.head_dim

    @property
    def v_groups(self) -> int:
        """V groups per token (each G channels)."""
        return self.head_dim // self.group_size

    @property
    def record_bytes(self) -> int:
        """Bytes of one token's V record: (min, scale) FP16 per V group."""
        return 4 * self.v_groups

    @property
    def block_bytes(self) -> int:
        return self.v_params + self.group_size * self.record_bytes

    # ---- views of blocks [..., block_bytes] uint8 (any leading shape)
    def k_code_bytes(self, blocks: torch.Tensor) -> torch.Tensor:
        """uint8 [..., G, D/2]."""
        return blocks[..., : self.v_codes].unflatten(-1, (self.group_size, self.row_bytes))

    def v_code_bytes(self, blocks: torch.Tensor) -> torch.Tensor:
        """uint8 [..., G, D/2]."""
        region = blocks[..., self.v_codes : self.k_params]
        return region.unflatten(-1, (self.group_size, self.row_bytes))

    def k_scale(self, blocks: torch.Tensor) -> torch.Tensor:
        """FP16 [..., D] in ``param_channels`` order (a view: needs a contiguous last axis)."""
        return blocks[..., self.k_params : self.k_params + 2 * self.head_dim].view(torch.float16)

    def k_min(self, blocks: torch.Tensor) -> torch.Tensor:
        """FP16 [..., D] in ``param_channels`` order."""
        return blocks[..., self.k_params + 2 * self.head_dim : self.v_params].view(torch.float16)

    def v_records(self, blocks: torch.Tensor) -> torch.Tensor:
        """FP16 [..., G, D/G, 2]: per token and V group (min, scale)."""
        region = blocks[..., self.v_params :].view(torch.float16)
        return region.unflatten(-1, (self.group_size, self.v_groups, 2))

    # ---- decoding
    def keys(self, blocks: torch.Tensor) -> torch.Tensor:
        """FP32 K [..., G, D] of blocks [..., block_bytes]."""
        codes = unpack_row(self.k_code_bytes(blocks)).float()
        slot = param_slot(self.head_dim, blocks.device)
        low = self.k_min(blocks)[..., slot].float()[..., None, :]
        return low + self.k_scale(blocks)[..., slot].float()[..., None, :] * codes

    def values(self, blocks: torch.Tensor) -> torch.Tensor:
        """FP32 V [..., G, D] of blocks [..., block_bytes]."""
        codes = unpack_row(self.v_code_bytes(blocks)).float()
        record = self.v_records(blocks).float().repeat_interleave(self.group_size, dim=-2)
        return record[..., 0] + record[..., 1] * codes
