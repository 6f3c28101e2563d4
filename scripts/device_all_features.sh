#!/usr/bin/env bash
# The H200 records issue 8 still needs, one call per stage (each stays under the 10-minute
# call limit; every benchmark rewrites its JSON as it goes):
#   tests    the CUDA-graph tests (replay vs eager, every combination; a fresh machine
#            compiles every Triton specialization first: TESTS="<-k expression>" narrows them)
#   combos   tests and features together, in parallel workers (WORKERS, default 15;
#            TESTS narrows them as for tests)
#   features the host-vs-CPU tests of every feature combination on the GPU
#   graphs   decode at 1K x 1 / 16, eager vs graphs, dense Triton and all three features
#   decode   all three features vs dense at 32K x 16, both from CUDA graphs (target 1.8x;
#            CONFIG names another config); 4 layers: 24 layers of BF16 KV for 16 x 32K
#            tokens x 4 depths is 412 GB
#   prefill  4-loop prefill of a 32K prompt, all three features vs dense FlashInfer (1.5x)
#   select   loop-2 source designs per layer call at 8K / 32K x 1 / 16 (one-program radix
#            select, split select, torch top-k) beside FlashInfer decode (bench sparse)
#   packed   the packed reader at rows per step 64 / 32 / 16 x warps x programs per SM and
#            the packed sparse ops (source, correction at 3-4 levels) per selected-key launch
#            (32 x 4, 16 x 4, 16 x 2 positions per step x warps), at 32K x 16 beside FlashInfer
#            (bench packed; PARTS=sparse_ops runs only the sparse ops)
#   profile  the top CUDA kernels of all-on decode steps at 32K x 16 (scripts/profile_decode.py)
#   conversion  a prompt's conversion to packed INT4 (8K rows, 6 layers) per chunk size,
#            with its top ops (scripts/profile_conversion.py): the KV-quantization TTFT cost
#   serving  the serving benchmark from CUDA graphs, dense Triton vs each feature alone
#            and cumulatively (6 layers, 1K / 8K, concurrency 1 / 16; VARIANTS="dense,<key>"
#            runs only those: keys as ``bench serving --variants``)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# the whole log lands beside the JSON (a cut run keeps what it printed)
bench() { PYTHONUNBUFFERED=1 timeout "${LIMIT_S:-540}" flashloop-backend bench "$@" 2>&1 | grep -v "^\s*$" | tee "$OUT/bench_$STAGE.log" | tail -30; }
STAGE=${1:-}
case "${1:?stage: tests, combos, features, graphs, decode, prefill, select, packed, profile, conversion or serving}" in
  tests)
    timeout "${LIMIT_S:-540}" python3 -m pytest -v -p no:cacheprovider --tb=short -rfE \
      tests/test_gpu_graphs.py ${TESTS:+-k "$TESTS"} 2>&1 | tee "$OUT/gpu_tests_graphs.log" | tail -25 ;;
  combos)
    # every combination's graph replay and GPU-vs-CPU host test at once (xdist workers share
    # the Triton cache, so a fresh machine compiles in parallel); one CPU thread per worker:
    # 16 workers of 16 torch threads each finished 5 of 20 tests in 490 s, 1 thread each all
    # 20 in 210 s (results/gpu_tests_combinations.log)
    OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=${MKL_NUM_THREADS:-1} timeout "${LIMIT_S:-540}" python3 -m pytest -v -p no:cacheprovider --tb=short -rfE -n "${WORKERS:-15}" \
      tests/test_gpu_graphs.py tests/test_gpu_dense.py -k "${TESTS:-graphs or features}" 2>&1 \
      | tee "$OUT/gpu_tests_combinations.log" | tail -40 ;;
  features)
    timeout 540 python3 -m pytest -v -p no:cacheprovider --tb=short -rfE tests/test_gpu_dense.py \
      -k features 2>&1 | tee "$OUT/gpu_tests_features.log" | tail -25 ;;
  graphs)
    bench e2e --config configs/all_on.json --backends triton,triton+graphs,flashloop,flashloop+graphs \
      --contexts 1024 --concurrency 1,16 --out "$OUT/bench_e2e_graphs_1k.json" ;;
  decode)
    bench e2e --config "${CONFIG:-configs/all_on.json}" --backends triton+graphs,flashloop+graphs \
      --contexts 32768 --concurrency 16 --new-tokens 8 --layers 4 --warmup-context 2048 \
      --out "$OUT/bench_e2e_graphs_32k${CONFIG:+_$(basename "$CONFIG" .json)}.json" ;;
  prefill)
    bench e2e --config configs/all_on.json --backends flashinfer,flashloop --contexts 32768 \
      --concurrency 1 --new-tokens 2 --out "$OUT/bench_e2e_all_on_prefill_32k.json" ;;
  select)
    bench sparse --contexts 8192,32768 --concurrency 1,16 --out "$OUT/bench_sparse_decode.json" ;;
  packed)
    bench packed --contexts 32768 --concurrency 16 ${PARTS:+--parts "$PARTS"} --out "$OUT/bench_packed_kv${PARTS:+_$PARTS}.json" ;;
  profile)
    # where all-on decode time goes at 32K x 16 (eager steps, torch.profiler kernel table)
    timeout "${LIMIT_S:-540}" python3 scripts/profile_step.py --config configs/all_on.json \
      --context 32768 --concurrency 16 --layers 2 --steps 8 2>&1 | tee "$OUT/profile_all_on_32k.log" | tail -40 ;;
  conversion)
    # the prompt's conversion to packed INT4 per chunk size, and its top ops (TTFT cost)
    timeout "${LIMIT_S:-540}" python3 scripts/profile_conversion.py --context 8192 --layers 6 \
      --chunks 4096,1024,0 --layers-per-pass 1,6 2>&1 | tee "$OUT/profile_conversion_8k.log" | tail -40 ;;
  serving)
    bench serving --backends triton+graphs --config configs/all_on.json --layers 6 \
      --contexts 1024,8192 --concurrency 1,16 ${VARIANTS:+--variants "$VARIANTS"} \
      --out "$OUT/bench_serving_graphs${VARIANTS:+_picked}.json" ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
