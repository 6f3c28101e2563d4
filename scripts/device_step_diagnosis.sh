#!/usr/bin/env bash
# One device call on why all on's prompt steps set its ITL p99 (issue 44), in the order the
# answers matter, each step under its own limit so a cut keeps what came before:
#   1. a prompt's first loop-1 and loop-4 steps and a later one of each, profiled from an
#      idle device with the package's Python calls traced (which call issues the host
#      time of a first loop-4 step), stopping after STOP (default 48: about twelve
#      prompts, four steps each, so prompts admitted once the pools are full are among them);
#   2. one loop-4 chunk's attention: the Triton tile kernel split and unsplit, and
#      FlashInfer's prefill over the chunk's whole span (scripts/probe_loop4_chunk.py);
#   3. with CAPACITY=1, bench capacity for dense and all on at 32K, 16 GiB, 4 layers,
#      1,024 new tokens, 24 clients, then its prompt steps by loop and in four-step windows.
# Nothing else may run on the GPU beside it (a test command cut by its time limit can
# leave its workers running). Records and logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PYTHONUNBUFFERED=1 timeout "${PROFILE_S:-170}" python3 scripts/slow_step_profile.py \
  --variant config --config configs/all_on.json --context 32768 --gib 16 --layers 4 \
  --new-tokens 256 --clients 20 --depths 0,3 --starts 0,4096 --stop-after "${STOP:-48}" \
  --python --show 8 --rows 16 --slow-ms 0 --json "$OUT/slow_steps_first_chunks.json" \
  > "$OUT/slow_steps_first_chunks.log" 2>&1
tail -3 "$OUT/slow_steps_first_chunks.log" | cut -c1-200
PYTHONUNBUFFERED=1 timeout "${PROBE_S:-90}" python3 scripts/probe_loop4_chunk.py \
  --json "$OUT/probe_loop4_chunk.json" > "$OUT/probe_loop4_chunk.log" 2>&1
tail -3 "$OUT/probe_loop4_chunk.log" | cut -c1-300
if [ "${CAPACITY:-0}" = 1 ]; then
  OUT="$OUT" CONTEXTS=32768 GIB=16 LAYERS=4 NEW=1024 CLIENTS=24 VARIANTS=dense,config \
    LIMIT_S="${CAPACITY_S:-260}" bash scripts/device_capacity.sh
  python3 scripts/prompt_step_windows.py "$OUT/bench_capacity.json" --top 6 \
    > "$OUT/prompt_step_windows.log" 2>&1
  head -12 "$OUT/prompt_step_windows.log"
fi
