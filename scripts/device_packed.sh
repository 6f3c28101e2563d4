#!/usr/bin/env bash
# One H200 call: GPU tests of the new kernels, then packed-KV, prefill and e2e records.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pytest -q tests/test_packed_kv.py tests/test_sparse_prefill_kernel.py tests/test_kernels_triton.py \
  tests/test_gpu_dense.py -k "packed or prefill or dense_source or correction or features" 2>&1 | tee "$OUT/gpu_tests_packed_prefill.log" | tail -3
flashloop-backend bench packed --contexts 8192,32768 --concurrency 1,16 --out "$OUT/bench_packed_kv.json"
flashloop-backend bench prefill --contexts 8192,32768 --retentions 0.25,0.10 --out "$OUT/bench_prefill_attention.json"
for ctx in 8192 32768; do
  flashloop-backend bench e2e --backends flashinfer,flashloop --config configs/token_sparse_prefill.json \
    --contexts "$ctx" --concurrency 1 --new-tokens 2 --out "$OUT/bench_e2e_token_sparse_prefill_${ctx}.json"
done
