#!/usr/bin/env bash
# GPU call: the span prefill's GPU tests (FlashInfer's causal prefill over a token-sparse
# chunk's span against the per-row reference) and the sparse prefill kernel's. FlashInfer
# builds its kernels on first use into its JIT cache; the cache lives under .device_cache
# (ignored by git, so a warm machine keeps it between calls), and the limit leaves room
# for the build on a fresh one. Log under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" .device_cache
export FLASHINFER_WORKSPACE_BASE="$PWD/.device_cache"
OMP_NUM_THREADS=1 timeout -k 5 "${LIMIT_S:-300}" python3 -m pytest -q -p no:cacheprovider -rA \
  tests/test_span_prefill.py tests/test_sparse_prefill_kernel.py > "$OUT/gpu_tests_span.log" 2>&1
tail -4 "$OUT/gpu_tests_span.log"
