#!/usr/bin/env bash
# The H200 records of issue 20 (the dense host near the roofline), one call per stage:
#   profile  top kernels of dense Triton decode steps (8K x 1 and 32K x 16) and of an 8K
#            prompt's prefill steps, 4 layers, fused layer ops (scripts/profile_step.py);
#            BEFORE=<dir>: also the same decode profiles of the tree in <dir> (its own
#            scripts/profile_decode.py), the record before the fused layer work
#   linear   the decode projections at 1 / 4 / 16 rows, cuBLAS vs the small-rows Triton
#            kernel over launch shapes (scripts/bench_small_linear.py)
#   tests    the GPU tests of the host, its layer ops and graphs (xdist workers)
#   dense    dense Triton from CUDA graphs at 8K x 1 and 1K x 1 (24 layers) and 32K x 16
#            (4 layers), fused vs reference layer ops (bench e2e)
#   features every FlashLoop feature alone and all on vs dense Triton, all from CUDA graphs,
#            at 8K x 1 (24 layers) and 32K x 16 (4 layers) (bench e2e)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
run() { PYTHONUNBUFFERED=1 timeout "${LIMIT_S:-540}" "$@"; }
profile() {  # name, then profile_step.py arguments
  local name=$1; shift
  run python3 scripts/profile_step.py --backend triton --layers 4 --json "$OUT/$name.json" "$@" \
    >"$OUT/$name.log" 2>&1 || { echo "profile $name failed"; tail -20 "$OUT/$name.log"; }
  tail -3 "$OUT/$name.log" | cut -c1-300
}
case "${1:?stage: profile, linear, tests, dense or features}" in
  profile)
    profile profile_decode_8k --phase decode --context 8192 --concurrency 1 --steps 8
    profile profile_prefill_8k --phase prefill --context 8192 --concurrency 1
    profile profile_decode_32k --phase decode --context 32768 --concurrency 16 --steps 8
    if [ -n "${BEFORE:-}" ]; then
      (cd "$BEFORE" && python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . \
        >/dev/null 2>&1 && export PYTHONPATH=$PWD:$PYTHONPATH &&
        for shape in "8192 1" "32768 16"; do set -- $shape
          run python3 scripts/profile_decode.py --backend triton --context "$1" --concurrency "$2" \
            --layers 4 --steps 8 --rows 40 >"$OUT/profile_decode_before_$1x$2.log" 2>&1
          tail -3 "$OUT/profile_decode_before_$1x$2.log"; done)
      python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1
    fi ;;
  linear)
    run python3 scripts/bench_small_linear.py --rows "${ROWS:-1,4,16}" --json "$OUT/bench_small_linear.json" 2>&1 \
      | tee "$OUT/bench_small_linear.log" | grep -v Warning ;;
  tests)
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 run python3 -m pytest -q -p no:cacheprovider --tb=short -rfE \
      -n "${WORKERS:-15}" ${TESTS:-tests/test_layer_ops.py tests/test_gpu_graphs.py tests/test_gpu_dense.py tests/test_op_inputs.py} \
      2>&1 | tee "$OUT/gpu_tests_dense_host.log" | tail -15 ;;
  dense)
    run flashloop-backend bench e2e --backends triton+graphs --layer-ops fused,reference \
      --contexts 8192 --concurrency 1 --warmup-context 512 --out "$OUT/bench_e2e_dense_8k.json" 2>&1 | tail -8
    run flashloop-backend bench e2e --backends triton+graphs --contexts 1024 --concurrency 1 \
      --new-tokens 64 --out "$OUT/bench_e2e_dense_1k.json" 2>&1 | tail -4
    run flashloop-backend bench e2e --backends triton+graphs --layer-ops fused,reference \
      --contexts 32768 --concurrency 16 --layers 4 --new-tokens 8 --warmup-context 2048 \
      --out "$OUT/bench_e2e_dense_32k.json" 2>&1 | tail -8 ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
