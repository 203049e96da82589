# shellcheck shell=bash
# scripts/gpu.sh's kernel and weight-format modes (there): prefill, the
# weight formats' decode table, the skinny and cluster GEMMs, int4 and FP8
# kernels beside a base build.

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

mode_prefill() {
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
}

mode_weights() {
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
}

mode_skinny() {
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
}

mode_cluster() {
    mode_skinny "$@"
}

mode_tune_bf16() {
    # cuBLASLt's bf16 algorithms against cublasGemmEx at decode's products,
    # weights out of L2 (`cuda_bench bf16lt`), then decode at 32 and 64
    # sequences with neither, each and both of the tuned algorithms and the
    # bf16 MLP on decode steps, same call (carry .gpu, .gpu-bench).
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    unpack_kiln
    timeout 150 .gpu/cuda_bench bf16lt 2>&1 | tee "$out/bf16lt.log"
    for flags in "--cuda-tune-bf16 off --cuda-bf16-mlp-decode off" \
        "--cuda-tune-bf16 on --cuda-bf16-mlp-decode off" \
        "--cuda-tune-bf16 off --cuda-bf16-mlp-decode on" \
        "--cuda-tune-bf16 on --cuda-bf16-mlp-decode on"; do
        echo "== $flags" | tee -a "$out/tune-bf16.log"
        # shellcheck disable=SC2086
        timeout 150 .gpu-bench/kiln bench --model synthetic:llama-3-8b --device cuda --kv fp8 \
            --kv-memory 16GiB --concurrency 32,64 --prompt-tokens 512 --gen-tokens 128 \
            $flags 2>&1 | grep -v INFO | tee -a "$out/tune-bf16.log"
    done
}

mode_prefill_weights() {
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
}

