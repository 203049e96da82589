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
# tp` tensor-parallel ranks on two GPUs. Here are the helpers and the
# modes every visit uses; the others live by topic in scripts/gpu/*.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

# There: the environment every mode runs in. Kiln loads NCCL as
# libnccl.so, which the pip wheel (nvidia-nccl-cu13, beside PyTorch) names
# libnccl.so.2: a link in /tmp/kiln-lib gives it that name.
device_env() {
    # NVLink multicast stays off (the machines set it; a program with an
    # environment of its own must too). NCCL_RUNTIME_CONNECT is left as
    # NCCL has it, so the tests meet the connections Kiln's warm-up makes.
    export RUST_BACKTRACE=0 KILN_CACHE=/tmp/kiln-cache NCCL_NVLS_ENABLE=0
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

mode_build() {
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
    cp "$(test_bin kiln-kernels device_fault)" .gpu/device_fault
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
}

mode_stage() {
    mkdir -p /tmp/kiln-model
    cp ".gpu-model/$2" "/tmp/kiln-model/$2"
    ls -l /tmp/kiln-model
}

mode_run() {
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
    set +e
    # Kernel timings first: they compare each new kernel with the one it
    # may replace on the same data, so a new kernel that fails the parity
    # tests below still leaves its error and its timing (BENCH=0 leaves
    # them out, for a call that must hold every test in its ten minutes).
    if [ "${BENCH:-1}" != 0 ]; then
        timeout 180 .gpu/cuda_bench 2>&1 | tee "$out/bench.log"
    fi
    # PARITY=0 leaves the kernel tests to a call of their own (an engine
    # suite on an unchanged kernel tree).
    parity=0
    if [ "${PARITY:-1}" != 0 ]; then
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
        KILN_TEST_DEVICE=cuda timeout 60 .gpu/device_fault --include-ignored 2>&1 | tee -a "$out/parity.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || parity=1
        # Skipped, saying so, on one GPU.
        KILN_TEST_DEVICE=cuda timeout 90 .gpu/nccl --include-ignored --test-threads 1 --nocapture 2>&1 | tee -a "$out/parity.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || parity=1
    fi
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
}

mode_bench() {
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
}

mode_baseline() {
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
}

mode_unpack() {
    # A visit that runs no base build carries none.
    if [ -f .gpu-bench/kiln-base.xz ]; then
        xz -d -c .gpu-bench/kiln-base.xz >/tmp/kiln-base
        chmod +x /tmp/kiln-base
    fi
    unpack_kiln
}

# The other modes, a file of them a topic.
for part in scripts/gpu/*.sh; do
    # shellcheck source=/dev/null
    source "$part"
done

mode="${1:-}"
if ! declare -F "mode_${mode//-/_}" >/dev/null; then
    modes="$(declare -F | sed -n 's/^declare -f mode_//p' | tr _ - | tr '\n' ' ')"
    echo "usage: scripts/gpu.sh MODE [ARGS]; MODE: ${modes% }" >&2
    echo "  (stage a|b, baseline [REV], profile REGEX [SECTION...] take arguments)" >&2
    exit 2
fi
"mode_${mode//-/_}" "$@"
