#!/usr/bin/env bash
# H200 calls for issue 25 (self-speculative decoding), one stage per call:
#   tests   the GPU tests: speculation from CUDA graphs gives the greedy tokens
#           (tests/test_gpu_speculation.py)
#   bench   decode with and without speculation (K, draft depth 1 and 2), dense Triton and
#           all on from CUDA graphs, 8K x 1 and 32K x 1, 24 layers, random weights (the step
#           cost: their acceptance is not a trained model's)
#   trained the same on the evaluation model (models/ouro-eval-bytes-20m) prompted with
#           held-out text, 1K and 4K x 1, dense and all on: the speedup with a trained
#           model's acceptance
# bench and trained take K (block rows, default 4) and CONFIDENCE (--draft-confidence, default
# unset: K rows every block); their records are named by K, depth and confidence. trained
# takes PASSES (timed passes per run, default 1). Both take DEPTHS, CONTEXTS, BACKENDS, LIMIT_S.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
run() { PYTHONUNBUFFERED=1 timeout "${LIMIT_S:-300}" "$@"; }
K=${K:-4}
SPEC=(--speculate "$K")
TAG="k$K"
if [ -n "${CONFIDENCE:-}" ]; then SPEC+=(--draft-confidence "$CONFIDENCE"); TAG+="_c$CONFIDENCE"; fi
case "${1:?stage: tests, bench or trained}" in
  tests)
    OMP_NUM_THREADS=1 run python3 -m pytest -q -p no:cacheprovider tests/test_gpu_speculation.py \
      2>&1 | tee "$OUT/gpu_tests_speculation.log" | tail -3 ;;
  bench)
    for depth in ${DEPTHS:-1 2}; do
      run flashloop-backend bench e2e --backends "${BACKENDS:-triton+graphs,flashloop+graphs}" \
        --config configs/all_on.json --contexts "${CONTEXTS:-8192,32768}" \
        --concurrency 1 --layers 24 --new-tokens 32 --warmup-context 2048 "${SPEC[@]}" \
        --draft-depth "$depth" --out "$OUT/bench_e2e_speculate_${TAG}_d$depth.json" 2>&1 \
        | tee -a "$OUT/bench_speculate.log" | grep -E "e2e |Error"
    done ;;
  trained)
    # the evaluation model on held-out text (its drafts accepted as on real text), dense and
    # all on, plain and speculating from CUDA graphs; its 4,096-position limit caps the context
    for depth in ${DEPTHS:-1 2}; do
      run flashloop-backend bench e2e --model models/ouro-eval-bytes-20m \
        --backends "${BACKENDS:-triton+graphs,flashloop+graphs}" --config configs/all_on.json \
        --contexts "${CONTEXTS:-1024,3968}" --concurrency 1 --new-tokens 64 "${SPEC[@]}" \
        --passes "${PASSES:-1}" \
        --draft-depth "$depth" --out "$OUT/bench_e2e_speculate_trained_${TAG}_d$depth.json" 2>&1 \
        | tee -a "$OUT/bench_speculate_trained.log" | grep -E "e2e |Error"
    done ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
