#!/usr/bin/env bash
# One H200 call: the CUDA-graph GPU tests (replay vs eager for every feature combination;
# TESTS narrows them), then decode through the host eager vs from graphs on Ouro-1.4B
# shapes, side by side.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
# shellcheck disable=SC2086
timeout "${GPU_TESTS_S:-220}" python3 -m pytest -q -p no:cacheprovider --tb=short -rfE \
  ${TESTS:-tests/test_gpu_graphs.py} 2>&1 | tee "$OUT/gpu_tests_graphs.log" | tail -40
timeout "${E2E_S:-300}" flashloop-backend bench e2e --config configs/all_on.json \
  --backends "${BACKENDS:-flashinfer,triton,triton+graphs,flashloop,flashloop+graphs}" \
  --contexts "${CONTEXTS:-1024}" --concurrency "${CONCURRENCY:-1,16}" --new-tokens 16 \
  --out "$OUT/bench_e2e_graphs.json" 2>&1 | tee "$OUT/bench_e2e_graphs.log" | grep -v "^\s*$" | tail -30
