#!/usr/bin/env bash
# H200 call that measures capacity at one KV memory budget (issue 44's bench capacity):
# dense Triton from graphs, KV quantization alone and all on (configs/all_on.json), every
# variant's pools planned from the same budget, clients submitted at once; records and
# logs under $OUT. CONTEXTS (default 32768), GIB (budgets, comma-separated; default 96), NEW (default 512: a request
# must still decode while the plan's other prompts prefill, one at a time, or the run
# measures the prefill pipeline rather than the pools), CLIENTS
# (default: three times what all on's plan holds), LAYERS (default 24), ONE_TRAVERSAL=1 (a step
# with prompt chunks runs every row eagerly: GraphSettings.split_mixed_steps=False), VARIANTS
# (some of dense,kv_residual_quantization,config; default all three), CONFIG (default
# configs/all_on.json).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
PYTHONUNBUFFERED=1 timeout "${LIMIT_S:-560}" flashloop-backend bench capacity \
  --backends triton+graphs --config "${CONFIG:-configs/all_on.json}" --contexts "${CONTEXTS:-32768}" \
  --kv-memory-gib "${GIB:-96}" --new-tokens "${NEW:-512}" --layers "${LAYERS:-24}" \
  ${CLIENTS:+--clients "$CLIENTS"} ${VARIANTS:+--variants "$VARIANTS"} $([ "${ONE_TRAVERSAL:-0}" = 1 ] && echo --one-traversal-mixed-steps) --out "$OUT/bench_capacity.json" \
  > "$OUT/bench_capacity.log" 2>&1
grep -E "capacity|Error|error" "$OUT/bench_capacity.log" | cut -c1-200 | tail -12
