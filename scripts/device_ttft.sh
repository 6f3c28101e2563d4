#!/usr/bin/env bash
# H200 calls for issue 23 (time to first token), one stage per call:
#   conversion  the packed conversion of one prompt, the fused level writer beside the torch
#               chain with the Triton quantizer (scripts/profile_conversion.py, 8K rows, 24
#               layers, 4 depths; the writer at five launches: whole heads or 64-channel
#               blocks, 16 or 8 warps, register caps), and the level writer's GPU test
#   ttft        TTFT and TPOT from CUDA graphs beside dense Triton, 3 timed passes: all on at
#               8K x 1 and 32K x 1 (24 layers), token-sparse prefill alone at 32K x 1, KV
#               quantization alone at 8K x 1
#   ttft16      the same at 32K x 16 (4 layers): all on, KV quantization alone
#   profile     where one prefill's GPU time goes: dense Triton, KV quantization alone and all
#               on at 8K x 1 (24 layers), all on at 32K x 16 (4 layers), the conversion
#               included (scripts/profile_step.py --phase prefill)
#   prefill     the sparse-prefill attention per layer call at 8K and 32K, retention 0.75,
#               0.5 and 0.25: the Triton tiled kernel, FlashInfer over runs of consecutive
#               rows, FlashInfer's dense causal prefill; the kernel's launch sweep at 8K
#               and 32K (register caps included)
#   host        each prefill step's host time beside its wait for the device at 8K x 1
#               (24 layers): dense, all on, KV quantization alone, token-sparse alone
#               (scripts/profile_host.py)
#   warm        TTFT at 8K x 1 and 32K x 1 (24 layers) after a warm-up at the timed length
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
run() { PYTHONUNBUFFERED=1 timeout "${LIMIT_S:-300}" "$@"; }
case "${1:?stage: conversion, ttft, ttft16, profile, prefill, host or warm}" in
  conversion)
    OMP_NUM_THREADS=1 run python3 -m pytest -q -p no:cacheprovider tests/test_packed_kv.py \
      -k "level_writer or layers_per_pass" 2>&1 | tee "$OUT/gpu_tests_level_writer.log" | tail -2
    run python3 scripts/profile_conversion.py --context 8192 --layers 24 --chunks 4096,0 \
      --layers-per-pass 1 --repeats 3 --encode-launches 0:16:0,64:16:0,64:16:64,64:8:128,0:16:64 \
      > "$OUT/profile_conversion_fused.log" 2>&1
    grep -E "median|Self CUDA" "$OUT/profile_conversion_fused.log" ;;
  ttft|ttft16)
    # the issue's target shapes, 3 timed passes each beside dense Triton (FlashInfer prefill);
    # ttft: one request at 24 layers, ttft16: 16 requests at 4 layers
    if [ "$1" = ttft ]; then
      cases=("all_on 8192 1 24" "all_on 32768 1 24" "token_sparse_prefill 32768 1 24"
        "kv_quant_fixed_prompt 8192 1 24")
    else
      cases=("all_on 32768 16 4" "kv_quant_fixed_prompt 32768 16 4")
    fi
    for case in "${cases[@]}"; do
      set -- $case
      run flashloop-backend bench e2e --backends triton+graphs,flashloop+graphs \
        --config "configs/$1.json" --contexts "$2" --concurrency "$3" --layers "$4" \
        --new-tokens 8 --passes 3 --warmup-context 2048 \
        --out "$OUT/bench_e2e_$1_$2x$3.json" 2>&1 | grep -E "TTFT"
    done ;;
  profile)
    for case in "triton none 8192 1 24" "flashloop kv_quant_fixed_prompt 8192 1 24" \
        "flashloop all_on 8192 1 24" "flashloop all_on 32768 16 4"; do
      set -- $case
      config=(); [ "$2" = none ] || config=(--config "configs/$2.json")
      name="profile_prefill_$1_$2_$3_$4"
      run python3 scripts/profile_step.py --backend "$1" "${config[@]}" --context "$3" \
        --concurrency "$4" --layers "$5" --phase prefill --rows 25 \
        --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
      echo "$name"; grep -E "Self CUDA time total" "$OUT/$name.log"
    done ;;
  prefill)
    run flashloop-backend bench prefill --contexts 8192,32768 --retention 0.75,0.5,0.25 \
      --out "$OUT/bench_prefill_attention.json" 2>&1 | grep -E "prefill|retention"
    for context in 8192 32768; do
      run python3 scripts/sweep_sparse_prefill.py "$context" > "$OUT/sweep_sparse_prefill_$context.jsonl" 2>&1
      cat "$OUT/sweep_sparse_prefill_$context.jsonl"
    done ;;
  host)
    for case in "triton none" "flashloop configs/all_on.json" \
        "flashloop configs/kv_quant_fixed_prompt.json" "flashloop configs/token_sparse_prefill.json"; do
      set -- $case
      name="host_$1_$(basename "$2" .json)_8k"
      config=(); [ "$2" = none ] || config=(--config "$2")
      run python3 scripts/profile_host.py --backend "$1" "${config[@]}" --context 8192 --layers 24 \
        --rows 40 --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
      echo "$name"; tail -1 "$OUT/$name.log"
    done ;;
  warm)
    # the timed pass after a warm-up pass at the timed prompt length (every kernel compiled
    # and planned for the timed shapes) beside the default short warm-up
    for case in "kv_quant_fixed_prompt 8192 512" "kv_quant_fixed_prompt 8192 8192" \
        "all_on 8192 8192" "token_sparse_prefill 32768 32768" "all_on 32768 32768"; do
      set -- $case
      run flashloop-backend bench e2e --backends triton+graphs,flashloop+graphs \
        --config "configs/$1.json" --contexts "$2" --concurrency 1 --new-tokens 8 \
        --warmup-context "$3" --out "$OUT/bench_e2e_$1_$2_warm$3.json" 2>&1 | grep -E "TTFT"
    done ;;
  *) echo "unknown stage $1" >&2; exit 2 ;;
esac
