"""Registers and spills of the packed INT4 decode reader (or, ``--kernel selected``, the
selected-key kernel of the packed sparse ops) per launch shape, from ptxas on
the sm_90 PTX (no GPU needed; the reader's launch is the one its wrapper makes, specialized
as at run time (``recorded_launch.py``), the selected-key kernel's without the run-time
divisibility hints): a static check of the reader's register pressure, which
decides its occupancy (255 registers: at most 8 warps per SM) and its local-memory spill
traffic. Launch-shape timings belong to ``flashloop-backend bench packed`` on the H200.

    python3 scripts/kernel_registers.py [--levels 1,2,3,4] [--rows 64,32,16] [--warps 1,2,4]
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
    levels: int, rows: int, warps: int, kernel: str = "decode", by_channel: bool | None = None
) -> dict[str, int]:
    """ptxas -v figures of one variant (Ouro-1.4B shapes): the packed reader
    (``decode``, ``rows`` per step) or the selected-key kernel of the loop 3-4 correction
    (``selected``, ``rows`` positions per step; V read by channel as registered for the
    level count, or as ``by_channel`` says)."""
    if kernel == "decode":  # the wrapper's own launch, specialized as at run time
        fn, args, kwargs = packed_launch(levels)
        compiled = compile_launch(fn, args, {**kwargs, "ROWS": rows, "num_warps": warps})
    else:
        from flashloop_backend.kernels.triton.packed_selected_jit import (
            packed_selected_split_kernel as fn,
        )
        from flashloop_backend.kernels.triton.packed_sparse import V_BY_CHANNEL_BELOW

        if by_channel is None:
            by_channel = levels < V_BY_CHANNEL_BELOW

        shape = dict(GROUP_Q=1, HEAD_DIM=128, GROUP=64, BLOCK_SIZE=16, LEVELS=levels,
                     BLOCK_N=rows, FROM_LOGITS=False, V_BY_CHANNEL=by_channel)  # fmt: skip
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
    parser.add_argument("--rows", default="64,32,16")
    parser.add_argument("--warps", default="1,2,4")
    parser.add_argument("--kernel", choices=["decode", "selected"], default="decode",
                        help="decode: the packed reader; selected: the loop 3-4 correction's "
                        "selected-key kernel (--rows: positions per step)")  # fmt: skip
    args = parser.parse_args()
    print(f"{args.kernel}: levels rows warps registers spill_stores_B spill_loads_B")
    for levels in map(int, args.levels.split(",")):
        for rows in map(int, args.rows.split(",")):
            for warps in map(int, args.warps.split(",")):
                u = usage(levels, rows, warps, args.kernel)
                print(f"{levels:6d} {rows:4d} {warps:5d} {u['registers']:9d} "
                      f"{u['spill_store_bytes']:14d} {u['spill_load_bytes']:13d}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
