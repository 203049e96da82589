#!/usr/bin/env bash
# CUDA tests and benchmarks on a GPU machine.
#
# Here (no GPU needed):   scripts/gpu.sh build
#   builds the stripped binaries into .gpu/ and splits the default model
#   (98 MB) into .gpu-model/a and .gpu-model/b (all git-ignored), since one
#   device call carries at most 64 MiB.
#   and the stripped `kiln` binary into .gpu-bench/ (one call carries at
#   most 64 MiB: the test binaries and kiln travel in separate calls).
# There, calls back to back (the machine keeps /tmp while warm):
#   carry .gpu-model/a:          scripts/gpu.sh stage a
#   carry .gpu-model/b:          scripts/gpu.sh stage b
#   carry .gpu, .gpu-bench:      scripts/gpu.sh run
# For an A/B of two builds: `scripts/gpu.sh baseline [REV]` here, then
# `scripts/gpu.sh ab` there (carry .gpu-bench): /tmp/kiln-base runs beside
# .gpu-bench/kiln on the same benchmark.
# `run` is the single command for every CUDA test and benchmark (kernel
# parity, the engine tests on the default model, kernel timings, the
# engine's decode matrix and the PyTorch baseline), writing logs to $OUT
# (or ./gpu-out), and fails if a parity or engine test fails;
# `scripts/gpu.sh bench` runs only the last two, `scripts/gpu.sh shutdown`
# checks SIGTERM under load (carry .gpu-bench), `scripts/gpu.sh int4` the
# int4 kernels and int4 decode beside a base build, `scripts/gpu.sh
# fp8-decode` FP8 rows' kernels and decode beside a base build,
# `scripts/gpu.sh gpus` decode pools across GPUs (two or more), `scripts/gpu.sh
# tp` tensor-parallel ranks on two GPUs.
set -euo pipefail
cd "$(dirname "$0")/.."

# There: the environment every mode runs in. Kiln loads NCCL as
# libnccl.so, which the pip wheel (nvidia-nccl-cu13, beside PyTorch) names
# libnccl.so.2: a link in /tmp/kiln-lib gives it that name.
device_env() {
    # NVLink multicast stays off (the machines set it; a program with an
    # environment of its own must too). NCCL connects every algorithm at
    # init, not at a first sum, where a rank would wait for the others out
    # of reach of an abort (kernels/src/cuda/comm.rs).
    export RUST_BACKTRACE=0 KILN_CACHE=/tmp/kiln-cache NCCL_NVLS_ENABLE=0 NCCL_RUNTIME_CONNECT=0
    mkdir -p /tmp/kiln-lib
    local nccl
    nccl="$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)"
    if [ -n "$nccl" ] && [ -e "$nccl/libnccl.so.2" ]; then
        ln -sf "$nccl/libnccl.so.2" /tmp/kiln-lib/libnccl.so
    fi
    export LD_LIBRARY_PATH="/usr/local/cuda/lib64:/tmp/kiln-lib:${LD_LIBRARY_PATH:-}"
}

# There: the default model from its two staged halves into the cache;
# fails if they are not staged.
staged_model() {
    [ -f /tmp/kiln-model/a ] && [ -f /tmp/kiln-model/b ] || return 1
    mkdir -p "$KILN_CACHE"
    cat /tmp/kiln-model/a /tmp/kiln-model/b >"$KILN_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf"
}

# There: this tree's kiln, which travels compressed, unpacked.
unpack_kiln() {
    if [ ! -x .gpu-bench/kiln ] && [ -f .gpu-bench/kiln.xz ]; then
        xz -d -k .gpu-bench/kiln.xz
        chmod +x .gpu-bench/kiln
    fi
}

# There, for a mode across GPUs: $out, the environment, this tree's kiln
# and every GPU's index and name.
prepare_gpus() {
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    unpack_kiln
    nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$out/gpu.txt"
}

# There, for a mode that runs builds side by side: $out, the environment,
# the base build unpacked, and the GPU's name and clocks.
prepare() {
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    "$0" unpack
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
}

