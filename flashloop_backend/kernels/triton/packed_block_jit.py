"""Triton helpers for encoding v3 blocks (``kv.layout``): which channel each code a
reader holds belongs to, and codes to FP16 or FP32.

A reader keeps a row of D codes as two tiles of D/2, ``A`` and ``B``: column i of A is the
low nibble of byte 4 (i // 4) + (0, 2, 1, 3)[i % 4] of the row, channel ``channel_a(i)`` =
32 m + 2 j + (0, 1, 8, 9)[i % 4] for word w = i // 4 of lane segment j = w // (D/32),
m = w % (D/32); column i of B is that byte's high nibble, channel ``channel_a(i)`` + 16 (rows of 16
codes: byte b holds channels b and b + 8).
On the GPU (ASM) a row's bytes load in order and one ``lop3`` per pair turns a word into
those columns (``NIBBLES_ASM``); the interpreter runs no PTX, so the portable path loads
each word's bytes as (0, 2, 1, 3), where the low nibbles are A's columns and the high
ones B's. Both give the same A and B. B holds 16 c, not c: a reader folds the 1/16 into
its weights. A block of G tokens and D channels is D (G + 8) bytes: K codes at 0, V codes
at G D/2, K scales at G D, K minima at G D + 2 D, V records at G D + 4 D
(``kv.layout.PackedLayout``).
"""

import triton
import triton.language as tl

# one word (four bytes, $4) -> A's pairs ($0, $1): the low nibbles of bytes (0, 2) and
# (1, 3), and B's ($2, $3): their high nibbles times 16, FP16: a nibble ORed into the
# mantissa of 1024 (0x6400) is 1024 + c (low) or 1024 + 16 c (high); sub.f16x2 takes
# 1024 back
NIBBLES_ASM = tl.constexpr("""
{
.reg .b32 odd, magic;
mov.b32 magic, 0x64006400;
shr.b32 odd, $4, 8;
lop3.b32 $0, $4, 0x000F000F, magic, 0xEA;
lop3.b32 $1, odd, 0x000F000F, magic, 0xEA;
lop3.b32 $2, $4, 0x00F000F0, magic, 0xEA;
lop3.b32 $3, odd, 0x00F000F0, magic, 0xEA;
sub.f16x2 $0, $0, magic;
sub.f16x2 $1, $1, magic;
sub.f16x2 $2, $2, magic;
sub.f16x2 $3, $3, magic;
}
""")
ONE_BITS = tl.constexpr(0x3F800000)  # FP32 1.0


@triton.jit
def channel_a(column, HEAD_DIM: tl.constexpr):
    """Channel of column ``column`` of A (B's is ``high_offset`` more)."""
    if HEAD_DIM < 32:  # rows of 16 codes: byte b holds channels b and b + 8
        return code_columns(column, False)
    word = column // 4
    lane, m = word // (HEAD_DIM // 32), word % (HEAD_DIM // 32)
    return 32 * m + 2 * lane + column % 2 + 8 * ((column % 4) // 2)


@triton.jit
def code_columns(column, IN_ORDER: tl.constexpr):
    """Byte of a row that column ``column`` of A and B reads: in order for the PTX
    conversion (IN_ORDER), else as (0, 2, 1, 3) within each word."""
    if IN_ORDER:
        return column
    return 4 * (column // 4) + 2 * (column % 2) + (column % 4) // 2


@triton.jit
def nibbles(byte, ASM: tl.constexpr):
    """uint8 codes loaded by ``code_columns(., ASM)`` -> (A, B) FP16 of the same shape: A
    exact codes c, B exact 16 c."""
    if ASM:
        a, b = tl.inline_asm_elementwise(
            NIBBLES_ASM,
            "=r,=r,=r,=r,r",
            [byte],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
    else:
        a = (byte & 15).to(tl.float16)
        b = (byte & 240).to(tl.float16)
    return a, b


@triton.jit
def units(byte):
    """uint8 codes loaded by ``code_columns(., False)`` -> (A, B) FP32 1 + c/16: the
    nibble written into the mantissa of 1.0 (no int-to-float convert). A reader folds the
    affine map around it: min + scale c = (min - 16 scale) + 16 scale (1 + c/16)."""
    word = byte.to(tl.int32)
    a = (((word & 15) << 19) | ONE_BITS).to(tl.float32, bitcast=True)
    b = (((word & 240) << 15) | ONE_BITS).to(tl.float32, bitcast=True)
    return a, b
