"""Instructions per element of the decode readers' main loops, from the sm_90 SASS (no GPU
needed): each reader's wrapper runs on CPU tensors of Ouro-1.4B's shapes (8K context, one
row; the packed reader with a graph step's metadata widths) with its launches recorded,
the recorded launch is compiled for sm_90a as Triton's JIT would specialize it,
disassembled with the cuobjdump Triton bundles, and every innermost loop (a backward branch with no other loop inside) is
listed with its instruction mix. The main loop's static size x warps / elements per
iteration is the instructions per element a step issues (per 4-bit code for the packed
reader, per BF16 value for the dense kernel). With LEVELS > 1 the packed loop holds both
the dense- and the compact-level paths of each deeper level, of which a row runs one: its
static size overstates a dense read.

The issue-rate ceiling converts that into bytes per second: an H200 issues at most one
warp instruction per clock on each of 4 schedulers of 132 SMs (1.98 GHz boost), so a loop
of I warp instructions per element cannot stream faster than 132 x 4 x 1.98e9 / I elements
per second, whatever the memory does (2 bytes per BF16 value, half a byte per code).

    python3 scripts/sass_per_code.py [--levels 1,2,4] [--json sass_per_code.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton
from recorded_launch import Launches, compile_launch, ouro_caches, packed_launch
from sass_loops import innermost_loops

ISSUE_PER_S = 132 * 4 * 1.98e9  # H200: SMs x schedulers x boost clock
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def sass(fn, args: tuple, kwargs: dict) -> str:
    """SASS of ``fn`` compiled for this launch (:func:`compile_launch`)."""
    return disassemble(compile_launch(fn, args, kwargs))


def disassemble(compiled) -> str:
    """The SASS listing of a compiled Triton kernel (cuobjdump of its cubin)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run(
            [str(CUOBJDUMP), "-sass", cubin.name], capture_output=True, text=True, check=True
        ).stdout


def packed_reader(levels: int, context: int = 8192, half_products: bool = True) -> dict:
    """The packed reader of a graph step, one row whose whole ``context`` is packed."""
    fn, args, kwargs = packed_launch(levels, context, half_products)
    rows, warps = kwargs["GROUP"], kwargs["num_warps"]
    text = sass(fn, args, kwargs)
    # one step: a group's rows of K and V codes (128 channels each) at every level
    name = f"packed_decode{'' if half_products else ' fp32'} LEVELS={levels}"
    return _record(name, text, warps, rows * 128 * 2 * levels, 0.5, packed=True)


def bf16_reader(context: int = 8192) -> dict:
    import flashloop_backend.kernels.triton.paged_decode_jit as jit
    from flashloop_backend.kernels.triton.paged_decode import DEFAULT_TUNING, paged_attention_triton

    q, key_cache, value_cache, tables, lengths = ouro_caches(context, 1)
    with Launches(jit) as launches:
        paged_attention_triton(q, key_cache, value_cache, tables, lengths)
    args, kwargs = launches.first(jit.paged_attention_split_kernel)
    text = sass(jit.paged_attention_split_kernel, args, dict(kwargs))
    keys = DEFAULT_TUNING.keys_per_iter
    # one step: keys_per_iter keys of K and V (128 values each)
    return _record("paged_attention BF16", text, kwargs["num_warps"], keys * 256, 2)


def selected_keys(levels: int, block_n: int = 16, page_window: int = 16, warps: int = 4) -> dict:
    """The packed selected-key kernel of the loop 3-4 correction (``packed_sparse.py``),
    compiled for Ouro-1.4B shapes, dense levels: its main loop takes ``block_n`` keys, each
    with K and V codes at every level."""
    from compile_sm90 import SELECTED, TARGET, _signature
    from triton.compiler import ASTSource

    from flashloop_backend.kernels.triton.packed_selected_jit import (
        packed_selected_split_kernel as fn,
    )

    shape = dict(
        GROUP_Q=1,
        HEAD_DIM=128,
        GROUP=64,
        BLOCK_SIZE=16,
        LEVELS=levels,
        LP=max(2, 1 << (levels - 1).bit_length()),
        BLOCK_N=block_n,
        NPW=page_window,
        COMPACT_FROM=levels,
        FROM_LOGITS=False,
        ASM=True,
    )
    source = ASTSource(fn, _signature(fn, SELECTED, {"scale"}, shape), shape)
    text = disassemble(triton.compile(source, target=TARGET, options={"num_warps": warps}))
    loops = innermost_loops(text)[:1]
    instructions = loops[0]["instructions"]
    codes = block_n * 256 * levels  # K and V codes of block_n keys at every level
    return {
        "kernel": f"packed_selected LEVELS={levels} BLOCK_N={block_n} NPW={page_window}",
        "warps": warps,
        "elements_per_iteration": codes,
        "main_loop_instructions": instructions,
        "warp_instructions_per_element": instructions * warps / codes,
        "issue_ceiling_tb_s": ISSUE_PER_S / (instructions * warps / codes) * 0.5 / 1e12,
        "main_loop_mix": dict(
            sum((collections.Counter(loop["mix"]) for loop in loops), collections.Counter())
        ),
        "innermost_loops": [loop["instructions"] for loop in innermost_loops(text)],
    }


def _record(
    label: str, text: str, warps: int, elements: int, element_bytes: float, packed: bool = False
) -> dict:
    """The main loop's record: the largest innermost loop, or for a packed reader the one
    that converts codes (the most integer logic: the BF16 tail loop has little)."""
    loops = innermost_loops(text)
    if not loops:
        raise RuntimeError(f"{label}: no loop found in the SASS")
    main = loops[0]
    if packed:
        main = max(loops, key=lambda loop: loop["mix"].get("integer logic", 0))
    per = main["instructions"] * warps / elements
    return {
        "kernel": label,
        "warps": warps,
        "elements_per_iteration": elements,
        "element_bytes": element_bytes,
        "main_loop_instructions": main["instructions"],
        "warp_instructions_per_element": per,
        "issue_ceiling_tb_s": ISSUE_PER_S / per * element_bytes / 1e12,
        "main_loop_mix": main["mix"],
        "main_loop_top_opcodes": main["top_opcodes"],
        "innermost_loops": [loop["instructions"] for loop in loops],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,2,4")
    parser.add_argument("--json")
    parser.add_argument(
        "--selected", action="store_true", help="also the selected-key kernel at 3 and 4 levels"
    )
    args = parser.parse_args()
    records = [bf16_reader()] + [
        packed_reader(int(n), half_products=half)
        for half in (True, False)
        for n in args.levels.split(",")
    ]
    if args.selected:
        records += [selected_keys(levels) for levels in (3, 4)]
    for r in records:
        print(
            f"{r['kernel']:24s} warps={r['warps']} loop={r['main_loop_instructions']} instr, "
            f"{r['elements_per_iteration']} elements/iter: "
            f"{r['warp_instructions_per_element']:.3f} warp instr/element, issue ceiling "
            f"{r['issue_ceiling_tb_s']:.2f} TB/s; mix {r['main_loop_mix']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
