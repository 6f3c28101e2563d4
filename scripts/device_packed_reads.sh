#!/usr/bin/env bash
# H200 calls for issue 21 (packed INT4 reads at memory speed), one stage per call:
#   bench     the packed readers (tensor-core launch sweep and the CUDA-core reader, each
#             checked against the CUDA-core result) at every depth beside FlashInfer BF16
#             (bench packed) at 32K x 1 and x 16 and 8K x 1
#   e2e       KV quantization alone vs dense Triton from CUDA graphs at 8K x 1 (24 layers)
#             and 32K x 16 (4 layers)
#   tests     the packed readers' and the host's GPU tests with KV quantization
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
run() { PYTHONUNBUFFERED=1 timeout "${LIMIT_S:-540}" "$@"; }
case "${1:?stage: bench, e2e or tests}" in
  bench)
    run flashloop-backend bench packed --parts decode --contexts 32768 --concurrency 1,16 \
      --out "$OUT/bench_packed_32k.json" 2>&1 | grep -v "^\s*$" | tee "$OUT/bench_packed_32k.log" | cut -c1-170 | tail -80
    run flashloop-backend bench packed --parts decode --contexts 8192 --concurrency 1 \
      --out "$OUT/bench_packed_8k.json" 2>&1 | grep -v "^\s*$" | tee "$OUT/bench_packed_8k.log" | cut -c1-170 | tail -40 ;;
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
      -k "packed or kv or features or graphs" 2>&1 | tee "$OUT/gpu_tests_packed_reads.log" | tail -8 ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
