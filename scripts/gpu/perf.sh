# shellcheck shell=bash
# scripts/gpu.sh's profiling modes (there): Nsight Compute over one
# kernel, a CUPTI trace of captured decode steps, and a base build's
# benchmark beside this tree's.

mode_profile() {
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
}

mode_ab() {
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
}

mode_rope_attention() {
    # Attention that rotates the step's keys itself
    # (`--cuda-rope-in-attention`): its kernel test, the engine's test
    # where the default model is staged, then decode at CONC (default
    # 1,64) sequences off and on, ROUNDS (default 2) times in turn, and
    # the step's kernels in its graph at 64 sequences with it on and off
    # (scripts/step_trace.sh; TRACE=0 leaves it out). Carry .gpu, .gpu-bench.
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    unpack_kiln
    KILN_TEST_DEVICE=cuda timeout 120 .gpu/cuda_graphs --include-ignored rotates 2>&1 |
        grep -E "^test |test result|panicked" | tee "$out/rope-attention.log"
    if staged_model; then
        KILN_TEST_DEVICE=cuda timeout 200 .gpu/engine --include-ignored rotates 2>&1 |
            grep -E "^test |test result|panicked" | tee -a "$out/rope-attention.log"
    fi
    for _ in $(seq "${ROUNDS:-2}"); do
        for flag in off on; do
            echo "== --cuda-rope-in-attention $flag" | tee -a "$out/rope-attention.log"
            timeout 150 .gpu-bench/kiln bench --model synthetic:llama-3-8b --device cuda --kv fp8 \
                --kv-memory 16GiB --concurrency "${CONC:-1,64}" --prompt-tokens 512 \
                --gen-tokens 128 --cuda-rope-in-attention "$flag" 2>&1 | grep -v INFO |
                tail -n +3 | tee -a "$out/rope-attention.log"
        done
    done
    if [ "${TRACE:-1}" != 0 ]; then
        for flag in on off; do
            TAG="rope-$flag" FLAGS="--cuda-rope-in-attention $flag" scripts/step_trace.sh fp8 64 512 2>&1 |
                tee -a "$out/rope-attention.log"
        done
    fi
}

mode_trace() {
    # Where a captured decode step's time goes, graphs on (CUPTI kernel
    # trace; scripts/step_trace.sh): `scripts/gpu.sh trace [KV [CONC
    # [PROMPT]]]`, bench flags in FLAGS. Carry .gpu-bench.
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    unpack_kiln
    shift
    scripts/step_trace.sh "$@" 2>&1 | tee -a "$out/trace.log"
}

mode_goal_traces() {
    # Where each open decode goal's step goes, one call (carry .gpu-bench):
    # the CUPTI trace of one sequence on FP8 rows, one on int4 tiles with
    # an int4 head (issue 18), and 64 sequences of bf16 weights on bf16
    # and fp8-static pages (issue 23), 512-token prompts. The H100's
    # traces are in docs/perf.md (sessions 40-48); these say what does
    # not shrink with the H200's bandwidth.
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    unpack_kiln
    nvidia-smi --query-gpu=name,memory.total --format=csv | tee "$out/goal-traces.log"
    GEN=64 TAG=fp8rows FLAGS="--weights fp8" scripts/step_trace.sh fp8 1 512 2>&1 | tee -a "$out/goal-traces.log"
    GEN=64 TAG=int4 FLAGS="--weights int4,head=int4" scripts/step_trace.sh fp8 1 512 2>&1 |
        tee -a "$out/goal-traces.log"
    for kv in bf16 fp8-static; do
        scripts/step_trace.sh "$kv" 64 512 2>&1 | tee -a "$out/goal-traces.log"
    done
}

mode_flash_builds() {
    # The flash attention kernel's builds (three and four blocks an SM)
    # and its fused merge: parity (which holds the builds to the plain
    # build's bits and the fused merge near the merge launch's), the
    # rotating attention's test (which runs the four-an-SM build too),
    # every plan at 64 x 640 and 1 x 640 (`cuda_bench attention`), then
    # decode at 64 sequences by the base build (`baseline` here) and this
    # tree's in turn, ROUNDS (default 1) times, on KV (default fp8) pages,
    # this tree's also with each `--cuda-flash-build` in BUILDS (default
    # "plain four"); TRACE=1 adds this tree's step trace. Carry .gpu,
    # .gpu-bench.
    # Fails if a test fails.
    prepare
    set +e
    KILN_TEST_DEVICE=cuda timeout 150 .gpu/parity --test-threads 1 2>&1 | tee "$out/parity.log" |
        grep -E "test result|panicked"
    failed="${PIPESTATUS[0]}"
    KILN_TEST_DEVICE=cuda timeout 120 .gpu/cuda_graphs --include-ignored rotates 2>&1 |
        tee -a "$out/parity.log" | grep -E "test result|panicked|differs"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    for shape in 64x640 1x640; do
        timeout 150 .gpu/cuda_bench attention "$shape" 2>&1 | grep -E "Flash|disagrees" |
            tee -a "$out/attention.log"
    done
    runs=(/tmp/kiln-base .gpu-bench/kiln)
    for build in ${BUILDS-plain four}; do runs+=(".gpu-bench/kiln --cuda-flash-build $build"); done
    for round in $(seq "${ROUNDS:-1}"); do
        for run in "${runs[@]}"; do
            echo "== round $round: $run" | tee -a "$out/ab.log"
            read -ra flags <<<"$run"
            timeout 150 "${flags[0]}" bench "${flags[@]:1}" --model synthetic:llama-3-8b --device cuda \
                --kv "${KV:-fp8}" --kv-memory 16GiB --concurrency 64 --prompt-tokens 512 \
                --gen-tokens 128 2>&1 | grep -v INFO | tail -n 1 | tee -a "$out/ab.log"
        done
    done
    [ "${TRACE:-0}" = 0 ] || scripts/step_trace.sh "${KV:-fp8}" 64 512 2>&1 | tee "$out/trace.log"
    exit "$failed"
}

