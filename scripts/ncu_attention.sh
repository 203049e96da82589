#!/usr/bin/env bash
# Nsight Compute on decode attention kernels (GPU machine): stall reasons,
# issue rate and DRAM throughput of the first launch of each kernel named
# (regexes), while .gpu/cuda_bench runs (with BENCH_ARGS, e.g. "one-row
# 4096x14336" for the folded FP8 down product). Writes $OUT/ncu-<name>.txt.
set -uo pipefail
out="${OUT:-./gpu-out}"
mkdir -p "$out"
export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
m=smsp__inst_executed.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,gpu__time_duration.sum
for p in alu fma fmaheavy fp16 xu lsu adu cbu uniform; do
    m="$m,sm__inst_executed_pipe_${p}.avg.pct_of_peak_sustained_active"
done
m="$m,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
for s in barrier long_scoreboard short_scoreboard mio_throttle wait math_pipe_throttle lg_throttle; do
    m="$m,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio"
done
for k in "$@"; do
    # shellcheck disable=SC2086
    timeout 150 /usr/local/cuda/bin/ncu -k "regex:$k" -c 1 --section Occupancy --section SchedulerStats --section ComputeWorkloadAnalysis \
        --metrics "$m" .gpu/cuda_bench ${BENCH_ARGS:-} 2>&1 | grep -v "^paged\|^ *[0-9]*x[0-9]\|^tag\|^copy\|^device" >"$out/ncu-$k.txt"
    grep -E "stalled|inst_executed|dram__|duration|Eligible|Issued|Achieved Active|Registers|Pipe|pipe" "$out/ncu-$k.txt" | sed "s/^/$k: /"
done
