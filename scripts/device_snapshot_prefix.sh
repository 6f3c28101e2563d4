#!/usr/bin/env bash
# H200 calls for issue 26 (prefix reuse, snapshot / restore), one stage per call:
#   tests     the GPU tests: snapshot / restore and prefix reuse of every feature combination
#             from CUDA graphs (tests/test_gpu_snapshot.py)
#   snapshot  size and time of one 32K request's snapshot and restore, all on, 24 layers
#             (scripts/profile_snapshot.py)
#   prefix    bench serving with the prefix cache: 16 requests whose prompts share an 8K
#             prefix, one in flight at a time (so a later request's TTFT is its own prompt's
#             work, not a wait for the first), dense and all on, beside a plain closed loop;
#             the record's ttft_first_and_later compares the later requests with the first;
#             VARIANTS=... runs other variants
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
run() { PYTHONUNBUFFERED=1 timeout "${LIMIT_S:-300}" "$@"; }
case "${1:?stage: tests, snapshot or prefix}" in
  tests)
    OMP_NUM_THREADS=1 run python3 -m pytest -q -p no:cacheprovider tests/test_gpu_snapshot.py \
      2>&1 | tee "$OUT/gpu_tests_snapshot.log" | tail -3 ;;
  snapshot)
    (cd scripts && run python3 profile_snapshot.py --config ../configs/all_on.json \
      --context 32768 --layers 24) | tee "$OUT/profile_snapshot_all_on_32k.jsonl" ;;
  prefix)
    run flashloop-backend bench serving --backends triton+graphs --config configs/all_on.json \
      --variants "${VARIANTS:-dense,token_sparse_prefill+sparse_decode_attention+kv_residual_quantization}" \
      --contexts 8448 --concurrency 1 --new-tokens 16 --layers 24 --prefix-cache \
      --shared-prefix 8192 --out "$OUT/bench_serving_prefix_8k.json" 2>&1 \
      | tee "$OUT/bench_prefix.log" | grep -E "serving |Error" ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
