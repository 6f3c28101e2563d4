#!/usr/bin/env bash
# The H200 records issue 21 (packed INT4 reads at memory speed) starts from, one call per
# stage (each well inside the 10-minute call limit):
#   baseline  the packed reader at every depth beside FlashInfer BF16 (bench packed) at
#             32K x 1 and x 16 and 8K x 1, and the SASS census of the same launches
#             (scripts/sass_per_code.py; it needs no GPU, so it runs here too)
#   e2e       KV quantization alone vs dense Triton from CUDA graphs at 8K x 1 (24 layers)
#             and 32K x 16 (4 layers): the end-to-end target, and the first
#             H200 figures of the flashloop backend's decode-only path without gathers
#   tests     the packed reader's and the host's GPU tests with KV quantization
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
run() { PYTHONUNBUFFERED=1 timeout "${LIMIT_S:-540}" "$@"; }
case "${1:?stage: baseline, e2e or tests}" in
  baseline)
    run flashloop-backend bench packed --contexts 32768 --concurrency 1,16 \
      --out "$OUT/bench_packed_32k.json" 2>&1 | grep -v "^\s*$" | tail -20
    run flashloop-backend bench packed --contexts 8192 --concurrency 1 \
      --out "$OUT/bench_packed_8k.json" 2>&1 | grep -v "^\s*$" | tail -10
    run python3 scripts/sass_per_code.py --levels 1,2,3,4 --json "$OUT/sass_per_code.json" | cut -c1-160 ;;
  e2e)
    run flashloop-backend bench e2e --backends triton+graphs,flashloop+graphs \
      --config configs/kv_quant_fixed_prompt.json --contexts 8192 --concurrency 1 \
      --warmup-context 512 --out "$OUT/bench_e2e_kv_quant_8k.json" 2>&1 | grep TTFT
    run flashloop-backend bench e2e --backends triton+graphs,flashloop+graphs \
      --config configs/kv_quant_fixed_prompt.json --contexts 32768 --concurrency 16 --layers 4 \
      --new-tokens 8 --warmup-context 2048 --out "$OUT/bench_e2e_kv_quant_32k.json" 2>&1 | grep TTFT ;;
  tests)
    OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 run python3 -m pytest -q -p no:cacheprovider -n "${WORKERS:-15}" \
      tests/test_packed_kv.py tests/test_packed_host.py tests/test_gpu_dense.py tests/test_gpu_graphs.py \
      -k "packed or kv or features or graphs" 2>&1 | tee "$OUT/gpu_tests_issue21.log" | tail -8 ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
