"""Compile the packed-KV and selection Triton kernels for sm_90 (H100/H200) on a machine
without a GPU: the interpreter does not catch what only the GPU front end rejects (a
reshape shape built from a tensor once kept a design from compiling there). Prints one
line per variant; exits 1 if any fails.

    python3 scripts/compile_sm90.py
"""

from __future__ import annotations

import os
import sys

os.environ.pop("TRITON_INTERPRET", None)

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)


def _signature(fn, pointers: dict[str, str], floats: set[str], constexprs: dict) -> dict:
    out = {}
    for name in fn.arg_names:
        if name in constexprs:
            out[name] = "constexpr"
        elif name.endswith("_ptr"):
            out[name] = pointers.get(name, "*fp32")
        elif name in floats:
            out[name] = "fp32"
        else:
            out[name] = "i32"
    return out


def _compile(
    label: str, fn, pointers: dict[str, str], floats: set[str], constexprs: dict, warps: int
) -> bool:
    try:
        source = ASTSource(fn, _signature(fn, pointers, floats, constexprs), constexprs)
        triton.compile(source, target=TARGET, options={"num_warps": warps})
    except Exception as exc:  # report every variant, then fail
        print(f"FAIL {label}: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        return False
    print(f"ok   {label}")
    return True


def main() -> int:
    from flashloop_backend.kernels.triton.packed_decode_jit import packed_decode_split_kernel
    from flashloop_backend.kernels.triton.packed_gather_jit import packed_gather_kernel
    from flashloop_backend.kernels.triton.select_jit import select_statistics_kernel

    store = {"kc_ptr": "*u8", "vc_ptr": "*u8", "kmin_ptr": "*fp16", "kscale_ptr": "*fp16",
             "vmin_ptr": "*fp16", "vscale_ptr": "*fp16", "level_tables_ptr": "*i32",
             "level_maps_ptr": "*i32", "level_kinds_ptr": "*i32", "packed_ptr": "*i32",
             "k_ptr": "*bf16", "v_ptr": "*bf16", "tables_ptr": "*i32", "lengths_ptr": "*i32",
             "q_ptr": "*bf16", "positions_ptr": "*i32", "out_k_ptr": "*bf16", "out_v_ptr": "*bf16"}  # fmt: skip
    ok = True
    for levels in (1, 2, 4):
        for logits in (False, True):
            shape = dict(
                GROUP_Q=1, HEAD_DIM=128, GROUP=64, BLOCK_SIZE=16, LEVELS=levels, STORE_LOGITS=logits
            )
            ok &= _compile(f"packed_decode LEVELS={levels} STORE_LOGITS={logits}",
                           packed_decode_split_kernel, store, {"scale"}, shape, 1 if levels <= 2 else 2)  # fmt: skip
    for levels in (1, 4):
        shape = dict(GROUP_Q=1, HEAD_DIM=128, GROUP=64, BLOCK_SIZE=16, LEVELS=levels, BLOCK_N=32)
        ok &= _compile(
            f"packed_gather LEVELS={levels}", packed_gather_kernel, store, set(), shape, 4
        )
    select = {"logits_ptr": "*fp32", "lse_ptr": "*fp32", "lengths_ptr": "*i32", "v_ptr": "*bf16",
              "tables_ptr": "*i32", "output_ptr": "*fp32", "out_ptr": "*bf16", "idx_ptr": "*i32",
              "mass_ptr": "*fp32", "contrib_ptr": "*fp32", "scratch_ptr": "*i32"}  # fmt: skip
    for contribute in (True, False):
        shape = dict(GROUP=1, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK=1024, RADIX_BITS=8, SAMPLE=4096,
                     CANDIDATES=4096, CONTRIBUTE=contribute)  # fmt: skip
        ok &= _compile(
            f"select_statistics CONTRIBUTE={contribute}",
            select_statistics_kernel,
            select,
            set(),
            shape,
            8,
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
