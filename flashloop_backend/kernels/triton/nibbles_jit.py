"""Triton helper: 4-bit codes to FP16 without an int-to-float convert.

One ``lop3`` ORs a nibble pair (bits 0-3 and 16-19, or 4-7 and 20-23) into the mantissa of
FP16 1024 (``0x6400``), giving 1024 + c for a low nibble and 1024 + 16 c for a high one;
one ``sub.f16x2`` per pair takes the 1024 back, exactly. A ``prmt`` first spreads bytes
0-1 and 2-3 of a word over the two halves of a register, so that output element i comes
from input byte i whichever way Triton groups elements into registers.
"""

import triton
import triton.language as tl

# four bytes ($4) -> low nibbles c ($0-$1) and high nibbles as 16 c ($2-$3), FP16
EXACT_NIBBLES_ASM = tl.constexpr("""
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


@triton.jit
def exact_nibbles(byte, ASM: tl.constexpr):
    """uint8 codes -> FP16 (low nibble c, high nibble times 16), same shape; ASM: the
    PTX conversion (GPU), else portable Triton (the interpreter runs no PTX)."""
    if ASM:
        low, high = tl.inline_asm_elementwise(
            EXACT_NIBBLES_ASM,
            "=r,=r,=r,=r,r",
            [byte],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=4,
        )
    else:
        low = (byte & 15).to(tl.float16)
        high = (byte & 240).to(tl.float16)
    return low, high
