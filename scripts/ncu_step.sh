#!/usr/bin/env bash
# Nsight Compute over one decode step (GPU machine): every kernel's own
# duration in the last full decode step of `kiln bench` at concurrency 1
# (graphs off, so each launch is its own), summed per kernel name, against
# the step time the same bench measures without the profiler. Writes
# $OUT/ncu-step.csv and prints the table.
# Usage: scripts/ncu_step.sh [KV_FORMAT] (default fp8)
set -uo pipefail
out="${OUT:-./gpu-out}"
mkdir -p "$out"
export KILN_CACHE=/tmp/kiln-cache LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
kv="${1:-fp8}"
args=(bench --model synthetic:llama-3-8b --device cuda --concurrency 1 --prompt-tokens 1024
    --kv "$kv" --kv-memory 4GiB)
timeout 200 /usr/local/cuda/bin/ncu --csv --print-units base --clock-control none \
    --cache-control none --metrics gpu__time_duration.sum .gpu-bench/kiln "${args[@]}" --gen-tokens 4 \
    --cuda-graphs off >"$out/ncu-step.csv" 2>"$out/ncu-step.err"
python3 scripts/ncu_step.py "$out/ncu-step.csv"
for g in on off; do
    timeout 120 .gpu-bench/kiln "${args[@]}" --gen-tokens 64 --cuda-graphs "$g" 2>&1 | tail -3 | sed "s/^/graphs $g: /"
done
