#!/usr/bin/env bash
# Calls on nvidia-h200-x2 for issue 28 (tensor parallelism over NCCL), one stage per call:
#   tests     the two-GPU tests: --tp 2 gives one GPU's greedy tokens, eager and from CUDA
#             graphs, dense, each feature alone and all on (tests/test_gpu_tensor_parallel.py)
#   generate  generate --tp 2 against --tp 1 on the evaluation model, dense and all on, JSON
#             of each under $OUT
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0  # NVLink multicast off (the device notes)
run() { PYTHONUNBUFFERED=1 timeout "${LIMIT_S:-500}" "$@"; }
case "${1:?stage: tests or generate}" in
  tests)
    run python3 -m pytest -q -p no:cacheprovider tests/test_gpu_tensor_parallel.py 2>&1 \
      | tee "$OUT/gpu_tests_tensor_parallel.log" | tail -5 ;;
  generate)
    for config in none configs/all_on.json; do
      for tp in 1 2; do
        name=$(basename "$config" .json)
        run flashloop-backend generate --model models/ouro-eval-bytes-20m --device cuda \
          --prompt "def merge(a, b):" --max-new-tokens 64 --json --tp "$tp" \
          $([ "$config" = none ] || echo --config "$config") > "$OUT/generate_${name}_tp$tp.json"
      done
    done
    tail -n 1 "$OUT"/generate_*.json | cut -c1-200 ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
