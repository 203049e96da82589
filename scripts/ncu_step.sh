#!/usr/bin/env bash
# Nsight Compute over one decode step (GPU machine): every kernel's own
# duration in the last full decode step of `kiln bench` at concurrency 1
# (graphs off, so each launch is its own), summed per kernel name, against
# the step time the same bench measures without the profiler (graphs with
# and without programmatic edges, and no graphs). Writes
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
for mode in "on on" "on off" "off off"; do
    set -- $mode
    timeout 120 .gpu-bench/kiln "${args[@]}" --gen-tokens 64 --cuda-graphs "$1" --cuda-pdl "$2" 2>&1 |
        grep -v INFO | tail -2 | sed "s/^/graphs $1, pdl $2: /"
done
