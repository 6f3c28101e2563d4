"""Compile every Triton kernel of the package for sm_90 (H100/H200) on a machine
without a GPU: the interpreter does not catch what only the GPU front end rejects (a
reshape shape built from a tensor, for one). Prints one line per variant; exits 1 if any
fails.

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


# pointer types of the packed-KV kernels' arguments (others default to *fp32)
STORE = {
    "codes_ptr": "*u8",
    "halves_ptr": "*fp16",
    "level_tables_ptr": "*i32",
    "level_maps_ptr": "*i32",
    "level_kinds_ptr": "*i32",
    "packed_ptr": "*i32",
    "k_ptr": "*bf16",
    "v_ptr": "*bf16",
    "tables_ptr": "*i32",
    "lengths_ptr": "*i32",
    "q_ptr": "*bf16",
    "positions_ptr": "*i32",
    "out_k_ptr": "*bf16",
    "out_v_ptr": "*bf16",
    "selected_ptr": "*u8",
}
SELECTED = {
    **STORE,
    "idx_ptr": "*i32",
    "lse_ptr": "*fp32",
    "part_out_ptr": "*fp32",
    "part_max_ptr": "*fp32",
    "part_sum_ptr": "*fp32",
}


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
    from flashloop_backend.kernels.triton.packed_decode import DEFAULT_TUNING, TAIL_ROWS
    from flashloop_backend.kernels.triton.packed_decode_jit import packed_decode_split_kernel
    from flashloop_backend.kernels.triton.packed_selected_jit import packed_selected_split_kernel
    from flashloop_backend.kernels.triton.packed_sparse import (
        BLOCK_N,
        PAGE_WINDOW,
        SELECTED_WARPS,
    )
    from flashloop_backend.kernels.triton.select_jit import select_statistics_kernel

    ok = True
    # the streaming reader: plain reads of dense levels at 1, 2 and 4 levels, the loop-2
    # read with logits, and 4 levels with compact ones from level 3 (token-sparse depths)
    for levels, logits, compact_from in ((1, False, 1), (2, False, 2), (4, False, 4),
                                         (2, True, 2), (4, False, 3)):  # fmt: skip
        shape = dict(
            GROUP_Q=1,
            HEAD_DIM=128,
            GROUP=64,
            BLOCK_SIZE=16,
            LEVELS=levels,
            LEVELS_PAD=max(2, 1 << (levels - 1).bit_length()),
            COMPACT_FROM=compact_from,
            TAIL=TAIL_ROWS,
            STORE_LOGITS=logits,
            HALF=DEFAULT_TUNING.half_products and not logits,
            ASM=True,
        )
        ok &= _compile(
            f"packed_decode LEVELS={levels} STORE_LOGITS={logits} COMPACT_FROM={compact_from}",
            packed_decode_split_kernel,
            STORE,
            {"scale"},
            shape,
            DEFAULT_TUNING.num_warps,
        )
    # the selected-key kernel: the loop-2 contribution (two levels, from logits) and the
    # loop 3-4 corrections (three and four levels, a compact fourth)
    for levels, from_logits, compact_from in ((2, True, 2), (3, False, 3), (4, False, 3)):
        shape = dict(
            GROUP_Q=1,
            HEAD_DIM=128,
            GROUP=64,
            BLOCK_SIZE=16,
            LEVELS=levels,
            LP=max(2, 1 << (levels - 1).bit_length()),
            BLOCK_N=BLOCK_N,
            NPW=PAGE_WINDOW,
            COMPACT_FROM=compact_from,
            FROM_LOGITS=from_logits,
            ASM=True,
        )
        ok &= _compile(
            f"packed_selected LEVELS={levels} FROM_LOGITS={from_logits}",
            packed_selected_split_kernel,
            SELECTED,
            {"scale"},
            shape,
            SELECTED_WARPS,
        )
    select = {
        "logits_ptr": "*fp32",
        "lse_ptr": "*fp32",
        "lengths_ptr": "*i32",
        "v_ptr": "*bf16",
        "tables_ptr": "*i32",
        "output_ptr": "*fp32",
        "out_ptr": "*bf16",
        "idx_ptr": "*i32",
        "mass_ptr": "*fp32",
        "contrib_ptr": "*fp32",
        "scratch_ptr": "*i32",
    }
    for contribute in (True, False):
        shape = dict(
            GROUP=1,
            HEAD_DIM=128,
            BLOCK_SIZE=16,
            BLOCK=1024,
            RADIX_BITS=8,
            SAMPLE=4096,
            CANDIDATES=4096,
            CONTRIBUTE=contribute,
        )
        ok &= _compile(
            f"select_statistics CONTRIBUTE={contribute}",
            select_statistics_kernel,
            select,
            set(),
            shape,
            8,
        )
    ok &= _threshold_selection()
    ok &= _dense_kernels()
    ok &= _layer_kernels()
    return 0 if ok else 1


def _layer_kernels() -> bool:
    """The model's fused per-layer kernels at Ouro-1.4B shapes (hidden 2048, 16 + 16 heads
    of 128, intermediate 5632), bf16 activations."""
    from flashloop_backend.host.layer_ops_jit import (
        add_rmsnorm_kernel,
        kv_write_kernel,
        rope_qk_kernel,
        silu_mul_kernel,
        small_rows_linear_kernel,
    )

    bf16 = {
        name: "*bf16"
        for name in (
            "h_ptr",
            "x_ptr",
            "x_weight_ptr",
            "next_weight_ptr",
            "h_out_ptr",
            "y_ptr",
            "qkv_ptr",
            "q_ptr",
            "k_ptr",
            "v_ptr",
            "gate_up_ptr",
            "out_ptr",
            "key_cache_ptr",
            "value_cache_ptr",
            "w_ptr",
        )
    }
    pointers = {**bf16, "cos_ptr": "*fp32", "sin_ptr": "*fp32", "slots_ptr": "*i64"}
    ok = True
    for has_x in (True, False):
        ok &= _compile(
            f"add_rmsnorm HAS_X={has_x}",
            add_rmsnorm_kernel,
            pointers,
            {"eps"},
            dict(HAS_X=has_x, BLOCK=2048),
            4,
        )
    rope = dict(Q_HEADS=16, KV_HEADS=16, HEADS_PAD=32, HEAD_DIM=128)
    ok &= _compile("rope_qk", rope_qk_kernel, pointers, set(), rope, 4)
    ok &= _compile("silu_mul", silu_mul_kernel, pointers, set(), dict(BLOCK=1024), 4)
    ok &= _compile("kv_write", kv_write_kernel, pointers, set(), dict(WIDTH=2048), 4)
    for rows_pad, use_dot in ((1, False), (16, True)):
        linear = dict(
            ROWS_PAD=rows_pad, BLOCK_N=16, BLOCK_K=256, USE_DOT=use_dot, DOT_PRECISION="tf32"
        )
        ok &= _compile(
            f"small_rows_linear USE_DOT={use_dot}",
            small_rows_linear_kernel,
            pointers,
            set(),
            linear,
            4,
        )
    return ok


def _threshold_selection() -> bool:
    """The registered selection's six kernels at the registered launch
    (``threshold_select.py``)."""
    from flashloop_backend.kernels.triton import source_values_jit as values_jit
    from flashloop_backend.kernels.triton import threshold_select_jit as jit
    from flashloop_backend.kernels.triton.threshold_select import DEFAULT_SELECT as tuning

    fp32 = ("logits_ptr", "lse_ptr", "output_ptr", "mass_ptr", "contrib_ptr")
    partials = ("part_mass_ptr", "part_contrib_ptr", "part_out_ptr")
    pointers = {name: "*fp32" for name in (*fp32, *partials)}
    for name in ("lengths_ptr", "bracket_ptr", "counter_ptr", "above_ptr", "cand_key_ptr"):
        pointers[name] = "*i32"
    for name in ("cand_pos_ptr", "plan_ptr", "offsets_ptr", "tables_ptr", "idx_ptr"):
        pointers[name] = "*i32"
    pointers |= {"v_ptr": "*bf16", "out_ptr": "*bf16"}
    blocks = dict(BLOCK=tuning.block, CANDIDATES=tuning.candidates)
    variants = [
        (
            "bracket",
            jit.select_bracket_kernel,
            dict(SAMPLE=tuning.sample, BITS=tuning.bracket_bits, RADIX_BITS=tuning.radix_bits),
            tuning.search_warps,
        ),
        ("candidates", jit.select_candidates_kernel, blocks, tuning.num_warps),
        (
            "threshold",
            jit.select_threshold_kernel,
            dict(blocks, RADIX_BITS=tuning.radix_bits, SPLITS_PAD=64),
            tuning.search_warps,
        ),
        (
            "finish",
            values_jit.select_finish_kernel,
            dict(HEAD_DIM=128, SPLITS_PAD=64, VALUE_SPLITS_PAD=16, VALUES=True),
            4,
        ),
        (
            "values",
            values_jit.source_values_kernel,
            dict(
                GROUP=1,
                GROUP_PAD=16,
                HEAD_DIM=128,
                BLOCK_SIZE=16,
                BLOCK_N=tuning.value_block,
                USE_DOT=True,
                DOT_PRECISION="tf32",
            ),
            4,
        ),
        ("compact", jit.select_compact_kernel, dict(BLOCK=tuning.compact_block), tuning.num_warps),
    ]
    ok = True
    for label, fn, shape, warps in variants:
        ok &= _compile(f"select {label}", fn, pointers, set(), shape, warps)
    return ok


def _dense_kernels() -> bool:
    """The paged decode (with and without logits), split merge, sparse correction, tiled
    prefill and quantize kernels at their registered launch shapes."""
    from flashloop_backend.kernels.triton.paged_decode_jit import (
        merge_splits_kernel,
        paged_attention_split_kernel,
    )
    from flashloop_backend.kernels.triton.quantize_jit import quantize_int4_kernel
    from flashloop_backend.kernels.triton.sparse_decode_jit import sparse_correction_split_kernel
    from flashloop_backend.kernels.triton.sparse_prefill_jit import sparse_prefill_kernel

    paged = {
        "q_ptr": "*bf16",
        "k_ptr": "*bf16",
        "v_ptr": "*bf16",
        "tables_ptr": "*i32",
        "lengths_ptr": "*i32",
        "spans_ptr": "*i32",
        "idx_ptr": "*i32",
        "tile_start_ptr": "*i32",
        "num_tiles_ptr": "*i32",
    }
    ok = True
    for logits, values, rows in (
        (False, True, 1),
        (True, True, 1),
        (True, False, 1),
        (False, True, 4),
    ):
        shape = dict(
            ROWS=rows,
            GROUP=1,
            GROUP_PAD=16,
            HEAD_DIM=128,
            BLOCK_SIZE=16,
            PAGES=4,
            USE_DOT=True,
            DOT_PRECISION="tf32",
            STORE_LOGITS=logits,
            READ_VALUES=values,
        )
        ok &= _compile(
            f"paged_attention STORE_LOGITS={logits} READ_VALUES={values} ROWS={rows}",
            paged_attention_split_kernel,
            paged,
            {"scale"},
            shape,
            4,
        )
    for lse, correct in ((False, False), (True, False), (False, True)):
        shape = dict(SPLIT_BLOCK=16, HEAD_DIM=128, STORE_LSE=lse, CORRECT=correct)
        merge = {"out_ptr": "*bf16", "serves_ptr": "*i8"}
        ok &= _compile(
            f"merge_splits STORE_LSE={lse} CORRECT={correct}",
            merge_splits_kernel,
            merge,
            set(),
            shape,
            4,
        )
    serving = dict(SPLIT_BLOCK=16, HEAD_DIM=128, STORE_LSE=False, CORRECT=True, SERVES=True)
    merge = {"out_ptr": "*bf16", "serves_ptr": "*i8"}
    ok &= _compile("merge_splits CORRECT SERVES", merge_splits_kernel, merge, set(), serving, 4)
    lse_only = dict(SPLIT_BLOCK=16, HEAD_DIM=16, STORE_LSE=True, CORRECT=False, STORE_OUT=False)
    ok &= _compile("merge_splits STORE_OUT=False", merge_splits_kernel, {}, set(), lse_only, 4)
    shape = dict(GROUP=1, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_K=64, DOT_PRECISION="tf32")
    ok &= _compile("sparse_correction", sparse_correction_split_kernel, paged, {"scale"}, shape, 4)
    shape = dict(
        GROUP=1, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=128, BLOCK_N=64, DOT_PRECISION="tf32"
    )
    for direct in (False, True):
        ok &= _compile(
            f"sparse_prefill DIRECT={direct}",
            sparse_prefill_kernel,
            {**paged, "out_ptr": "*bf16"},
            {"scale"},
            {**shape, "DIRECT": direct},
            8,
        )
    from flashloop_backend.kernels.triton.reference_store_jit import store_reference_kernel

    store = {
        **{name: "*i64" for name in ("slot_ptr", "incarnation_ptr", "state_incarnation_ptr")},
        **{name: "*i32" for name in ("indices_ptr", "state_indices_ptr")},
    }
    ok &= _compile(
        "store_reference", store_reference_kernel, store, set(), dict(BLOCK_K=1024, HEAD_PAD=128), 4
    )
    quant = {"x_ptr": "*bf16", "codes_ptr": "*u8", "min_ptr": "*fp16", "scale_ptr": "*fp16"}
    ok &= _compile("quantize_int4", quantize_int4_kernel, quant, set(), {"GROUP": 64}, 4)
    from flashloop_backend.kernels.triton.encode import DEFAULT_ENCODE
    from flashloop_backend.kernels.triton.encode_jit import encode_level_kernel

    encode = dict(STORE, k_ptr="*bf16", v_ptr="*bf16", rows_ptr="*i32", slots_ptr="*i32")
    encode["blocks_ptr"] = "*i64"
    encode["pages_ptr"] = "*i32"
    for group in (64, 16):  # two V groups per row of 128 channels, and eight
        shape = dict(HEAD_DIM=128, GROUP=group, EXACT=True)
        warps = DEFAULT_ENCODE.num_warps
        ok &= _compile(
            f"encode_level GROUP={group}", encode_level_kernel, encode, set(), shape, warps
        )
    return ok


if __name__ == "__main__":
    sys.exit(main())
