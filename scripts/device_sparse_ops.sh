#!/usr/bin/env bash
# H200 calls for issue 22 (sparse decode at memory speed), one stage per call:
#   ops   the sparse-decode GPU tests; bench sparse (BF16 source designs and correction
#         beside FlashInfer) at 8K / 32K x 1 / 16, key retention 0.25 and 0.10; bench packed
#         sparse_ops (packed source beside the plain two-level read, corrections per
#         selected-key launch) at 32K x 16 and 8K x 1; each kernel's time per op call
#         (scripts/profile_sparse_ops.py) at 32K x 16 and 8K x 1
#   e2e   all three features and sparse decode alone vs dense Triton from CUDA graphs at
#         8K x 1 (24 layers) and 32K x 16 (4 layers); a profile of all-on decode steps at
#         8K x 1 (4 layers)
#   tests graph replay and the host on the GPU for every feature combination (the
#         combination GPU tests)
#   source the BF16 loop-2 source designs: its GPU kernel tests, bench sparse at 0.25 and
#         0.10, sparse decode alone vs dense Triton end to end at 32K x 16 and 8K x 1
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
run() { PYTHONUNBUFFERED=1 timeout "${LIMIT_S:-540}" "$@"; }
case "${1:?stage: ops, e2e or tests}" in
  ops)
    OMP_NUM_THREADS=1 run python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels_triton.py \
      tests/test_packed_kv.py -k "dense_source or correction or selected or source" 2>&1 \
      | tee "$OUT/gpu_tests_sparse_ops.log" | tail -4
    for r in 0.25 0.10; do
      run flashloop-backend bench sparse --contexts 8192,32768 --concurrency 1,16 --key-retention "$r" \
        --out "$OUT/bench_sparse_$r.json" 2>&1 | grep -v "^\s*$" | tail -6
    done
    for shape in "32768 16" "8192 1"; do
      set -- $shape
      run python3 scripts/profile_sparse_ops.py --context "$1" --concurrency "$2" \
        --json "$OUT/profile_sparse_ops_$1_$2.json" 2>&1 | grep -v -i warn | tee "$OUT/profile_sparse_ops_$1_$2.log"
    done
    run flashloop-backend bench packed --parts sparse_ops --contexts 32768 --concurrency 16 \
      --out "$OUT/bench_packed_sparse_32k.json" 2>&1 | grep -v "^\s*$" | tee "$OUT/bench_packed_sparse.log" | cut -c1-150 | tail -40
    run flashloop-backend bench packed --parts sparse_ops --contexts 8192 --concurrency 1 \
      --out "$OUT/bench_packed_sparse_8k.json" 2>&1 | grep -v "^\s*$" | tee -a "$OUT/bench_packed_sparse.log" | cut -c1-150 | tail -40 ;;
  e2e)
    for config in all_on sparse_decode_0.25; do
      run flashloop-backend bench e2e --backends triton+graphs,flashloop+graphs \
        --config "configs/$config.json" --contexts 8192 --concurrency 1 \
        --warmup-context 512 --out "$OUT/bench_e2e_${config}_8k.json" 2>&1 | grep -E "TTFT|replay"
      run flashloop-backend bench e2e --backends triton+graphs,flashloop+graphs \
        --config "configs/$config.json" --contexts 32768 --concurrency 16 --layers 4 \
        --new-tokens 8 --warmup-context 2048 --out "$OUT/bench_e2e_${config}_32k.json" 2>&1 | grep -E "TTFT|replay"
    done
    run python3 scripts/profile_step.py --config configs/all_on.json --context 8192 --concurrency 1 \
      --layers 4 --phase decode --json "$OUT/profile_all_on_8k.json" > "$OUT/profile_all_on_8k.log" 2>&1
    grep -E "Self CUDA time total|_kernel" "$OUT/profile_all_on_8k.log" | cut -c1-60,100-140 | head -24 ;;
  tests)
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 run python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-15}" \
      tests/test_gpu_graphs.py tests/test_gpu_dense.py tests/test_sparse_decode.py 2>&1 \
      | tee "$OUT/gpu_tests_combinations_sparse_ops.log" | tail -6 ;;
  source)
    OMP_NUM_THREADS=1 run python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_kernels_triton.py \
      -k "dense_source or selection or correction" 2>&1 | tee "$OUT/gpu_tests_source.log" | tail -3
    for r in 0.25 0.10; do
      run flashloop-backend bench sparse --contexts 8192,32768 --concurrency 1,16 --key-retention "$r" \
        --out "$OUT/bench_sparse_$r.json" 2>&1 | grep -v "^\s*$" | tail -4
    done
    run flashloop-backend bench e2e --backends triton+graphs,flashloop+graphs \
      --config configs/sparse_decode_0.25.json --contexts 32768 --concurrency 16 --layers 4 \
      --new-tokens 8 --warmup-context 2048 --out "$OUT/bench_e2e_sparse_32k.json" 2>&1 | grep -E "TPOT"
    run flashloop-backend bench e2e --backends triton+graphs,flashloop+graphs \
      --config configs/sparse_decode_0.25.json --contexts 8192 --concurrency 1 \
      --warmup-context 512 --out "$OUT/bench_e2e_sparse_8k.json" 2>&1 | grep -E "TPOT" ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
