#!/usr/bin/env bash
# One H200 call for sparse decode: its GPU kernel tests and the per-layer benchmark.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pytest -q tests/test_kernels_triton.py tests/test_gpu_dense.py -k "sparse or dense_source or order_key or features or quantize" 2>&1 | tee "$OUT/gpu_tests_sparse.log" | tail -3
flashloop-backend bench sparse --contexts 8192,32768 --concurrency 1,16 --out "$OUT/bench_sparse_decode.json"
