#!/usr/bin/env bash
# One H200 call: every `gpu` test, then the serving benchmark (dense vs each feature alone and
# cumulatively). Each step has its own time limit; the benchmark rewrites its JSON after
# every variant, so a cut-off run still returns what it measured.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
timeout "${GPU_TESTS_S:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider tests 2>&1 \
  | tee "$OUT/gpu_tests.log" | tail -15
timeout "${SERVING_S:-300}" flashloop-backend bench serving --backends flashinfer \
  --config configs/all_on.json --layers "${LAYERS:-6}" --contexts "${CONTEXTS:-1024,8192}" \
  --concurrency "${CONCURRENCY:-1,16}" --out "$OUT/bench_serving.json" 2>&1 \
  | tee "$OUT/bench_serving.log" | grep -v "^\s*$" | tail -40
