#!/usr/bin/env bash
# Nsight Compute counters of the packed decode ops of one layer call (the streaming reader
# at depth 1, the loop-2 keys pass, selection and values pass, the loop 3-4 correction
# at depths 3 and 4, each followed by its merge where it has one), on a device call:
# duration, DRAM and SM throughput, occupancy, launch shape, and the warp stall reasons
# above half a cycle per issued instruction. SHAPES: context x concurrency list.
#   source .whl/prelude.sh && export OUT && bash scripts/device_packed_counters.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
STALLS=""
for s in long_scoreboard short_scoreboard barrier wait math_pipe_throttle mio_throttle \
  lg_throttle no_instruction membar not_selected selected dispatch_stall drain \
  branch_resolving sleeping imc_miss tex_throttle; do
  STALLS="$STALLS,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio"
done
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
for shape in ${SHAPES:-8192x1 32768x1}; do
  timeout "${LIMIT_S:-250}" "$NCU" --clock-control none --section SpeedOfLight \
    --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats --metrics "${STALLS#,}" \
    -k 'regex:packed_|select_top_k|merge_splits' -c 24 \
    python3 scripts/ncu_packed_ops.py --context "${shape%x*}" --concurrency "${shape#*x}" \
    --calls 2 > "$OUT/ncu_$shape.txt" 2>&1
  python3 scripts/ncu_summary.py "$OUT/ncu_$shape.txt" | tee "$OUT/ncu_summary_$shape.txt"
done
