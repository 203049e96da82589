#!/usr/bin/env bash
# Nsight Compute over one decode step (GPU machine): every kernel's own
# duration in the largest whole decode step of `kiln bench` (graphs off, so
# each launch is its own and batches run unpadded), summed per kernel name,
# against the step time the same bench measures without the profiler
# (graphs with and without programmatic edges, and no graphs). Writes $OUT/ncu-step-KV-CONC.csv and
# prints the table.
# Usage: scripts/ncu_step.sh [KV_FORMAT [CONCURRENCY [PROMPT_TOKENS]]]
# (defaults fp8, 1, 1024; a big batch with a short prompt times the GEMMs
# at that batch without profiling a long prefill); WEIGHTS picks the
# weight format (default native).
set -uo pipefail
out="${OUT:-./gpu-out}"
mkdir -p "$out"
export KILN_CACHE=/tmp/kiln-cache LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
kv="${1:-fp8}" conc="${2:-1}" prompt="${3:-1024}"
csv="$out/ncu-step-$kv-$conc.csv"
args=(bench --model synthetic:llama-3-8b --device cuda --concurrency "$conc" --prompt-tokens "$prompt"
    --kv "$kv" --kv-memory 8GiB --weights "${WEIGHTS:-native}")
# A big batch's prompts take several steps, mixed with its first decode
# rows: its whole decode steps come only after them.
gen="${GEN:-$((conc > 8 ? 16 : 4))}"
timeout 300 /usr/local/cuda/bin/ncu --csv --print-units base --clock-control none \
    --cache-control none --metrics gpu__time_duration.sum .gpu-bench/kiln "${args[@]}" --gen-tokens "$gen" \
    --cuda-graphs off >"$csv" 2>"$csv.err"
python3 scripts/ncu_step.py "$csv"
# NCU_ONLY=1 leaves out the step times without the profiler.
[ -n "${NCU_ONLY:-}" ] && exit 0
for mode in "on on" "on off" "off off"; do
    set -- $mode
    timeout 120 .gpu-bench/kiln "${args[@]}" --gen-tokens 64 --cuda-graphs "$1" --cuda-pdl "$2" 2>&1 |
        grep -v INFO | tail -2 | sed "s/^/graphs $1, pdl $2: /"
done