mode_int4() {
    # Int4 decode at one and a few sequences: the kernel tests (parity,
    # the device tests, the engine's fold and few-row tests), the int4
    # products of 1-8 rows timed beside the two-launch path (`cuda_bench
    # quantized`; QUANTIZED=0 leaves it out), then int4 decode at CONC
    # sequences (default 1,8) by the base build (`baseline` here) and this
    # tree's in turn, and this tree's again with each set of flags in ALSO
    # (sets apart by ';', e.g. ALSO="--cuda-int4-rows off", or
    # ALSO="--weights int4,head=int4; --weights int4,head=int4
    # --cuda-fused-merge on" for an int4 output head, then with the fused
    # merge too) where set; BASE=0
    # leaves out the base build, DECODE=0 every decode run (carry .gpu,
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
        KILN_TEST_DEVICE=cuda timeout 150 .gpu/cuda_graphs --include-ignored --nocapture 2>&1 |
            tee -a "$out/parity.log" | grep -E "against|vs float64|test result|panicked" | tail -24
        [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
        # The engine's int4 tests: folded steps against unfolded ones, the
        # few-row products in one launch against two; and the fused
        # attention merge against the merge launch.
        KILN_TEST_DEVICE=cuda timeout 150 .gpu/engine --include-ignored --nocapture folded_norms int4_products merged_by_its_last_block 2>&1 |
            tee -a "$out/parity.log" | grep -E "row 35|row 0:|test result|panicked" | tail -8
        [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    fi
    if [ "${QUANTIZED:-1}" != 0 ]; then
        timeout 240 .gpu/cuda_bench quantized 2>&1 | tee "$out/bench.log" | grep -E "Int4|launch|cold|device"
    fi
    # Each run: a binary, then any flags for its bench.
    runs=(/tmp/kiln-base .gpu-bench/kiln)
    IFS=';' read -ra also <<<"${ALSO:-}"
    for flags in "${also[@]}"; do runs+=(".gpu-bench/kiln $flags"); done
    [ "${BASE:-1}" != 0 ] || runs=("${runs[@]:1}")
    # DECODE=0 leaves out the decode runs (a first call of tests and
    # products alone, the runs in a second on the warm machine).
    [ "${DECODE:-1}" != 0 ] || runs=()
    for round in $(seq "${ROUNDS:-1}"); do
        for run in "${runs[@]}"; do
            echo "== round $round: $run" | tee -a "$out/ab.log"
            read -ra flags <<<"$run"
            # int4 weights, unless the run names its own.
            [[ " ${flags[*]} " == *" --weights "* ]] || flags+=(--weights int4)
            timeout 300 "${flags[0]}" bench "${flags[@]:1}" --model synthetic:llama-3-8b --device cuda \
                --kv fp8 --kv-memory 16GiB --concurrency "${CONC:-1,8}" \
                --prompt-tokens 512 --gen-tokens 128 2>&1 | grep -v INFO | tee -a "$out/ab.log"
            [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
        done
    done
    exit "$failed"
}

mode_fp8_decode() {
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
        # shellcheck disable=SC2086
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
}

mode_fp8_prefill() {
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
        # shellcheck disable=SC2086
        set -- $case
        bin="$1" weights="$2"
        shift 2
        also="$*"
        # RUNS="CONC[ FLAGS];..." overrides the runs of each case.
        IFS=';' read -ra runs <<<"${RUNS:-1,8;8 --step-tokens 8192}"
        for run in "${runs[@]}"; do
            echo "== $bin --weights $weights $also --concurrency $run" | tee -a "$out/fp8-prefill.log"
            # Each step's wall and device time, to tell kernels from gaps.
            trace="$out/trace-$(basename "$bin")-$weights-$(tr ' ,' '_-' <<<"$run")"
            mkdir -p "$trace"
            # shellcheck disable=SC2086
            timeout 120 "$bin" bench --model synthetic:llama-3-8b --device cuda --weights "$weights" $also \
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
}

# The FP8 fold modes' start (there): prepare, `set +e`, then the fold's
# kernel chain test (bf16, int4 and FP8 rows, each round against the
# separate launches, eager and replayed); `failed` is 1 if it fails.
fold_chain_test() {
    prepare
    set +e
    failed=0
    KILN_TEST_DEVICE=cuda timeout 300 .gpu/cuda_graphs --include-ignored --nocapture folded 2>&1 |
        tee "$out/fold.log" | grep -E "round 3|test result|panicked|differs"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
}

# Decode at CONC (default 1) sequences on FP8 rows with the flag $1 at
# each of the values after it, ROUNDS (default 2) times in turn (there,
# under `set +e`, with $out set); sets `failed` to 1 if a run fails.
fp8_step_runs() {
    local flag="$1" round v
    shift
    for round in $(seq "${ROUNDS:-2}"); do
        for v in "$@"; do
            echo "== round $round: $flag $v" | tee -a "$out/fp8-fold.log"
            timeout 200 .gpu-bench/kiln bench --model synthetic:llama-3-8b --device cuda --weights fp8 \
                --kv fp8 --kv-memory 16GiB --concurrency "${CONC:-1}" --prompt-tokens 512 \
                --gen-tokens 128 "$flag" "$v" 2>&1 | grep -v INFO | tee -a "$out/fp8-fold.log"
            [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
        done
    done
}

mode_fp8_fold() {
    # FP8 rows in the folded one-token step (`--cuda-fold-fp8`): the fold's
    # kernel chain test (bf16, int4 and FP8 rows, eager and replayed), the
    # engine's folded-logits test, then decode at CONC (default 1)
    # sequences on FP8 rows with the fold off and on, ROUNDS (default 2)
    # times in turn; TRACE=1 adds the folded step's kernels. Carry .gpu,
    # .gpu-bench. Fails if a test or a run fails.
    fold_chain_test
    KILN_TEST_DEVICE=cuda timeout 150 .gpu/engine --include-ignored --nocapture folded_norms 2>&1 |
        tee -a "$out/fold.log" | grep -E "row 35|test result|panicked"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    fp8_step_runs --cuda-fold-fp8 off on
    if [ "${TRACE:-0}" != 0 ]; then
        TAG=fp8-fold FLAGS="--weights fp8 --cuda-fold-fp8 on" scripts/step_trace.sh fp8 1 512 2>&1 | tee -a "$out/fp8-fold.log"
    fi
    exit "$failed"
}
