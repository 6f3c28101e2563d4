#!/usr/bin/env bash
# H200 calls for issue 24 (quality you can decide from), one stage per call:
#   train   the ~20M-parameter evaluation model in Ouro's layout (6 layers, 4 heads of 128,
#           4 loops) on 200 MB of the installed packages' Python sources, 2K context, 400 s
#           (scripts/train_embedded.py); writes the checkpoint and metrics under $OUT/model,
#           the weights split in 15 MB parts (what comes back is at most 16 MiB a file;
#           join them with cat)
#   grid    eval --grid on that model (MODEL=models/ouro-eval-bytes-20m): 256 held-out
#           windows of 1,024 prefilled tokens per point, written after every point;
#           RESUME=results/quality/eval_grid_partial_h200.json keeps that record's points;
#           POINTS='text;text' runs only the points whose name holds every text
#   speed   bench e2e --grid: dense Triton and FlashLoop at every grid point, 32K x 1, 24
#           layers, from CUDA graphs (the speed axis of `flashloop-backend pareto`);
#           POINTS='text;text' keeps the points whose name holds every text
#   grids   the grid stage's points in parallel processes on the one GPU (the 20M model
#           leaves it mostly idle): PARTS='a;b|c;d' gives each process the points whose
#           name holds every text of its group; each resumes RESUME, and their records
#           merge into $OUT/eval_grid.json (scripts/merge_eval_records.py); ADAPTIVE_PARTS
#           (same form, e.g. 'token_sparse_prefill|!token_sparse_prefill') runs the adaptive
#           stage's combinations in parallel parts beside them; CONFIG replaces
#           configs/all_on.json as the base config (a resumed record's own, when it changed)
#   exitspeed  TTFT and TPOT with and without Ouro's exit rule (bench e2e --exit-threshold)
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
    # eval_parts NAME FLAGS PARTS: one eval process per '|'-separated group of PARTS (each
    # with the points whose name holds every ';'-separated text of its group, '!text': not
    # that text), each resuming RESUME, their records merged into $OUT/NAME.json
    eval_parts() {
      local name=$1 flags=$2 i=0 group part texts t
      mkdir -p "$OUT/parts/$name"; IFS='|' read -ra groups <<< "$3"
      for group in "${groups[@]}"; do
        part=(); IFS=';' read -ra texts <<< "$group"
        for t in "${texts[@]}"; do part+=(--grid-points "$t"); done
        [ -n "${RESUME:-}" ] && [ "$name" = eval_grid ] && cp "$RESUME" "$OUT/parts/$name/$i.json" \
          && chmod u+w "$OUT/parts/$name/$i.json"
        # shellcheck disable=SC2086  # FLAGS holds several words
        run flashloop-backend eval --model "${MODEL:?MODEL=checkpoint dir}" \
          --config "${CONFIG:-configs/all_on.json}" $flags "${part[@]}" --windows 256 --context 1024 \
          --passkey-contexts 512,1024,2048 --resume --out "$OUT/parts/$name/$i.json" \
          > "$OUT/parts/$name/$i.log" 2>&1 &
        pids+=($!); i=$((i + 1))
      done
    }
    pids=()
    [ -n "${PARTS:-}" ] && eval_parts eval_grid --grid "$PARTS"
    # ADAPTIVE_PARTS: the combinations with Ouro's exit rule on (--exit-threshold ${EXIT:-0.9})
    [ -n "${ADAPTIVE_PARTS:-}" ] && eval_parts "eval_combinations_exit${EXIT:-0.9}" \
      "--combinations --exit-threshold ${EXIT:-0.9}" "$ADAPTIVE_PARTS"
    for pid in "${pids[@]}"; do wait "$pid"; done
    for dir in "$OUT"/parts/*/; do
      python3 scripts/merge_eval_records.py "$OUT/$(basename "$dir").json" "$dir"[0-9]*.json
    done
    for log in "$OUT"/parts/*/*.log; do echo "== $log"; tail -c 400 "$log"; echo; done
    tar -czf "$OUT/grid_logs.tar.gz" -C "$OUT/parts" . && rm -r "$OUT/parts" ;;
  exitspeed)
    # latency under Ouro's exit rule: the evaluation model on held-out text, dense Triton
    # and all on from CUDA graphs, fixed depth and with the rule (--exit-threshold EXIT)
    for threshold in none "${EXIT:-0.9}"; do
      rule=(); [ "$threshold" != none ] && rule=(--exit-threshold "$threshold")
      run flashloop-backend bench e2e --model "${MODEL:?MODEL=checkpoint dir}" \
        --backends triton+graphs,flashloop+graphs --config configs/all_on.json \
        --contexts 1024,3968 --concurrency 1,16 --new-tokens 64 --passes 3 "${rule[@]}" \
        --out "$OUT/bench_e2e_exit_$threshold.json" 2>&1 | tee -a "$OUT/exitspeed.log" \
        | grep -E "e2e |Error"
    done ;;
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
