"""Registers and spills of the packed INT4 decode reader (or, ``--kernel selected``, the
selected-key kernel of the packed sparse ops) per launch shape, from ptxas on
the sm_90 PTX (no GPU needed; the reader's launch is the one its wrapper makes, specialized
as at run time (``recorded_launch.py``), the selected-key kernel's without the run-time
divisibility hints): a static check of the reader's register pressure, which
decides its occupancy (255 registers: at most 8 warps per SM) and its local-memory spill
traffic. Launch-shape timings belong to ``flashloop-backend bench packed`` on the H200.

    python3 scripts/kernel_registers.py [--levels 1,2,3,4] [--warps 2,4,8]
        [--kernel decode|selected]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import triton
from compile_sm90 import SELECTED, TARGET, _signature
from recorded_launch import compile_launch, packed_launch
from triton.compiler import ASTSource

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def usage(
    levels: int, warps: int, kernel: str = "decode", block_n: int = 16, page_window: int = 16
) -> dict[str, int]:
    """ptxas -v figures of one variant (Ouro-1.4B shapes): the packed reader (``decode``)
    or the selected-key kernel of the loop 3-4 correction (``selected``, ``block_n`` keys
    within ``page_window`` pages a block)."""
    if kernel == "decode":  # the wrapper's own launch, specialized as at run time
        fn, args, kwargs = packed_launch(levels)
        compiled = compile_launch(fn, args, {**kwargs, "num_warps": warps})
    else:
        from flashloop_backend.kernels.triton.packed_selected_jit import (
            packed_selected_split_kernel as fn,
        )

        shape = dict(GROUP_Q=1, HEAD_DIM=128, GROUP=64, BLOCK_SIZE=16, LEVELS=levels,
                     LP=max(2, 1 << (levels - 1).bit_length()), BLOCK_N=block_n,
                     NPW=page_window, COMPACT_FROM=levels, FROM_LOGITS=False, ASM=True)  # fmt: skip
        compiled = triton.compile(ASTSource(fn, _signature(fn, SELECTED, {"scale"}, shape), shape),
                                  target=TARGET, options={"num_warps": warps})  # fmt: skip
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
        ptx.write(compiled.asm["ptx"])
        ptx.flush()
        log = subprocess.run([str(PTXAS), "-v", "--gpu-name", "sm_90a", ptx.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr  # fmt: skip

    def number(pattern: str) -> int:
        found = re.search(pattern, log)
        return int(found.group(1)) if found else 0

    return {"registers": number(r"Used (\d+) registers"),
            "spill_store_bytes": number(r"(\d+) bytes spill stores"),
            "spill_load_bytes": number(r"(\d+) bytes spill loads")}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,2,3,4")
    parser.add_argument("--warps", default="2,4,8")
    parser.add_argument("--kernel", choices=["decode", "selected"], default="decode",
                        help="decode: the packed reader; selected: the loop 3-4 correction's "
                        "selected-key kernel")  # fmt: skip
    args = parser.parse_args()
    print(f"{args.kernel}: levels warps registers spill_stores_B spill_loads_B")
    for levels in map(int, args.levels.split(",")):
        for warps in map(int, args.warps.split(",")):
            u = usage(levels, warps, args.kernel)
            print(f"{levels:6d} {warps:5d} {u['registers']:9d} "
                  f"{u['spill_store_bytes']:14d} {u['spill_load_bytes']:13d}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
