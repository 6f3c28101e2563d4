"""Registers and innermost loops of the package's CUDA kernels in sm_90a SASS, with no GPU:
NVRTC (the library torch loads, or ``--nvrtc`` a ``libnvrtc.so`` such as the one in the
``nvidia-cuda-nvrtc`` wheel) compiles a kernel's source as the loader builds it, Triton's
bundled cuobjdump disassembles it, and ``sass_loops.innermost_loops`` gives each loop's
size and instruction mix (a loop's static size is what a warp issues per iteration).

    LD_LIBRARY_PATH=DIR python3 scripts/cuda_sass_loops.py packed_source HEAD_DIM=128 \\
        GROUP=64 LEVELS=2 WARPS=4 STAGES=2 PASS=1 [--nvrtc DIR/libnvrtc.so.13]

(DIR on the library path too: NVRTC loads its builtins library from there.)
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile

import triton

from flashloop_backend.kernels.cuda import loader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sass_loops import innermost_loops


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("source", help="a .cu file of kernels/cuda, without the suffix")
    parser.add_argument("defines", nargs="*", help="NAME=VALUE, as the wrapper defines them")
    parser.add_argument("--nvrtc", help="a libnvrtc.so to compile with")
    parser.add_argument("--loops", type=int, default=3, help="the largest loops to list")
    args = parser.parse_args()
    if args.nvrtc:
        library = ctypes.CDLL(args.nvrtc)
        loader._nvrtc = lambda: library
    header = "".join(f"#define {d.replace('=', ' ', 1)}\n" for d in args.defines)
    source = header + loader.inline_includes(f"{args.source}.cu", set())
    cubin = loader.compile_cubin(source, args.source, "sm_90a")
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True)
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    print(f"{args.source} {' '.join(args.defines)}")
    for kernel, registers in re.findall(r"Function (\w+):\s*\n?\s*REG:(\d+)", usage.stdout):
        print(f"  {kernel}: {registers} registers")
    count = len(re.findall(r"/\*[0-9a-f]{4,}\*/", sass))
    print(f"  {count} instructions")
    for loop in innermost_loops(sass)[: args.loops]:
        print(f"  loop {loop['start']:#x}-{loop['end']:#x}: {loop['instructions']} instructions")
        print(f"    {loop['mix']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
