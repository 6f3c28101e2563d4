#!/usr/bin/env bash
# H200 calls that measure FlashLoop decode against dense (packed encoding v3 and its
# kernels), one stage per call; records and logs under $OUT:
#   kernels  the packed-kernel GPU tests (every Triton and CUDA reader against the torch reference), then
#            bench packed (the streaming reader per depth with a launch sweep, the loop-2
#            source and the loop 3-4 corrections, each with bytes and TB/s beside
#            FlashInfer BF16 decode) at 8K x 1, 32K x 1 and 32K x 16 (KERNEL_SHAPES as "8192x1 ...", PARTS and
#            SWEEP pick shapes, parts and the launch sweep; CUDA_ONLY=True times the CUDA
#            readers alone; SKIP_TESTS=1 leaves the tests out)
#   e2e      all on (configs/all_on.json) vs dense Triton from CUDA graphs, 3 passes, at
#            8K x 1 and 32K x 1 (24 layers) and 32K x 16 (4 layers, 64 new tokens); KV
#            quantization alone at 32K x 16 (SHAPES picks a subset: "8k 32k1 32k16 kv")
#   tests    graph replay, the host on the GPU, snapshots and speculation for every
#            feature combination (the combination GPU tests), and no Triton load, CUDA
#            build or graph capture after the engine's warm-up (tests/test_gpu_compiles.py)
#   selection  the loop-2 selection alone per radix digit width and candidate-list size
#            (scripts/bench_selection.py) at 8K x 1, 32K x 1 and 32K x 16
#   host     where a decode step's host time goes (scripts/profile_host.py --decode, graphs)
#            for dense Triton and all on at HOST_SHAPE (context x concurrency, default
#            32768x16) over HOST_LAYERS layers (default 4)
#   trace    the GPU tests of whole-wave grids and traced launches with the CUDA and packed
#            kernel tests, then where the packed decode launches' time goes
#            (scripts/trace_loop2.py: each loop-2 launch alone and its phases, under launch
#            variants, at TRACE_SHAPES, default 8192x1,32768x1,32768x16)
#   convert  a prompt's conversion to packed INT4 (the CUDA level writer at each of
#            CUDA_LAUNCHES, then the Triton one) at CONTEXTS (default 8K and 32K), 24
#            layers, with bytes moved, TB/s beside a BF16 copy and the top CUDA ops
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
run() { PYTHONUNBUFFERED=1 timeout "${LIMIT_S:-560}" "$@"; }
e2e() {  # name, config, then bench e2e arguments
  local name=$1 config=$2
  shift 2
  run flashloop-backend bench e2e --backends triton+graphs,flashloop+graphs \
    --config "configs/$config.json" --passes "${PASSES:-3}" --out "$OUT/bench_e2e_$name.json" "$@" \
    > "$OUT/bench_e2e_$name.log" 2>&1
  grep -E "Error|error" "$OUT/bench_e2e_$name.log" | tail -3
  python3 scripts/e2e_summary.py "$OUT/bench_e2e_$name.json" | cut -c1-200
}
case "${1:?stage: kernels, e2e, tests, selection, host, trace or convert}" in
  trace)
    OMP_NUM_THREADS=1 run python3 -m pytest -q -p no:cacheprovider -n 8 -m gpu tests/test_launch_waves.py \
      tests/test_cuda_kernels.py tests/test_packed_kv.py tests/test_kernels_triton.py 2>&1 \
      | tee "$OUT/gpu_tests_waves.log" | tail -4
    run python3 scripts/trace_loop2.py --shapes "${TRACE_SHAPES:-8192x1,32768x1,32768x16}" \
      --json "$OUT/trace_loop2.json" 2>&1 | grep -v -i warn | tee "$OUT/trace_loop2.log" | cut -c1-400 ;;
  kernels)
    if [ "${SKIP_TESTS:-0}" != 1 ]; then
      OMP_NUM_THREADS=1 run python3 -m pytest -q -p no:cacheprovider -n 8 tests/test_packed_kv.py tests/test_cuda_kernels.py \
        2>&1 | tee "$OUT/gpu_tests_packed_v3.log" | tail -4
    fi
    for shape in ${KERNEL_SHAPES:-8192x1 32768x1 32768x16}; do  # context x concurrency
      set -- "${shape%x*}" "${shape#*x}"
      run python3 -c "
import json, sys
from flashloop_backend.tools.bench.packed import bench_packed_kv
from flashloop_backend.tools.bench.timing import progress_log
record = bench_packed_kv([$1], [$2], log=progress_log, sweep=${SWEEP:-False}, parts=tuple('${PARTS:-decode sparse_ops}'.split()), cuda_only=${CUDA_ONLY:-False})
json.dump(record, open('$OUT/bench_packed_v3_$1_$2.json', 'w'), indent=1)
" 2>&1 | grep -v "^\s*$" | tee "$OUT/bench_packed_v3_$1_$2.log" \
        | grep -E "depth1|depth2|source|correction" | cut -c1-170
    done ;;
  e2e)
    for shape in ${SHAPES:-8k 32k1 32k16 kv}; do
      case $shape in
        8k) e2e all_on_8k all_on --contexts 8192 --concurrency 1 --warmup-context 512 ;;
        32k1) e2e all_on_32k1 all_on --contexts 32768 --concurrency 1 --warmup-context 2048 ;;
        32k16) e2e all_on_32k16 all_on --contexts 32768 --concurrency 16 --layers 4 \
          --new-tokens 64 --warmup-context 2048 ;;
        kv) e2e kv_quant_32k16 kv_quant_fixed_prompt --contexts 32768 --concurrency 16 \
          --layers 4 --new-tokens 64 --warmup-context 2048 ;;
      esac
    done ;;
  tests)
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 run python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-15}" \
      tests/test_gpu_graphs.py tests/test_gpu_dense.py tests/test_gpu_snapshot.py \
      tests/test_gpu_speculation.py tests/test_sparse_decode.py tests/test_gpu_compiles.py 2>&1 \
      | tee "$OUT/gpu_tests_combinations_v3.log" | tail -6 ;;
  selection)
    run python3 scripts/bench_selection.py --widths "${WIDTHS:-4,8}" \
      --candidates "${CANDIDATES:-1024,2048}" --json "$OUT/bench_selection.json" \
      2>&1 | tee "$OUT/bench_selection.log" | tail -12 ;;
  host)
    shape=${HOST_SHAPE:-32768x16}
    for backend in triton flashloop; do
      config=""
      [ "$backend" = flashloop ] && config="--config configs/all_on.json"
      run python3 scripts/profile_host.py --backend "$backend" $config --context "${shape%x*}" \
        --concurrency "${shape#*x}" --layers "${HOST_LAYERS:-4}" --decode 16 --graphs \
        --json "$OUT/profile_host_decode_${backend}_$shape.json" \
        > "$OUT/profile_host_decode_${backend}_$shape.log" 2>&1
      grep -E "Error|decode step wall" "$OUT/profile_host_decode_${backend}_$shape.log" | tail -2
    done ;;
  convert)
    for context in ${CONTEXTS:-8192 32768}; do
      run python3 scripts/profile_conversion.py --context "$context" --layers 24 --chunks 4096 \
        --writers cuda,fused --cuda-launches "${CUDA_LAUNCHES:-4:1,2:2,2:1}" --repeats 3 \
        --rows 8 > "$OUT/profile_conversion_$context.log" 2>&1
      grep -E "median|Error" "$OUT/profile_conversion_$context.log" | cut -c1-220 | head -6
    done ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
