#!/usr/bin/env bash
# One device call on why all on's prompt steps set its ITL p99 (issue 44), in the order the
# answers matter, each step under its own limit so a cut keeps what came before:
#   1. a prompt's first loop-4 steps, profiled from an idle device with the input shapes
#      of each call of the torch ops that could hold the host there and the caching
#      allocator's retries, stopping after STOP (default 16: one step a prompt, so prompts
#      admitted once the pools are full are among them);
#   2. one loop-4 chunk's attention: the Triton tile kernel under the wrapper's split rule
#      and in two splits, and FlashInfer's prefill over the chunk's whole span
#      (scripts/probe_loop4_chunk.py);
#   3. with CAPACITY=1, bench capacity for dense and all on at 32K, 16 GiB, 4 layers,
#      1,024 new tokens, 24 clients, then its prompt steps by loop and in four-step windows.
# Nothing else may run on the GPU beside it (a test command cut by its time limit can
# leave its workers running). Records and logs under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PYTHONUNBUFFERED=1 timeout "${PROFILE_S:-170}" python3 scripts/slow_step_profile.py \
  --variant config --config configs/all_on.json --context 32768 --gib 16 --layers 4 \
  --new-tokens 256 --clients 20 --depths 3 --starts 0 --stop-after "${STOP:-16}" \
  --shapes aten::index,aten::nonzero,aten::_index_put_impl_,aten::_pin_memory,aten::copy_ \
  --show 4 --rows 10 --slow-ms 1000 --json "$OUT/slow_steps_first_loop4.json" \
  > "$OUT/slow_steps_first_loop4.log" 2>&1
grep -E "^  step|allocator|call " "$OUT/slow_steps_first_loop4.log" | head -60 | cut -c1-200
PYTHONUNBUFFERED=1 timeout "${PROBE_S:-90}" python3 scripts/probe_loop4_chunk.py \
  --json "$OUT/probe_loop4_chunk.json" > "$OUT/probe_loop4_chunk.log" 2>&1
tail -6 "$OUT/probe_loop4_chunk.log" | cut -c1-300
if [ "${CAPACITY:-0}" = 1 ]; then
  OUT="$OUT" CONTEXTS=32768 GIB=16 LAYERS=4 NEW=1024 CLIENTS=24 VARIANTS=dense,config \
    LIMIT_S="${CAPACITY_S:-260}" bash scripts/device_capacity.sh
  python3 scripts/prompt_step_windows.py "$OUT/bench_capacity.json" --top 6 \
    > "$OUT/prompt_step_windows.log" 2>&1
  head -12 "$OUT/prompt_step_windows.log"
fi
