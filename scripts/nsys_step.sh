#!/usr/bin/env bash
# Nsight Systems over `kiln bench`'s captured decode steps (GPU machine):
# graphs traced by node, so each kernel of a replayed step shows with its
# real overlaps (programmatic launches) and gaps, unlike Nsight Compute,
# which serializes kernels and needs graphs off. Prints, for the last
# decode-only steps of the most rows, each kernel's time and the share of
# the step it alone occupies (scripts/nsys_step.py); writes
# $OUT/nsys-step-KV-CONC.csv.
# Usage: scripts/nsys_step.sh [KV_FORMAT [CONCURRENCY [PROMPT_TOKENS]]]
# (defaults fp8, 64, 512); extra bench flags in FLAGS.
set -uo pipefail
out="${OUT:-./gpu-out}"
mkdir -p "$out"
export KILN_CACHE=/tmp/kiln-cache LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
kv="${1:-fp8}" conc="${2:-64}" prompt="${3:-512}"
nsys="$(command -v nsys || ls /usr/local/cuda/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)"
[ -x "$nsys" ] || { echo "nsys_step: no nsys on this machine" >&2; exit 1; }
rep="/tmp/nsys-step-$kv-$conc"
# shellcheck disable=SC2086
timeout 240 "$nsys" profile -o "$rep" --force-overwrite true --trace cuda --cuda-graph-trace node \
    .gpu-bench/kiln bench --model synthetic:llama-3-8b --device cuda --concurrency "$conc" \
    --prompt-tokens "$prompt" --gen-tokens "${GEN:-48}" --kv "$kv" --kv-memory 16GiB \
    ${FLAGS:-} 2>&1 | grep -v INFO | tail -3
timeout 120 "$nsys" stats --report cuda_gpu_trace --format csv --force-export true \
    --output "$rep" "$rep.nsys-rep" >/dev/null 2>&1
cp "${rep}_cuda_gpu_trace.csv" "$out/nsys-step-$kv-$conc.csv" 2>/dev/null
python3 scripts/nsys_step.py "${rep}_cuda_gpu_trace.csv"
