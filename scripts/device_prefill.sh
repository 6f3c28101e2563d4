#!/usr/bin/env bash
# One H200 call for token-sparse prefill: GPU kernel tests, the per-layer attention
# benchmark and the end-to-end 4-loop prefill through the host (Ouro-1.4B shapes).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pytest -q tests/test_sparse_prefill_kernel.py tests/test_gpu_dense.py -k "prefill or features" 2>&1 | tee "$OUT/gpu_tests_prefill.log" | tail -3
flashloop-backend bench prefill --contexts 8192,32768 --retention 0.25,0.10 --out "$OUT/bench_prefill_attention.json"
for ctx in 8192 32768; do
  flashloop-backend bench e2e --backends flashinfer,flashloop --config configs/token_sparse_prefill.json \
    --contexts "$ctx" --concurrency 1 --new-tokens 2 --out "$OUT/bench_e2e_token_sparse_prefill_${ctx}.json"
done
