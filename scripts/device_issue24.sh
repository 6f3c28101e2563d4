#!/usr/bin/env bash
# H200 calls for issue 24 (quality you can decide from), one stage per call:
#   train   the ~20M-parameter evaluation model in Ouro's layout (6 layers, 4 heads of 128,
#           4 loops) on 200 MB of the installed packages' Python sources, 2K context, 400 s
#           (scripts/train_embedded.py); writes the checkpoint and metrics under $OUT/model,
#           the weights split in 15 MB parts (what comes back is at most 16 MiB a file;
#           join them with cat)
#   grid    eval --grid on that model (MODEL=models/ouro-eval-bytes-20m): 256 held-out
#           windows of 1,024 prefilled tokens per point, written after every point;
#           RESUME=results/issue24/eval_grid_partial_h200.json keeps that record's points
#   speed   bench e2e --grid: dense Triton and FlashLoop at every grid point, 32K x 1, 24
#           layers, from CUDA graphs (the speed axis of `flashloop-backend pareto`)
#   adaptive  eval --combinations with Ouro's exit rule on for dense and FlashLoop alike
#           (--exit-threshold ${EXIT:-0.9}), exit-depth histograms in the record
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
run() { PYTHONUNBUFFERED=1 timeout "${LIMIT_S:-560}" "$@"; }
case "${1:?stage: train, grid, speed or adaptive}" in
  train)
    run python3 scripts/train_embedded.py --out "$OUT/model" --seconds 400 --layers 6 \
      --hidden 512 --heads 4 --intermediate 1408 --corpus packages --corpus-mb 200 \
      --seq-len 2048 --batch 16 --passkey-lengths 512,1024,2048 --eval-windows 64 2>&1 \
      | tee "$OUT/train.log" | tail -5
    (cd "$OUT/model" && rm -f tokenizer.json && split -b 15M model.safetensors model.safetensors.part- \
      && rm model.safetensors) ;;
  grid)
    # RESUME=record: carry on from an earlier run's record (its finished points are kept)
    [ -n "${RESUME:-}" ] && cp "$RESUME" "$OUT/eval_grid.json" && chmod u+w "$OUT/eval_grid.json"
    run flashloop-backend eval --model "${MODEL:?MODEL=checkpoint dir}" --config configs/all_on.json \
      --grid --windows 256 --context 1024 --passkey-contexts 512,1024,2048 --resume \
      --out "$OUT/eval_grid.json" 2>&1 | tail -40 ;;
  adaptive)
    run flashloop-backend eval --model "${MODEL:?MODEL=checkpoint dir}" --config configs/all_on.json \
      --combinations --exit-threshold "${EXIT:-0.9}" --windows 256 --context 1024 \
      --passkey-contexts 512,1024,2048 \
      --out "$OUT/eval_combinations_exit${EXIT:-0.9}.json" 2>&1 | tail -12 ;;
  speed)
    run flashloop-backend bench e2e --backends triton+graphs,flashloop+graphs \
      --config configs/all_on.json --grid --contexts 32768 --concurrency 1 --layers 24 \
      --new-tokens 16 --warmup-context 4096 --out "$OUT/bench_e2e_grid_32k.json" 2>&1 \
      | grep -E "e2e|error" ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
