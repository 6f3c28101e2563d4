"""Triton helpers for encoding v3 blocks (``kv.layout``): which channel each code a
reader holds belongs to, and codes to FP16 or FP32.

A reader keeps a row of D codes as two tiles of D/2, ``A`` and ``B``: column i of A is the
low nibble of byte i of the row, channel ``channel_a(i)`` = 32 m + 2 j + (0, 8, 1, 9)[i % 4]
for word w = i // 4 of lane segment j = w // (D/32), m = w % (D/32); column i of B is that
byte's high nibble, channel ``channel_a(i)`` + 16 (rows of 16 codes: byte b holds channels
b and b + 8). K's parameters are stored in the order the tensor-core reader takes its
pairs, bytes (0, 2, 1, 3) of each word: column i's sits at slot ``param_slot(i)``. On the
GPU (ASM) each byte becomes its two exact FP16 codes through a ``prmt``, a ``lop3`` and a
``sub`` per pair, elementwise whichever way Triton groups elements into registers; the
interpreter runs no PTX and masks the nibbles instead. B holds 16 c, not c: a reader folds
the 1/16 into its weights. A block of G tokens and D channels is D (G + 8) bytes: K codes
at 0, V codes at G D/2, K scales at G D, K minima at G D + 2 D, V records at G D + 4 D
(``kv.layout.PackedLayout``).
"""

import triton
import triton.language as tl

# four bytes ($4) -> their low nibbles c ($0, $1) and high nibbles as 16 c ($2, $3), FP16,
# output element e from input byte e: a prmt spreads bytes 0-1 and 2-3 over the halves of
# a register, a nibble ORed into the mantissa of 1024 (0x6400) is 1024 + c or 1024 + 16 c,
# and sub.f16x2 takes 1024 back
NIBBLES_ASM = tl.constexpr("""
{
.reg .b32 pair01, pair23, zero, magic;
mov.b32 zero, 0;
mov.b32 magic, 0x64006400;
prmt.b32 pair01, $4, zero, 0x4140;
prmt.b32 pair23, $4, zero, 0x4342;
lop3.b32 $0, pair01, 0x000F000F, magic, 0xEA;
lop3.b32 $1, pair23, 0x000F000F, magic, 0xEA;
lop3.b32 $2, pair01, 0x00F000F0, magic, 0xEA;
lop3.b32 $3, pair23, 0x00F000F0, magic, 0xEA;
sub.f16x2 $0, $0, magic;
sub.f16x2 $1, $1, magic;
sub.f16x2 $2, $2, magic;
sub.f16x2 $3, $3, magic;
}
""")
ONE_BITS = tl.constexpr(0x3F800000)  # FP32 1.0


@triton.jit
def channel_a(column, HEAD_DIM: tl.constexpr):
    """Channel of column ``column`` of A, the low nibble of byte ``column`` (B's is 16
    more; rows of 16 codes: 8 more)."""
    if HEAD_DIM < 32:  # rows of 16 codes: byte b holds channels b and b + 8
        return column
    word = column // 4
    lane, m = word // (HEAD_DIM // 32), word % (HEAD_DIM // 32)
    return 32 * m + 2 * lane + (column % 4) // 2 + 8 * (column % 2)


@triton.jit
def param_slot(column):
    """Where column ``column``'s K parameter sits among A's (B's: D/2 further): bytes
    (0, 2, 1, 3) of each word in turn (``kv.layout.param_channels``)."""
    return 4 * (column // 4) + 2 * (column % 2) + (column % 4) // 2


@triton.jit
def nibbles(byte, ASM: tl.constexpr):
    """uint8 codes -> (A, B) FP16 of the same shape: A the low nibbles' exact codes c, B
    the high nibbles' exact 16 c."""
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
    """uint8 codes -> (A, B) FP32 1 + c/16 of the low and high nibbles: the
    nibble written into the mantissa of 1.0 (no int-to-float convert). A reader folds the
    affine map around it: min + scale c = (min - 16 scale) + 16 scale (1 + c/16)."""
    word = byte.to(tl.int32)
    a = (((word & 15) << 19) | ONE_BITS).to(tl.float32, bitcast=True)
    b = (((word & 240) << 15) | ONE_BITS).to(tl.float32, bitcast=True)
    return a, b


@triton.jit
def per_row_column(per_group, owner, NG: tl.constexpr):
    """[G, NG] values per row and V group -> [G, D/2] per column ``owner``."""
    group = tl.arange(0, NG)
    out = tl.zeros([per_group.shape[0], owner.shape[0]], tl.float32)
    for g in tl.static_range(NG):
        column = tl.sum(tl.where(group[None, :] == g, per_group, 0.0), 1)
        out = tl.where(owner[None, :] == g, column[:, None], out)
    return out