# The FP8 modes' tests (there, under `set +e`, with $out set): the parity
# suite (PARITY=0 leaves it out where none of its kernels changed), the
# FP8 tensor-core and FP8 GEMM tests, the CUDA-graph tests, then the
# engine's tests on the synthetic models named by the arguments. Sets
# `failed` to 1 if any fails.
fp8_tests() {
    if [ "${PARITY:-1}" != 0 ]; then
        KILN_TEST_DEVICE=cuda timeout 120 .gpu/parity --test-threads 1 2>&1 | tee "$out/parity.log" | tail -3
        [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    fi
    for t in fp8_mma fp8_gemm; do
        KILN_TEST_DEVICE=cuda timeout 60 ".gpu/$t" --include-ignored --nocapture 2>&1 | tee -a "$out/parity.log" |
            grep -E "rel err|test result|panicked" | tail -12
        [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    done
    KILN_TEST_DEVICE=cuda timeout 60 .gpu/cuda_graphs --include-ignored 2>&1 | tee -a "$out/parity.log" | tail -3
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    KILN_TEST_DEVICE=cuda timeout 200 .gpu/engine --include-ignored --test-threads 1 --nocapture "$@" 2>&1 |
        tee -a "$out/parity.log" | grep -E "differ by|test result|panicked|FAILED" | tail -20
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
}

# API clients of one tenant (there, with $out set): `pd_clients CLIENTS
# PD...` runs scripts/clients.py at each client count of CLIENTS with each
# `--pd` mode in turn (DURATION_S seconds, default 25).
pd_clients() {
    local clients="$1" pd
    shift
    for pd in "$@"; do
        echo "== clients, --pd $pd" | tee -a "$out/pd.log"
        CLIENTS="$clients" DURATION_S="${DURATION_S:-25}" timeout 200 python3 scripts/clients.py \
            .gpu-bench/kiln .gpu-bench/kiln big synthetic:llama-3-8b --device cuda --kv fp8-static \
            --kv-memory 24GiB --pd "$pd" 2>&1 | grep -v INFO | tee -a "$out/pd.log"
    done
}

case "${1:-}" in
build)
    mkdir -p .gpu .gpu-model
    test_bin() {
        cargo test --release -p "$1" --test "$2" --no-run --message-format=json 2>/dev/null |
            python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == sys.argv[1] and m.get("executable"):
        print(m["executable"])' "$2"
    }
    cp "$(test_bin kiln-kernels parity)" .gpu/parity
    cp "$(test_bin kiln-kernels cuda_graphs)" .gpu/cuda_graphs
    cp "$(test_bin kiln-kernels fp8_gemm)" .gpu/fp8_gemm
    cp "$(test_bin kiln-kernels fp8_mma)" .gpu/fp8_mma
    cp "$(test_bin kiln-kernels skinny)" .gpu/skinny
    cp "$(test_bin kiln-kernels bf16_mlp)" .gpu/bf16_mlp
    cp "$(test_bin kiln-kernels nccl)" .gpu/nccl
    cp "$(test_bin kiln-tests gpu)" .gpu/engine
    cargo build --release -p kiln-kernels --example cuda_bench
    cp target/release/examples/cuda_bench .gpu/cuda_bench
    strip .gpu/*
    mkdir -p .gpu-bench
    cargo build --release -p kiln-host
    cp target/release/kiln .gpu-bench/kiln
    strip .gpu-bench/kiln
    model="${KILN_CACHE:-$HOME/.cache/kiln}/SmolLM2-135M-Instruct.Q4_1.gguf"
    if [ -f "$model" ]; then
        head -c 50000000 "$model" >.gpu-model/a
        tail -c +50000001 "$model" >.gpu-model/b
    else
        # The synthetic models' modes need no staged model.
        echo "no $model: .gpu-model not staged (run kiln once to fetch it)"
    fi
    ls -l .gpu .gpu-bench .gpu-model
    ;;
stage)
    mkdir -p /tmp/kiln-model
    cp ".gpu-model/$2" "/tmp/kiln-model/$2"
    ls -l /tmp/kiln-model
    ;;
run)
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
    set +e
    # Kernel timings first: they compare each new kernel with the one it
    # may replace on the same data, so a new kernel that fails the parity
    # tests below still leaves its error and its timing.
    timeout 180 .gpu/cuda_bench 2>&1 | tee "$out/bench.log"
    KILN_TEST_DEVICE=cuda timeout 120 .gpu/parity --test-threads 1 2>&1 | tee "$out/parity.log"
    parity=${PIPESTATUS[0]}
    # The CUDA-only tests are ignored unless asked for.
    KILN_TEST_DEVICE=cuda timeout 60 .gpu/cuda_graphs --include-ignored 2>&1 | tee -a "$out/parity.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || parity=1
    KILN_TEST_DEVICE=cuda timeout 60 .gpu/fp8_gemm --include-ignored --nocapture 2>&1 | tee -a "$out/parity.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || parity=1
    KILN_TEST_DEVICE=cuda timeout 60 .gpu/fp8_mma --include-ignored 2>&1 | tee -a "$out/parity.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || parity=1
    KILN_TEST_DEVICE=cuda timeout 60 .gpu/skinny --include-ignored 2>&1 | tee -a "$out/parity.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || parity=1
    KILN_TEST_DEVICE=cuda timeout 60 .gpu/bf16_mlp --include-ignored 2>&1 | tee -a "$out/parity.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || parity=1
    # Skipped, saying so, on one GPU.
    KILN_TEST_DEVICE=cuda timeout 90 .gpu/nccl --include-ignored --test-threads 1 --nocapture 2>&1 | tee -a "$out/parity.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || parity=1
    set -e
    if [ "$parity" -ne 0 ]; then
        echo "parity tests FAILED: no benchmark"
        exit 1
    fi
    if staged_model; then
        set +e
        KILN_TEST_DEVICE=cuda timeout 300 .gpu/engine --include-ignored --test-threads 1 --nocapture 2>&1 |
            tee "$out/engine.log"
        engine=${PIPESTATUS[0]}
        set -e
    else
        echo "no staged model: skipping the end-to-end engine tests" | tee "$out/engine.log"
        engine=0
    fi
    # GPU_BENCH=0 leaves the engine benchmark to a call of its own (one
    # call may run ten minutes at most).
    if [ -x .gpu-bench/kiln ] && [ "${GPU_BENCH:-1}" != 0 ]; then
        "$0" bench
    fi
    if [ "$engine" -ne 0 ]; then
        echo "engine tests FAILED"
        exit 1
    fi
    ;;
shutdown)
    # SIGTERM under load on CUDA: 200 streams whose clients went away, 8
    # that stay, then SIGTERM; kiln must end the streams cleanly and exit 0.
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    python3 scripts/shutdown_check.py .gpu-bench/kiln big synthetic:llama-3-8b \
        --device cuda --kv-memory 16GiB 2>&1 | tee "$out/shutdown.log"
    exit "${PIPESTATUS[0]}"
    ;;
bench)
    # The decode matrix (concurrency x KV format) and the PyTorch baseline, same GPU, one
    # call. BENCH_ARGS / TORCH_ARGS override the matrices.
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
    set +e
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-420}" .gpu-bench/kiln bench --model synthetic:llama-3-8b --device cuda \
        ${BENCH_ARGS:---concurrency 1,8,16,32,64,128,256 --prompt-tokens 1024 --gen-tokens 256 --kv-formats bf16,fp8,fp8-static --kv-memory 16GiB --integrity-ab} \
        2>&1 | tee "$out/kiln-bench.log"
    # CUDA graphs against launching each kernel, side by side.
    # shellcheck disable=SC2086
    timeout 150 .gpu-bench/kiln bench --model synthetic:llama-3-8b --device cuda --kv fp8 \
        --kv-memory 16GiB ${GRAPH_ARGS:---concurrency 1,8,64 --prompt-tokens 1024 --gen-tokens 64} \
        --compare-graphs 2>&1 | tee "$out/kiln-graphs.log"
    # Prefill: one query per token against the tensor-core kernel (PREFILL=1).
    if [ "${PREFILL:-0}" = 1 ]; then
        for flash in "--tensor-prefill off" ""; do
            # shellcheck disable=SC2086
            timeout 120 .gpu-bench/kiln bench --model synthetic:llama-3-8b --device cuda --kv fp8 \
                --kv-memory 16GiB --concurrency 1,16 --prompt-tokens 1024 --gen-tokens 8 $flash \
                2>&1 | tee -a "$out/kiln-prefill.log"
        done
    fi
    # shellcheck disable=SC2086
    timeout "${TORCH_TIMEOUT:-150}" python3 scripts/torch_baseline.py ${TORCH_ARGS:---batches 1,8,32,64} \
        2>&1 | grep -v Warning | tee "$out/torch-baseline.log"
    ;;
prefill)
    # Prefill against the plain-PyTorch reference, same GPU, one call:
    # prompt tokens/s at 1x1024, 8x1024, 32x1024 and 1x4096 (carry
    # .gpu-bench).
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    # With .gpu carried too, the attention parity tests run first and a
    # failure stops the call. Each shape runs with the defaults (tensor),
    # and blocks of 4 or 8 warps asked for (PREFILL_MODES overrides the
    # list; per-token is one decode-attention query per token, mlp32 the
    # f32 MLP).
    if [ -x .gpu/parity ]; then
        KILN_TEST_DEVICE=cuda timeout 120 .gpu/parity --test-threads 1 attention 2>&1 | tee "$out/parity.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "parity tests FAILED: no benchmark"; exit 1; }
    fi
    set +e
    for mode in ${PREFILL_MODES:-tensor tensor4 tensor8}; do
        flag=""
        [ "$mode" = per-token ] && flag="--tensor-prefill off"
        [ "$mode" = tensor4 ] && flag="--prefill-warps 4"
        [ "$mode" = tensor8 ] && flag="--prefill-warps 8"
        [ "$mode" = mlp32 ] && flag="--cuda-bf16-mlp off"
        for case in "1,8,32 --prompt-tokens 1024" "1 --prompt-tokens 4096"; do
            echo "== prefill attention: $mode" | tee -a "$out/kiln-prefill.log"
            # shellcheck disable=SC2086
            timeout 200 .gpu-bench/kiln bench --model synthetic:llama-3-8b --device cuda --gen-tokens 2 \
                --kv-formats bf16,fp8-static --kv-memory 16GiB $flag --concurrency $case 2>&1 |
                grep -v INFO | tee -a "$out/kiln-prefill.log"
        done
    done
    # A 4096-token prompt cold and with its prefix cached, each step timed.
    for graphs in on off; do
        timeout 120 .gpu-bench/kiln bench --model synthetic:llama-3-8b --device cuda --kv fp8-static \
            --kv-memory 16GiB --ttft 4 --prompt-tokens 4096 --cuda-graphs "$graphs" 2>&1 |
            grep -v INFO | tee -a "$out/ttft.log"
    done
    timeout 200 python3 scripts/torch_prefill.py 2>&1 | grep -v Warning | tee "$out/torch-prefill.log"
    ;;
weights)
    # Decode by weight format, the seed's table: bf16 weights against FP8
    # rows (--weights fp8, W8A16 GEMV), int4 (--weights int4, tensor-core
    # tiles) and the two phases apart (prefill on FP8 rows, decode on int4),
    # same model and KV, one call (carry .gpu-bench; WEIGHTS overrides the
    # list).
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    set +e
    for weights in ${WEIGHTS:-native fp8 int4 prefill=fp8,decode=int4}; do
        echo "== weights: $weights" | tee -a "$out/weights.log"
        flags=(--weights "$weights")
        timeout 250 .gpu-bench/kiln bench --model synthetic:llama-3-8b --device cuda "${flags[@]}" \
            --kv fp8 --kv-memory 16GiB --concurrency 1,8,16,32,64 --prompt-tokens 512 --gen-tokens 128 \
            2>&1 | grep -v INFO | tee -a "$out/weights.log"
    done
    ;;
skinny | cluster)
    # Decode with bf16 weights: cuBLAS alone and the skinny GEMM at 2-16
    # rows (or the cluster GEMM at 17-64) beside it, same call (carry
    # .gpu-bench).
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    for flags in "--cuda-$1 off" "--cuda-$1 on"; do
        echo "== $flags" | tee -a "$out/$1.log"
        # shellcheck disable=SC2086
        timeout 200 .gpu-bench/kiln bench --model synthetic:llama-3-8b --device cuda --kv fp8 \
            --kv-memory 16GiB --concurrency 1,8,16,32,64 --prompt-tokens 512 --gen-tokens 128 \
            $flags 2>&1 | grep -v INFO | tee -a "$out/$1.log"
    done
    ;;
neighbour)
    # One tenant's burst against another's stream, through the API: this
    # tree's server with the step time target off and at its default, same
    # call (carry .gpu-bench; this tree's `kiln loadgen` drives every run).
    # TARGETS and SERVERS override (SERVERS="/tmp/kiln-base .gpu-bench/kiln"
    # after `unpack` for the base build beside this one); SERVE_ARGS adds
    # serve arguments (`--pd on`).
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    export ALONE_S="${ALONE_S:-10}" BURST_S="${BURST_S:-20}"
    for server in ${SERVERS:-.gpu-bench/kiln}; do
        for target in ${TARGETS:-0 1.8}; do
            echo "== $server --step-target $target ${SERVE_ARGS:-}" | tee -a "$out/neighbour.log"
            # shellcheck disable=SC2086
            timeout 150 python3 scripts/noisy_neighbour.py "$server" .gpu-bench/kiln big synthetic:llama-3-8b \
                --device cuda --kv fp8-static --kv-memory 16GiB --step-target "$target" ${SERVE_ARGS:-} 2>&1 |
                grep -v INFO | tee -a "$out/neighbour.log"
        done
    done
    ;;
pd-goals)
    # Issue 18's PD goals in one call (carry .gpu, .gpu-bench/kiln.xz,
    # .gpu-bench/kiln-base.xz): the CUDA-graph tests and the engine's
    # working-buffer tests first, then the neighbour at target 1.3 with
    # `--pd on` and `--pd off` (PD_ARGS overrides, ";" apart), then 256
    # clients of one tenant with PD on and off (PD_CLIENTS overrides; empty
    # skips them). Fails if a test fails.
    prepare
    set +e
    failed=0
    KILN_TEST_DEVICE=cuda timeout 60 .gpu/cuda_graphs --include-ignored 2>&1 | tee "$out/tests.log" | tail -3
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    KILN_TEST_DEVICE=cuda timeout 200 .gpu/engine --include-ignored --test-threads 1 memory:: 2>&1 |
        tee -a "$out/tests.log" | grep -E "test |test result|panicked" | tail -8
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    IFS=';' read -ra pd_args <<<"${PD_ARGS:---pd on;--pd off}"
    for args in "${pd_args[@]}"; do
        TARGETS="${TARGETS:-1.3}" SERVE_ARGS="$args" "$0" neighbour
    done
    [ -z "${PD_CLIENTS-256}" ] || DURATION_S="${DURATION_S:-20}" pd_clients "${PD_CLIENTS-256}" on off
    exit "$failed"
    ;;
prefill-weights)
    # Prompt tok/s by weight format at 1x1024 and 8x1024 (WEIGHTS, default
    # "native fp8"; carry .gpu-bench): issue 18's FP8 prefill against bf16.
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    for weights in ${WEIGHTS:-native fp8}; do
        echo "== $weights" | tee -a "$out/prefill-weights.log"
        timeout 120 .gpu-bench/kiln bench --model synthetic:llama-3-8b --device cuda --weights "$weights" \
            --kv fp8 --kv-memory 16GiB --concurrency 1,8 --prompt-tokens 1024 --gen-tokens 2 2>&1 |
            grep -v INFO | tee -a "$out/prefill-weights.log"
    done
    ;;
pd)
    # Prefill/decode disaggregation off and on, same call (carry
    # .gpu-bench): the decode matrix, then 64 and 256 API clients
    # (PD_CLIENTS overrides; empty skips them).
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    for pd in off on; do
        echo "== --pd $pd" | tee -a "$out/pd.log"
        timeout 150 .gpu-bench/kiln bench --model synthetic:llama-3-8b --device cuda --kv fp8 \
            --kv-memory 16GiB --concurrency 1,16,64 --prompt-tokens 512 --gen-tokens 128 \
            --pd "$pd" 2>&1 | grep -v INFO | tee -a "$out/pd.log"
    done
    [ -z "${PD_CLIENTS-64 256}" ] || pd_clients "${PD_CLIENTS-64 256}" off on
    ;;
gpus)
    # Decode pools across GPUs (issue 22; a machine of two GPUs or more):
    # the engine's two-GPU pool test, then output tok/s through the API at
    # CLIENTS (default 256) with one pool on GPU 0, one pool on each GPU
    # (`--device cuda:all`), and a prefill pool on GPU 0 handing on to a
    # decode pool on GPU 1, same call (carry .gpu, .gpu-bench/kiln.xz).
    prepare_gpus
    staged_model || echo "no staged model (scripts/gpu.sh stage a, stage b): the engine tests will fail"
    set +e
    # NCCL's sums, and their end when a rank fails.
    KILN_TEST_DEVICE=cuda timeout 90 .gpu/nccl --include-ignored --test-threads 1 --nocapture 2>&1 | tee "$out/pools.log" | tail -4
    failed=${PIPESTATUS[0]}
    KILN_TEST_DEVICE=cuda timeout 200 .gpu/engine --include-ignored --nocapture pools_on_two_gpus 2>&1 |
        tee -a "$out/pools.log" | grep -E "SKIPPED|test result|panicked" | tail -4
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    # Tensor-parallel ranks summed by NCCL where there are three GPUs.
    KILN_TEST_DEVICE=cuda timeout 300 .gpu/engine --include-ignored --test-threads 1 --nocapture three_gpu_ranks 2>&1 |
        tee -a "$out/pools.log" | grep -E "ranks on|test result|panicked" | tail -6
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    for placed in "--device cuda:0" "--device cuda:all" "--device cuda:1 --prefill-device cuda:0"; do
        echo "== $placed" | tee -a "$out/gpus.log"
        # shellcheck disable=SC2086
        CLIENTS="${CLIENTS:-256}" DURATION_S="${DURATION_S:-25}" timeout 240 python3 scripts/clients.py \
            .gpu-bench/kiln .gpu-bench/kiln big synthetic:llama-3-8b $placed --kv fp8-static \
            --kv-memory 24GiB 2>&1 | grep -v INFO | tee -a "$out/gpus.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    done
    exit "$failed"
    ;;
tp)
    # Tensor parallelism (issue 22; two GPUs or more): synthetic
    # Llama-3-70B in bf16 (141 GB, more than one GPU) over two ranks, NCCL
    # between them, decode at 1 and 8 sequences against the two GPUs'
    # roofline (each reads its half); then 8B on one GPU and over two, same
    # call (carry .gpu-bench/kiln.xz; the host builds the 70B model in RAM).
    prepare_gpus
    set +e
    failed=0
    for run in "synthetic:llama-3-70b --tensor-parallel 2" "synthetic:llama-3-8b" \
        "synthetic:llama-3-8b --tensor-parallel 2"; do
        echo "== $run" | tee -a "$out/tp.log"
        # shellcheck disable=SC2086
        timeout 280 .gpu-bench/kiln bench --model $run --device cuda:0 --kv fp8 --kv-memory 16GiB \
            ${TP_ARGS:---concurrency 1,8 --prompt-tokens 512 --gen-tokens 64} 2>&1 | tee -a "$out/tp.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    done
    exit "$failed"
    ;;
constrained)
    # Decode free and under an output format (JSON that never ends, so
    # every token is drawn through its mask), side by side, one call.
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    # shellcheck disable=SC2086
    timeout "${BENCH_TIMEOUT:-300}" .gpu-bench/kiln bench --model synthetic:llama-3-8b --device cuda \
        ${CONSTRAINED_ARGS:---kv fp8 --kv-memory 16GiB --concurrency 1,16,64 --prompt-tokens 512 --gen-tokens 128} \
        --compare-constrained 2>&1 | grep -v INFO | tee "$out/constrained.log"
    exit "${PIPESTATUS[0]}"
    ;;
clients)
    # Output tok/s and TTFT through the API at 1-256 clients (1024-token
    # prompts, 256 generated), fp8-static pages with room for 256 such
    # requests (carry .gpu-bench; CLIENTS, DURATION_S override).
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    timeout "${CLIENTS_TIMEOUT:-400}" python3 scripts/clients.py .gpu-bench/kiln .gpu-bench/kiln big \
        synthetic:llama-3-8b --device cuda --kv fp8-static --kv-memory 24GiB 2>&1 |
        grep -v INFO | tee "$out/clients.log"
    exit "${PIPESTATUS[0]}"
    ;;
profile)
    # Nsight Compute on one kernel's first launch in `cuda_bench` (carry
    # .gpu): `scripts/gpu.sh profile REGEX [SECTION...]`, e.g.
    # `profile prefill_bf16_d128_w4 WarpStateStats SchedulerStats`. The
    # process ends right after the launch, so the report is printed even
    # when the rest of the bench would outlast the call. BENCH_ARGS picks
    # the bench's part (`one-row 28672x4096`: the one-row int4 and FP8-row
    # products at one shape), SKIP the launches to pass over first; the
    # per-instruction samples go to $out/profile.sass.csv.
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    export LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
    kernel="$2"
    shift 2
    sections=()
    for s in "${@:-SpeedOfLight Occupancy LaunchStats WarpStateStats SchedulerStats InstructionStats ComputeWorkloadAnalysis MemoryWorkloadAnalysis SourceCounters}"; do
        for one in $s; do sections+=(--section "$one"); done
    done
    # shellcheck disable=SC2086
    timeout "${PROFILE_TIMEOUT:-150}" /usr/local/cuda/bin/ncu -k "regex:$kernel" -s "${SKIP:-0}" -c 1 \
        --kill on --clock-control none "${sections[@]}" --export /tmp/profile \
        .gpu/cuda_bench ${BENCH_ARGS:-} 2>&1 | tee "$out/profile.log"
    /usr/local/cuda/bin/ncu --import /tmp/profile.ncu-rep --page details 2>&1 | tee -a "$out/profile.log"
    /usr/local/cuda/bin/ncu --import /tmp/profile.ncu-rep --page source --print-source sass --csv \
        >"$out/profile.sass.csv" 2>&1
    ;;
baseline)
    # Here: the `kiln` of another revision (default: main), stripped and
    # xz-compressed into .gpu-bench/kiln-base.xz, so a call can run it side
    # by side with this tree's (two plain binaries exceed one call's 64
    # MiB). There: `scripts/gpu.sh unpack` puts it at /tmp/kiln-base.
    rev="${2:-main}"
    wt="$(mktemp -d)"
    git worktree add -q --detach "$wt" "$rev"
    # The same target directory, so the dependencies are reused (this
    # tree's crates are touched after it; see below).
    target="$PWD/target"
    (cd "$wt" && CARGO_TARGET_DIR="$target" cargo build --release -p kiln-host --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "kiln" and m.get("executable"):
        print(m["executable"])' >"$wt/.kiln-path")
    mkdir -p .gpu-bench
    strip -o "$wt/kiln" "$(cat "$wt/.kiln-path")"
    xz -T2 -6 -c "$wt/kiln" >.gpu-bench/kiln-base.xz
    git worktree remove --force "$wt"
    # Cargo names a path crate's artifacts by its path within the
    # workspace, so the worktree's crates overwrote this tree's in the
    # shared target directory with fingerprints that look fresh: touch this
    # tree's crates so the next build compiles them again.
    touch kernels/src/lib.rs host/engine/src/lib.rs host/src/main.rs runtime/src/lib.rs tests/src/lib.rs 2>/dev/null || true
    echo "$(git rev-parse --short "$rev"): .gpu-bench/kiln-base.xz"
    ls -l .gpu-bench
    ;;
unpack)
    xz -d -c .gpu-bench/kiln-base.xz >/tmp/kiln-base
    chmod +x /tmp/kiln-base
    unpack_kiln
    ;;
int4)
    # Int4 decode at one sequence: the kernel tests (parity, the device
    # tests, the engine's fold test), the one-row int4 products timed
    # beside the two-launch path (`cuda_bench quantized`; QUANTIZED=0
    # leaves it out), then int4 decode
    # at CONC sequences (default 1,8) by the base build (`baseline` here)
    # and this tree's in turn, and this tree's again with the flags in ALSO
    # (e.g. ALSO="--cuda-fold-int4 on") where set; BASE=0 leaves out the
    # base build (carry .gpu,
    # .gpu-bench/kiln.xz, .gpu-bench/kiln-base.xz). Fails if a test fails.
    prepare
    set +e
    failed=0
    # TESTS=0 leaves the tests out (for a second call on a warm machine
    # that already ran them: one call's ten minutes hold three decode runs
    # or the tests and two).
    if [ "${TESTS:-1}" != 0 ]; then
        KILN_TEST_DEVICE=cuda timeout 120 .gpu/parity --test-threads 1 2>&1 | tee "$out/parity.log" | tail -4
        [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
        KILN_TEST_DEVICE=cuda timeout 100 .gpu/cuda_graphs --include-ignored --nocapture 2>&1 |
            tee -a "$out/parity.log" | grep -E "against|vs float64|test result|panicked" | tail -16
        [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
        # The engine's int4 test: folded steps against unfolded ones.
        KILN_TEST_DEVICE=cuda timeout 100 .gpu/engine --include-ignored --nocapture folded_norms 2>&1 |
            tee -a "$out/parity.log" | grep -E "row 35|test result|panicked" | tail -4
        [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    fi
    if [ "${QUANTIZED:-1}" != 0 ]; then
        timeout 150 .gpu/cuda_bench quantized 2>&1 | tee "$out/bench.log" | grep -E "Int4|two launches|cold|device"
    fi
    # Each run: a binary, then any flags for its bench.
    runs=(/tmp/kiln-base .gpu-bench/kiln)
    [ -n "${ALSO:-}" ] && runs+=(".gpu-bench/kiln $ALSO")
    [ "${BASE:-1}" != 0 ] || runs=("${runs[@]:1}")
    for round in $(seq "${ROUNDS:-1}"); do
        for run in "${runs[@]}"; do
            echo "== round $round: $run" | tee -a "$out/ab.log"
            read -ra flags <<<"$run"
            timeout 300 "${flags[0]}" bench "${flags[@]:1}" --model synthetic:llama-3-8b --device cuda \
                --weights int4 --kv fp8 --kv-memory 16GiB --concurrency "${CONC:-1,8}" \
                --prompt-tokens 512 --gen-tokens 128 2>&1 | grep -v INFO | tee -a "$out/ab.log"
            [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
        done
    done
    exit "$failed"
    ;;
fp8-decode)
    # FP8 rows at decode: the parity suite, the FP8 tensor-core kernel's
    # tests, its products beside cuBLASLt's (`cuda_bench quantized`), the
    # engine's FP8 and graph tests, then decode tok/s at 1-64 sequences on
    # FP8 rows by the base build (`baseline` here) and this tree's, and on
    # bf16 weights by this tree's (carry .gpu, .gpu-bench/kiln.xz,
    # .gpu-bench/kiln-base.xz). Fails if a test fails.
    prepare
    set +e
    failed=0
    fp8_tests fp8_weights bf16_mlp bf16_weights_through
    # BENCH=0 leaves out the products alone.
    if [ "${BENCH:-1}" != 0 ]; then
        timeout 150 .gpu/cuda_bench quantized 2>&1 | tee "$out/bench.log" | grep -E "Fp8|cuBLASLt|cold|device|copy"
    fi
    IFS=, read -ra cases <<<"${CASES:-/tmp/kiln-base fp8,.gpu-bench/kiln fp8,.gpu-bench/kiln native}"
    for case in "${cases[@]}"; do
        set -- $case
        echo "== $1 --weights $2" | tee -a "$out/fp8-decode.log"
        timeout 200 "$1" bench --model synthetic:llama-3-8b --device cuda --weights "$2" --kv fp8 \
            --kv-memory 16GiB --concurrency "${CONC:-1,8,16,32,64}" --prompt-tokens 512 --gen-tokens 128 \
            2>&1 | grep -v INFO | tee -a "$out/fp8-decode.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    done
    # PROFILE=1: Nsight Compute's kernel durations over one decode step of
    # one sequence on FP8 rows.
    if [ -n "${PROFILE:-}" ]; then
        WEIGHTS=fp8 NCU_ONLY=1 GEN=4 scripts/ncu_step.sh fp8 1 512 2>&1 | head -40 | tee -a "$out/fp8-decode.log"
    fi
    exit "$failed"
    ;;
fp8-prefill)
    # Issue 18's FP8 prefill: the FP8 GEMM and parity tests, prompt tok/s
    # by weight format at 1x1024, 8x1024 and 8x1024 in one 8192-token step,
    # by the base build (`baseline` here, FP8 rows) and this tree's, then
    # Nsight Compute's kernel durations over one 1024-token prefill step of
    # each format (carry .gpu, .gpu-bench/kiln.xz, .gpu-bench/kiln-base.xz).
    prepare
    set +e
    failed=0
    fp8_tests fp8_weights bf16_mlp skinny_gemm cluster_gemm bf16_weights_through
    # cuBLASLt's W8A8 algorithms one by one at prefill's products (BENCH=0
    # leaves it out).
    if [ "${BENCH:-1}" != 0 ]; then
        timeout 200 .gpu/cuda_bench fp8lt 2>&1 | tee "$out/fp8lt.log"
    fi
    # The base build on FP8 rows only (bf16 weights take the same path in
    # both); CASES="BIN WEIGHTS [FLAGS...],..." overrides.
    IFS=, read -ra cases <<<"${CASES:-/tmp/kiln-base fp8,.gpu-bench/kiln fp8,.gpu-bench/kiln native}"
    for case in "${cases[@]}"; do
        set -- $case
        bin="$1" weights="$2"
        shift 2
        flags="$*"
        # RUNS="CONC[ FLAGS];..." overrides the runs of each case.
        IFS=';' read -ra runs <<<"${RUNS:-1,8;8 --step-tokens 8192}"
        for run in "${runs[@]}"; do
            echo "== $bin --weights $weights $flags --concurrency $run" | tee -a "$out/fp8-prefill.log"
            # Each step's wall and device time, to tell kernels from gaps.
            trace="$out/trace-$(basename "$bin")-$weights-$(tr ' ,' '_-' <<<"$run")"
            mkdir -p "$trace"
            # shellcheck disable=SC2086
            timeout 120 "$bin" bench --model synthetic:llama-3-8b --device cuda --weights "$weights" $flags \
                --kv fp8 --kv-memory 16GiB --prompt-tokens 1024 --gen-tokens 2 --trace "$trace" --concurrency $run 2>&1 |
                grep -v INFO | tee -a "$out/fp8-prefill.log"
            [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
        done
    done
    for weights in ${PROFILE_WEIGHTS-fp8 native}; do
        csv="$out/ncu-prefill-$weights.csv"
        timeout 200 /usr/local/cuda/bin/ncu --csv --print-units base --clock-control none \
            --cache-control none --metrics gpu__time_duration.sum .gpu-bench/kiln bench \
            --model synthetic:llama-3-8b --device cuda --weights "$weights" --kv fp8 --kv-memory 8GiB \
            --concurrency 1 --prompt-tokens 1024 --gen-tokens 2 --cuda-graphs off >"$csv" 2>"$csv.err"
        python3 scripts/ncu_step.py "$csv" prefill 2>&1 | head -40 | tee -a "$out/fp8-prefill.log"
    done
    exit "$failed"
    ;;
ab)
    # The base build (`baseline` here) and this tree's, the same decode
    # benchmark side by side, ROUNDS times in turn (AB_ARGS overrides it).
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    "$0" unpack
    # Same tokens first: greedy and seeded sampling, on the default model
    # (GGUF blocks) and a bf16 one (stacked GEMMs, folded norms, graphs).
    same=0
    for case in "smollm2-135m-instruct --kv bf16 --temperature 0" \
        "smollm2-135m-instruct --kv fp8 --temperature 0.8 --seed 7" \
        "synthetic:llama-3.2-1b --kv fp8 --temperature 0"; do
        # shellcheck disable=SC2086
        set -- $case
        model="$1"
        shift
        for bin in /tmp/kiln-base .gpu-bench/kiln; do
            timeout 120 "$bin" run --model "$model" --prompt "The three primary colors are" \
                --max-tokens 48 --device cuda --json "$@" 2>/dev/null |
                python3 -c 'import json,sys; print(json.load(sys.stdin)["token_ids"])' >"/tmp/tokens-$(basename "$bin")"
        done
        if cmp -s /tmp/tokens-kiln-base /tmp/tokens-kiln; then
            echo "same tokens: $case: $(cat /tmp/tokens-kiln)" | tee -a "$out/ab.log"
        else
            same=1
            echo "DIFFERENT tokens: $case" | tee -a "$out/ab.log"
            cat /tmp/tokens-kiln-base /tmp/tokens-kiln | tee -a "$out/ab.log"
        fi
    done
    for round in $(seq "${ROUNDS:-1}"); do
        for bin in /tmp/kiln-base .gpu-bench/kiln; do
            echo "== round $round: $bin" | tee -a "$out/ab.log"
            # shellcheck disable=SC2086
            timeout "${AB_TIMEOUT:-280}" "$bin" bench --model synthetic:llama-3-8b --device cuda \
                ${AB_ARGS:---concurrency 1,64,256 --prompt-tokens 1024 --gen-tokens 256 --kv-formats bf16,fp8 --kv-memory 16GiB} \
                2>&1 | tee -a "$out/ab.log"
        done
    done
    exit "$same"
    ;;
*)
    echo "usage: scripts/gpu.sh build | baseline [REV] | stage a|b | unpack | run | bench | ab | prefill | weights | skinny | cluster | neighbour | clients | shutdown | profile REGEX [SECTION...]" >&2
    exit 2
    ;;
esac
