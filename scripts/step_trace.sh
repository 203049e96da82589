#!/usr/bin/env bash
# Where a captured decode step's time goes (GPU machine): builds the CUPTI
# tracer (scripts/step_trace.c), runs `kiln bench` under it, and prints,
# for the last decode-only steps of the most rows, each kernel's time and
# the share of the step it alone occupies, with the idle between kernels
# (scripts/step_trace.py). Unlike Nsight Compute, graphs stay on and
# programmatic launches overlap as they do in service.
# Usage: scripts/step_trace.sh [KV_FORMAT [CONCURRENCY [PROMPT_TOKENS]]]
# (defaults fp8, 64, 512); extra bench flags in FLAGS; writes
# $OUT/trace-KV-CONC[-TAG].csv (TAG names runs that differ by FLAGS).
set -uo pipefail
out="${OUT:-./gpu-out}"
mkdir -p "$out"
kv="${1:-fp8}" conc="${2:-64}" prompt="${3:-512}"
cuda=/usr/local/cuda
cupti_inc="$(dirname "$(ls $cuda/extras/CUPTI/include/cupti.h $cuda/include/cupti.h $cuda/targets/*/include/cupti.h 2>/dev/null | head -1)")"
cupti_lib="$(dirname "$(ls $cuda/extras/CUPTI/lib64/libcupti.so $cuda/lib64/libcupti.so $cuda/targets/*/lib/libcupti.so 2>/dev/null | head -1)")"
[ -n "$cupti_inc" ] && [ "$cupti_inc" != . ] || { echo "step_trace: no cupti.h" >&2; exit 1; }
lib=/tmp/libkiln_trace.so
rm -f "$lib"
# The newest kernel record type this CUPTI declares: the layout it writes
# (older ones stay declared, deprecated).
v="$(cat "$cupti_inc"/cupti*.h | grep -o 'CUpti_ActivityKernel[0-9]*' | sed 's/.*Kernel//' | sort -n | tail -1)"
gcc -shared -fPIC -O2 -DKREC="CUpti_ActivityKernel${v:-9}" -I"$cuda/include" -I"$cupti_inc" \
    scripts/step_trace.c -L"$cupti_lib" -lcupti -lpthread -o "$lib" 2>/dev/null
if [ ! -f "$lib" ]; then
    echo "step_trace: the tracer did not build:" >&2
    gcc -shared -fPIC -O2 -DKREC="CUpti_ActivityKernel${v:-9}" -I"$cuda/include" -I"$cupti_inc" \
        scripts/step_trace.c -L"$cupti_lib" -lcupti -lpthread -o "$lib" 2>&1 | head -20 >&2
    exit 1
fi
trace="$out/trace-$kv-$conc${TAG:+-$TAG}.csv"
rm -f "$trace"
export KILN_CACHE=/tmp/kiln-cache LD_LIBRARY_PATH="$cuda/lib64:$cupti_lib:${LD_LIBRARY_PATH:-}"
# shellcheck disable=SC2086
CUDA_INJECTION64_PATH="$lib" KILN_TRACE_OUT="$trace" timeout 240 .gpu-bench/kiln bench \
    --model synthetic:llama-3-8b --device cuda --concurrency "$conc" --prompt-tokens "$prompt" \
    --gen-tokens "${GEN:-48}" --kv "$kv" --kv-memory 16GiB ${FLAGS:-} 2>&1 | grep -v INFO | tail -3
[ -s "$trace" ] || { echo "step_trace: the run left no trace" >&2; exit 1; }
python3 scripts/step_trace.py "$trace"
