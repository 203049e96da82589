# shellcheck shell=bash
# scripts/gpu.sh's modes across GPUs (there; two GPUs or more): decode
# pools on each GPU, a prefill pool handing on, tensor-parallel ranks.
# $out is set by gpu.sh's prepare_gpus.
# shellcheck disable=SC2154

mode_gpus() {
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
    # A 1024-token prompt's pages handed from GPU 0 to GPU 1, timed against
    # its time to first token (issue 22: <= 5%).
    KILN_TEST_DEVICE=cuda timeout 120 .gpu/engine --include-ignored --nocapture prefilled_by_one_gpu_engine 2>&1 |
        tee -a "$out/pools.log" | grep -E "moved as|test result|panicked" | tail -4
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    # Tensor-parallel ranks summed by NCCL where there are three GPUs.
    KILN_TEST_DEVICE=cuda timeout 300 .gpu/engine --include-ignored --test-threads 1 --nocapture three_gpu_ranks 2>&1 |
        tee -a "$out/pools.log" | grep -E "ranks on|test result|panicked" | tail -6
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    for placed in "--device cuda:0" "--device cuda:all" "--device cuda:1 --prefill-device cuda:0"; do
        echo "== $placed" | tee -a "$out/gpus.log"
        # Each client keeps a session of its own (issue 22: affinity intact,
        # which clients.py reads from the spills).
        # shellcheck disable=SC2086
        CLIENTS="${CLIENTS:-256}" DURATION_S="${DURATION_S:-25}" SESSIONS=per-client \
            timeout 240 python3 scripts/clients.py \
            .gpu-bench/kiln .gpu-bench/kiln big synthetic:llama-3-8b $placed --kv fp8-static \
            --kv-memory 24GiB 2>&1 | grep -v INFO | tee -a "$out/gpus.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    done
    exit "$failed"
}

mode_tp() {
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
}