mode_decode_flags() {
    # Issue 23's batched decode with the decode flags, each set in SETS
    # (split by ';'; default: the defaults (all three on), none of them,
    # the tuned bf16 algorithms with the bf16 MLP alone, and attention
    # that rotates the keys alone) in turn, ROUNDS (default 1) times:
    # `kiln bench` at CONC (default 64; a list such as 1,32,64 runs each)
    # sequences on KV_FORMATS (default bf16,fp8-static) pages. TESTS=1
    # (default) runs parity and the rotating attention's test first. Carry
    # .gpu, .gpu-bench. Fails if a test or a run fails.
    prepare
    set +e
    failed=0
    if [ "${TESTS:-1}" != 0 ]; then
        KILN_TEST_DEVICE=cuda timeout 150 .gpu/parity --test-threads 1 2>&1 | tee "$out/parity.log" |
            grep -E "test result|panicked"
        [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
        KILN_TEST_DEVICE=cuda timeout 120 .gpu/cuda_graphs --include-ignored rotates 2>&1 |
            tee -a "$out/parity.log" | grep -E "test result|panicked|differs"
        [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    fi
    tune="--cuda-tune-bf16 on --cuda-bf16-mlp-decode on"
    rope="--cuda-rope-in-attention on"
    none="--cuda-tune-bf16 off --cuda-bf16-mlp-decode off --cuda-rope-in-attention off"
    IFS=';' read -ra sets <<<"${SETS-;$none;$tune --cuda-rope-in-attention off;--cuda-tune-bf16 off --cuda-bf16-mlp-decode off $rope}"
    for round in $(seq "${ROUNDS:-1}"); do
        for flags in "${sets[@]}"; do
            echo "== round $round: ${flags:-defaults}" | tee -a "$out/flags.log"
            # shellcheck disable=SC2086
            timeout 200 .gpu-bench/kiln bench --model synthetic:llama-3-8b --device cuda \
                --kv-formats "${KV_FORMATS:-bf16,fp8-static}" --kv-memory 16GiB \
                --concurrency "${CONC:-64}" --prompt-tokens 512 --gen-tokens 128 $flags 2>&1 |
                grep -v INFO | tee -a "$out/flags.log"
            [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
        done
    done
    exit "$failed"
}

mode_goals() {
    # The open decode goals' figures in one call: the fold's chain test,
    # then on synthetic:llama-3-8b (512-token prompts, 128 generated) one
    # sequence on FP8 rows (issue 18: >= 80% of roofline), one sequence on
    # int4 tiles with an int4 head (issue 18: >= 720 tok/s), and 64
    # sequences of bf16 weights on bf16 and fp8-static pages (issue 23:
    # >= 85%).
    # Carry .gpu, .gpu-bench. Fails if a test or a run fails.
    fold_chain_test
    ROUNDS=1 fp8_step_runs --cuda-fold-fp8 on
    echo "== int4 tiles, int4 head" | tee -a "$out/goals.log"
    timeout 200 .gpu-bench/kiln bench --model synthetic:llama-3-8b --device cuda \
        --weights int4,head=int4 --kv fp8 --kv-memory 16GiB --concurrency 1 --prompt-tokens 512 \
        --gen-tokens 128 2>&1 | grep -v INFO | tee -a "$out/goals.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    echo "== bf16 weights, 64 sequences" | tee -a "$out/goals.log"
    timeout 240 .gpu-bench/kiln bench --model synthetic:llama-3-8b --device cuda \
        --kv-formats bf16,fp8-static --kv-memory 16GiB --concurrency 64 --prompt-tokens 512 \
        --gen-tokens 128 2>&1 | grep -v INFO | tee -a "$out/goals.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    exit "$failed"
}
