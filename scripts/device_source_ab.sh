#!/usr/bin/env bash
# The one-launch cluster source (loop 2 at few rows) against the three-launch source, on
# one machine (STEPS picks, default "tests ops"); records and logs under $OUT:
#   tests  the GPU tests of both sources and of every CUDA reader
#          (tests/test_cuda_cluster_source.py, tests/test_cuda_kernels.py); a failure
#          ends the call
#   ops    bench packed's sparse ops at OPS_SHAPES ("8192x1 32768x1" by default): the
#          source's variants side by side, each with bytes and TB/s beside FlashInfer
#   e2e    all on (configs/all_on.json) from CUDA graphs at E2E_SHAPES ("8k 32k1"): dense
#          and all on with the cluster rule as committed, then all on with the three
#          launches at every batch (scripts/e2e_source_ab.py --cluster-pairs 0)
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
run() { PYTHONUNBUFFERED=1 timeout "${LIMIT_S:-560}" "$@"; }
for stage in ${STEPS:-tests ops}; do
  case $stage in
    tests)
      OMP_NUM_THREADS=1 run python3 -m pytest -q -p no:cacheprovider -n 8 \
        tests/test_cuda_cluster_source.py tests/test_cuda_kernels.py 2>&1 \
        | tee "$OUT/gpu_tests_cluster_source.log" | tail -15
      # timings of a source that fails its tests mean nothing
      [ "${PIPESTATUS[0]}" = 0 ] || { echo "tests failed: later steps skipped"; exit 1; } ;;
    ops)
      for shape in ${OPS_SHAPES:-8192x1 32768x1}; do
        set -- "${shape%x*}" "${shape#*x}"
        run python3 -c "
import json
from flashloop_backend.tools.bench.packed import bench_packed_kv
from flashloop_backend.tools.bench.timing import progress_log
record = bench_packed_kv([$1], [$2], log=progress_log, parts=('sparse_ops',))
json.dump(record, open('$OUT/bench_sparse_ops_cluster_$1_$2.json', 'w'), indent=1)
" 2>&1 | grep -v "^\s*$" | tee "$OUT/bench_sparse_ops_cluster_$1_$2.log" \
          | grep -E "dense_levels_source" | cut -c1-190
      done ;;
    e2e)
      for shape in ${E2E_SHAPES:-8k 32k1}; do
        case $shape in
          8k) args="--contexts 8192 --concurrency 1 --warmup-context 512" ;;
          32k1) args="--contexts 32768 --concurrency 1 --warmup-context 2048" ;;
        esac
        for rule in committed three_launches; do
          backends=triton+graphs,flashloop+graphs
          cmd=(flashloop-backend)
          if [ $rule = three_launches ]; then
            backends=flashloop+graphs
            cmd=(python3 scripts/e2e_source_ab.py --cluster-pairs 0)
          fi
          # shellcheck disable=SC2086
          run "${cmd[@]}" bench e2e --backends $backends --config configs/all_on.json \
            --passes "${PASSES:-3}" $args --out "$OUT/bench_e2e_${shape}_$rule.json" \
            > "$OUT/bench_e2e_${shape}_$rule.log" 2>&1
          grep -E "Error|error" "$OUT/bench_e2e_${shape}_$rule.log" | tail -3
          python3 scripts/e2e_summary.py "$OUT/bench_e2e_${shape}_$rule.json" | cut -c1-200
        done
      done ;;
  esac
done
