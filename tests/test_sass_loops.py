"""The SASS loop finder of scripts/sass_per_code.py (scripts/sass_loops.py) on a hand-written listing: the
innermost loop is the backward branch with no other loop inside (not the outer loop, not
the branch-to-itself that ends every kernel), NOPs are not counted."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E.U8 R4, desc[UR6][R2.64] ;
        /*0020*/                   LOP3.LUT R5, R4, 0xf, RZ, 0xc0, !PT ;
        /*0030*/                   SHF.R.U32.HI R6, RZ, 0x4, R4 ;
        /*0040*/                   FFMA R7, R5, R6, R7 ;
        /*0050*/                   NOP ;
        /*0060*/               @P0 BRA 0x10 ;
        /*0070*/                   IADD3 R8, R8, 0x1, RZ ;
        /*0080*/              @!P1 BRA 0x10 ;
        /*0090*/                   EXIT ;
        /*00a0*/                   BRA 0xa0;
"""


def test_the_innermost_loop_is_found_with_its_mix():
    from sass_loops import innermost_loops

    loops = innermost_loops(LISTING)
    assert [(loop["start"], loop["end"]) for loop in loops] == [(0x10, 0x60)]
    main = loops[0]
    assert main["instructions"] == 5  # LDG, LOP3, SHF, FFMA, BRA (the NOP left out)
    assert main["mix"]["global load"] == 1 and main["mix"]["fp32 math"] == 1
