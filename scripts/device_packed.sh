#!/usr/bin/env bash
# One H200 call: GPU tests of the packed-KV reader and of the host with every feature,
# the packed reader benchmark (designs and launch sweep), then e2e with KV quantization.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pytest -q tests/test_packed_kv.py tests/test_gpu_dense.py tests/test_feature_combinations.py \
  -k "packed or features or combination" 2>&1 | tee "$OUT/gpu_tests_packed.log" | tail -3
flashloop-backend bench packed --contexts 8192,32768 --concurrency 1,16 --out "$OUT/bench_packed_kv.json" \
  2>&1 | tee "$OUT/bench_packed.log" | tail -60
for cfg in kv_quant_fixed_prompt all_on; do
  flashloop-backend bench e2e --backends flashinfer,flashloop --config "configs/$cfg.json" \
    --contexts 8192 --concurrency 1,16 --new-tokens 16 --out "$OUT/bench_e2e_${cfg}_8192.json" 2>&1 | tail -8
done
