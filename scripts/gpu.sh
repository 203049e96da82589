#!/usr/bin/env bash
# CUDA tests and benchmarks on a GPU machine.
#
# Here (no GPU needed):   scripts/gpu.sh build
#   builds the binaries into .gpu/ (git-ignored).
# There (with .gpu carried): scripts/gpu.sh run
#   the single command that runs every CUDA test and benchmark, writing
#   logs to $OUT (or ./gpu-out) and printing a short summary last.
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
build)
    mkdir -p .gpu
    bin=$(cargo test --release -p kiln-kernels --test parity --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "parity" and m.get("executable"):
        print(m["executable"])')
    cp "$bin" .gpu/parity
    cargo build --release -p kiln-kernels --example cuda_bench
    cp target/release/examples/cuda_bench .gpu/cuda_bench
    ls -l .gpu
    ;;
run)
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    export RUST_BACKTRACE=0 KILN_CACHE=/tmp/kiln-cache LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}"
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
    set +e
    KILN_TEST_DEVICE=cuda timeout 120 .gpu/parity --test-threads 1 2>&1 | tee "$out/parity.log"
    parity=${PIPESTATUS[0]}
    set -e
    if [ "$parity" -ne 0 ]; then
        echo "parity tests FAILED: no benchmark"
        exit 1
    fi
    timeout 240 .gpu/cuda_bench 2>&1 | tee "$out/bench.log"
    ;;
*)
    echo "usage: scripts/gpu.sh build | run" >&2
    exit 2
    ;;
esac
