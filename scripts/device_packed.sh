#!/usr/bin/env bash
# One H200 call: GPU tests of the packed-KV reader and of the host with every feature combination,
# then the packed reader benchmark (every depth, launch sweeps).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pytest -q tests/test_packed_kv.py tests/test_gpu_dense.py -k "packed or features" 2>&1 \
  | tee "$OUT/gpu_tests_packed.log" | tail -3
flashloop-backend bench packed --contexts 32768 --concurrency 1,16 --out "$OUT/bench_packed_kv.json" \
  2>&1 | tee "$OUT/bench_packed.log" | grep -v "^\s*$" | tail -45
