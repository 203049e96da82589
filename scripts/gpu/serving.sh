# shellcheck shell=bash
# scripts/gpu.sh's serving modes (there): SIGTERM under load, the noisy
# neighbour, prefill/decode disaggregation, API clients, constrained decoding.

# API clients of one tenant (there, with $out set): `pd_clients CLIENTS
# PD...` runs scripts/clients.py at each client count of CLIENTS with each
# `--pd` mode in turn (DURATION_S seconds, default 25), for each server of
# SERVERS (default this tree's; "/tmp/kiln-base .gpu-bench/kiln" after
# `unpack` for the base build beside it), SERVE_ARGS added to each.
pd_clients() {
    local clients="$1" pd server
    shift
    for server in ${SERVERS:-.gpu-bench/kiln}; do
        for pd in "$@"; do
            echo "== clients, $server --pd $pd ${SERVE_ARGS:-}" | tee -a "$out/pd.log"
            # shellcheck disable=SC2086
            CLIENTS="$clients" DURATION_S="${DURATION_S:-25}" timeout 200 python3 scripts/clients.py \
                "$server" .gpu-bench/kiln big synthetic:llama-3-8b --device cuda --kv fp8-static \
                --kv-memory 24GiB --pd "$pd" ${SERVE_ARGS:-} 2>&1 | grep -v INFO | tee -a "$out/pd.log"
        done
    done
}

mode_shutdown() {
    # SIGTERM under load on CUDA: 200 streams whose clients went away, 8
    # that stay, then SIGTERM; kiln must end the streams cleanly and exit 0.
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    python3 scripts/shutdown_check.py .gpu-bench/kiln big synthetic:llama-3-8b \
        --device cuda --kv-memory 16GiB 2>&1 | tee "$out/shutdown.log"
    exit "${PIPESTATUS[0]}"
}

mode_neighbour() {
    # One tenant's burst against another's stream, through the API: this
    # tree's server with the step time target off and at its default, same
    # call (carry .gpu-bench; this tree's `kiln loadgen` drives every run).
    # TARGETS and SERVERS override (SERVERS="/tmp/kiln-base .gpu-bench/kiln"
    # after `unpack` for the base build beside this one); SERVE_ARGS adds
    # serve arguments (`--pd off`: one lane, where serve's default on a
    # GPU is two). ROUNDS (default 1) repeats the whole set, servers taking
    # turns: b's TTFT p95 is the second slowest of ~28 requests, so one
    # round says little about it.
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    unpack_kiln
    export ALONE_S="${ALONE_S:-10}" BURST_S="${BURST_S:-20}"
    for round in $(seq "${ROUNDS:-1}"); do
        for server in ${SERVERS:-.gpu-bench/kiln}; do
            for target in ${TARGETS:-0 1.8}; do
                echo "== round $round: $server --step-target $target ${SERVE_ARGS:-}" | tee -a "$out/neighbour.log"
                # shellcheck disable=SC2086
                timeout 150 python3 scripts/noisy_neighbour.py "$server" .gpu-bench/kiln big synthetic:llama-3-8b \
                    --device cuda --kv fp8-static --kv-memory 16GiB --step-target "$target" ${SERVE_ARGS:-} 2>&1 |
                    grep -v INFO | tee -a "$out/neighbour.log"
            done
        done
    done
}

mode_pd_goals() {
    # Issue 18's PD goals in one call (carry .gpu, .gpu-bench/kiln.xz,
    # .gpu-bench/kiln-base.xz): the CUDA-graph and device-fault tests
    # and the engine's working-buffer tests first, then the neighbour at
    # target 1.3 with `--pd on` and `--pd off` (PD_ARGS overrides, ";"
    # apart), then 256
    # clients of one tenant with PD on and off (PD_CLIENTS overrides; empty
    # skips them). Fails if a test fails.
    prepare
    set +e
    failed=0
    KILN_TEST_DEVICE=cuda timeout 60 .gpu/cuda_graphs --include-ignored 2>&1 | tee "$out/tests.log" | tail -3
    [ "${PIPESTATUS[0]}" -eq 0 ] || failed=1
    KILN_TEST_DEVICE=cuda timeout 60 .gpu/device_fault --include-ignored 2>&1 | tee -a "$out/tests.log" | tail -3
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
}

mode_pd_clients() {
    # 256 API clients of one tenant (CLIENTS overrides) with each `--pd`
    # mode of PD (default "on off") for each server of SERVERS, SERVE_ARGS
    # added, 20 s each (carry .gpu-bench; .gpu-bench/kiln-base.xz for the
    # base build).
    prepare
    # shellcheck disable=SC2086
    DURATION_S="${DURATION_S:-20}" pd_clients "${CLIENTS:-256}" ${PD:-on off}
}

mode_pd() {
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
}

mode_constrained() {
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
}

mode_clients() {
    # Output tok/s and TTFT through the API at 1-256 clients (1024-token
    # prompts, 256 generated), fp8-static pages with room for 256 such
    # requests (carry .gpu-bench; CLIENTS, DURATION_S override).
    out="${OUT:-./gpu-out}"
    mkdir -p "$out"
    device_env
    unpack_kiln
    timeout "${CLIENTS_TIMEOUT:-400}" python3 scripts/clients.py .gpu-bench/kiln .gpu-bench/kiln big \
        synthetic:llama-3-8b --device cuda --kv fp8-static --kv-memory 24GiB 2>&1 |
        grep -v INFO | tee "$out/clients.log"
    exit "${PIPESTATUS[0]}"
}
