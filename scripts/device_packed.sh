#!/usr/bin/env bash
# One H200 call: GPU tests of the packed-KV readers, the packed reader benchmark (both
# designs at every depth, a launch sweep at depth 1), then e2e with KV quantization.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pytest -q tests/test_packed_kv.py 2>&1 | tee "$OUT/gpu_tests_packed.log" | tail -3
flashloop-backend bench packed --contexts 32768 --concurrency 1,16 --out "$OUT/bench_packed_kv.json" \
  2>&1 | tee "$OUT/bench_packed.log" | grep -v "^\s*$" | tail -40
for cfg in kv_quant_fixed_prompt all_on; do
  timeout 120 flashloop-backend bench e2e --backends flashinfer,flashloop --config "configs/$cfg.json" \
    --layers 6 --contexts 8192 --concurrency 1,16 --new-tokens 16 \
    --out "$OUT/bench_e2e_${cfg}_8192.json" 2>&1 | tail -6
done
