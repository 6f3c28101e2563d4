#!/usr/bin/env bash
# One H200 call for the dense-baseline issue: GPU tests, info, kernel and end-to-end benches.
# Use (device tool): source .whl/prelude.sh && bash scripts/device_dense.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
flashloop-backend info --json > "$OUT/info_h200.json"
python3 -m pytest -q -x tests/test_gpu_dense.py tests/test_kernels_triton.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
flashloop-backend bench kernel --backends flashinfer,triton --contexts 1024,8192,32768 --concurrency 1,16 --out "$OUT/bench_decode_kernel.json"
flashloop-backend bench e2e --backends flashinfer,triton --contexts 1024 --concurrency 1,16 --out "$OUT/bench_e2e_1k.json"
flashloop-backend bench e2e --backends flashinfer --contexts 8192 --concurrency 1 --out "$OUT/bench_e2e_8k.json"
