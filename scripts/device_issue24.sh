#!/usr/bin/env bash
# H200 calls for issue 24 (quality you can decide from), one stage per call:
#   train   the ~20M-parameter evaluation model in Ouro's layout (6 layers, 4 heads of 128,
#           4 loops) on 200 MB of the installed packages' Python sources, 2K context, 400 s
#           (scripts/train_embedded.py); writes the checkpoint and metrics under $OUT/model,
#           the weights split in 15 MB parts (what comes back is at most 16 MiB a file;
#           join them with cat)
#   grid    eval --grid on that model (MODEL=models/ouro-eval-bytes-20m): 256 held-out
#           windows of 1,024 prefilled tokens per point, written after every point;
#           RESUME=results/issue24/eval_grid_partial_h200.json keeps that record's points;
#           POINTS='text;text' runs only the points whose name holds every text
#   speed   bench e2e --grid: dense Triton and FlashLoop at every grid point, 32K x 1, 24
#           layers, from CUDA graphs (the speed axis of `flashloop-backend pareto`);
#           POINTS='text;text' keeps the points whose name holds every text
#   grids   the grid stage's points in parallel processes on the one GPU (the 20M model
#           leaves it mostly idle): PARTS='a;b|c;d' gives each process the points whose
#           name holds every text of its group; each resumes RESUME, and their records
#           merge into $OUT/eval_grid.json (scripts/merge_eval_records.py); ADAPTIVE=1 runs
#           the adaptive stage beside them
#   profile where an all-on eval's time goes (py-spy stacks of a 64-window run)
#   adaptive  eval --combinations with Ouro's exit rule on for dense and FlashLoop alike
#           (--exit-threshold ${EXIT:-0.9}), exit-depth histograms in the record
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
run() { PYTHONUNBUFFERED=1 timeout "${LIMIT_S:-560}" "$@"; }
# POINTS='a;b' (grid, speed): only the grid points whose name holds every text (--grid-points)
chosen=(); IFS=';' read -ra texts <<< "${POINTS:-}"
for t in "${texts[@]}"; do chosen+=(--grid-points "$t"); done
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
      --grid "${chosen[@]}" --windows 256 --context 1024 --passkey-contexts 512,1024,2048 \
      --resume --out "$OUT/eval_grid.json" 2>&1 | tee "$OUT/grid.log" | tail -40 ;;
  grids)
    mkdir -p "$OUT/parts"; pids=(); i=0
    IFS='|' read -ra groups <<< "${PARTS:?PARTS='a;b|c;d'}"
    for group in "${groups[@]}"; do
      part=(); IFS=';' read -ra texts <<< "$group"
      for t in "${texts[@]}"; do part+=(--grid-points "$t"); done
      [ -n "${RESUME:-}" ] && cp "$RESUME" "$OUT/parts/$i.json" && chmod u+w "$OUT/parts/$i.json"
      run flashloop-backend eval --model "${MODEL:?MODEL=checkpoint dir}" \
        --config configs/all_on.json --grid "${part[@]}" --windows 256 --context 1024 \
        --passkey-contexts 512,1024,2048 --resume --out "$OUT/parts/$i.json" \
        > "$OUT/parts/$i.log" 2>&1 &
      pids+=($!); i=$((i + 1))
    done
    [ "${ADAPTIVE:-0}" = 1 ] && { bash "$0" adaptive > "$OUT/parts/adaptive.log" 2>&1 & pids+=($!); }
    for pid in "${pids[@]}"; do wait "$pid"; done
    python3 scripts/merge_eval_records.py "$OUT/eval_grid.json" "$OUT"/parts/[0-9]*.json
    for log in "$OUT"/parts/*.log; do echo "== $log"; tail -c 400 "$log"; echo; done
    tar -czf "$OUT/grid_logs.tar.gz" -C "$OUT/parts" . && rm -r "$OUT/parts" ;;
  adaptive)
    run flashloop-backend eval --model "${MODEL:?MODEL=checkpoint dir}" --config configs/all_on.json \
      --combinations --exit-threshold "${EXIT:-0.9}" --windows 256 --context 1024 \
      --passkey-contexts 512,1024,2048 \
      --out "$OUT/eval_combinations_exit${EXIT:-0.9}.json" 2>&1 | tail -12 ;;
  speed)
    run flashloop-backend bench e2e --backends triton+graphs,flashloop+graphs \
      --config configs/all_on.json --grid "${chosen[@]}" --contexts 32768 --concurrency 1 \
      --layers 24 --new-tokens 16 --warmup-context 4096 --out "$OUT/bench_e2e_grid_32k.json" \
      2>&1 | tee "$OUT/speed.log" | grep -E "e2e |Error" ;;
  profile)
    # where an all-on eval's time goes: py-spy stacks every 15 s of a 64-window run
    # (py-spy's wheel in .tools/, carried beside .whl)
    python3 -m pip install -q --no-index --no-deps --target /tmp/spy .tools/py_spy-*.whl
    run flashloop-backend eval --model "${MODEL:?MODEL=checkpoint dir}" \
      --config "${PROFILE_CONFIG:-configs/all_on.json}" --windows 64 --context 1024 \
      --passkey-samples 0 > "$OUT/profile_eval.log" 2>&1 &
    sleep 25
    for _ in 1 2 3 4 5; do
      pid=$(pgrep -f "python.*flashloop-backend eval" | head -1)
      PYTHONPATH= /tmp/spy/bin/py-spy dump --pid "$pid" >> "$OUT/profile_eval_stacks.txt" 2>&1
      sleep 15
    done
    kill %1 2>/dev/null; tail -c 300 "$OUT/profile_eval.log" ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
