#!/usr/bin/env python3
"""Throughput end to end through the API, by number of clients.

Starts SERVER (a `kiln` binary) with the given serve arguments, creates one
tenant allowed 256 calls at once, and runs LOADGEN's `kiln loadgen` for
each client count in CLIENTS (default "1 64 128 256"), each DURATION_S
seconds (default 40) of 1024-token prompts and 256 generated tokens
(LOAD overrides), the requests sent in the first WARMUP_S (default 10)
not counted: the first prompts of N clients all arrive at once. Prints
each report: output tok/s and TTFT p95 are issue 23's measures. Then the
requests each decode pool took and the session requests that spilled from
a saturated pool (with SESSIONS=per-client, each client keeps a session
key of its own, `sessions=N` for N clients: none spilled means affinity
held). PROMPT_RUN=TAG gives every run the same prompts for the same client
and turn, so a run finds in the prefix cache those an earlier run sent
(by default each run's are its own).
The server is stopped with SIGTERM.

    scripts/clients.py SERVER LOADGEN NAME SOURCE [serve args...]
"""

import os
import signal
import subprocess

from kiln_serve import call, preemptions, routing, since, start_from_argv

ADMIN = "clients-admin"
CLIENTS = os.environ.get("CLIENTS", "1 64 128 256").split()
DURATION_S = os.environ.get("DURATION_S", "40")
WARMUP_S = os.environ.get("WARMUP_S", "10")
LOAD = os.environ.get("LOAD", "prompt=1024,max=256")
PER_CLIENT = os.environ.get("SESSIONS") == "per-client"
# Every run's prompts by client and turn the same (each run's own
# otherwise): a later run finds an earlier run's in the prefix cache.
PROMPT_RUN = os.environ.get("PROMPT_RUN")


def main():
    srv, loadgen, model = start_from_argv(ADMIN)
    key = call(srv.port, ADMIN, "POST", "/v1/tenants", {"name": "t"})["api_key"]
    call(srv.port, ADMIN, "PUT", "/v1/tenants/t/policy", {"max_concurrent": 256})
    for n in CLIENTS:
        load = f"{LOAD},sessions={n}" if PER_CLIENT else LOAD
        print(f"== {n} clients, {load}", flush=True)
        before, spilled = routing(srv.port, ADMIN)
        preempted = preemptions(srv.port, ADMIN)
        subprocess.run([loadgen, "loadgen", "--server", f"http://127.0.0.1:{srv.port}",
                        "--model", model, "--duration-s", DURATION_S, "--warmup-s", WARMUP_S,
                        "--tenant", f"t={key},clients={n},{load}",
                        *(["--prompt-run", PROMPT_RUN] if PROMPT_RUN else [])], check=True)
        after, spills = routing(srv.port, ADMIN)
        took = {p: int(after[p] - before.get(p, 0.0)) for p in sorted(after)}
        print(f"requests by decode pool: {took}; session requests spilled: {int(spills - spilled)}; "
              f"preemptions: {since(preempted, preemptions(srv.port, ADMIN))}", flush=True)
    srv.proc.send_signal(signal.SIGTERM)
    print(f"server exit {srv.proc.wait(timeout=60)}")


if __name__ == "__main__":
    main()
