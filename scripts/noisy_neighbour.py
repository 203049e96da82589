#!/usr/bin/env python3
"""Noisy neighbour: what one tenant's burst costs another, through the API.

Starts SERVER (a `kiln` binary) with the given serve arguments, creates
tenants `a` (allowed 256 calls at once) and `b`, then runs LOADGEN's
`kiln loadgen` twice: tenant b alone (one client, 512-token prompts, 64
tokens), then b beside tenant a's burst (200 clients, 1024-token prompts,
256 tokens); A_LOAD, B_LOAD, ALONE_S and BURST_S change them. Prints both
reports; b's TTFT and ITL in the second against the first are the measure.
The server is stopped with SIGTERM.

    scripts/noisy_neighbour.py SERVER LOADGEN NAME SOURCE [serve args...]
"""

import os
import signal
import subprocess

from kiln_serve import call, preemptions, quantile, since, start_from_argv, step_times, step_walls

ADMIN = "noisy-neighbour-admin"
ALONE_S = int(os.environ.get("ALONE_S", "20"))
BURST_S = int(os.environ.get("BURST_S", "40"))
A_LOAD = os.environ.get("A_LOAD", "clients=200,prompt=1024,max=256")
B_LOAD = os.environ.get("B_LOAD", "prompt=512,max=64")


def main():
    srv, loadgen, model = start_from_argv(ADMIN)
    port, proc = srv.port, srv.proc
    keys = {t: call(port, ADMIN, "POST", "/v1/tenants", {"name": t})["api_key"] for t in ("a", "b")}
    call(port, ADMIN, "PUT", "/v1/tenants/a/policy", {"max_concurrent": 256})
    url = f"http://127.0.0.1:{port}"
    b = f"b={keys['b']},{B_LOAD}"
    a = f"a={keys['a']},{A_LOAD}"
    for name, tenants, secs in (("b alone", [b], ALONE_S), ("b beside a's burst", [a, b], BURST_S)):
        args = [loadgen, "loadgen", "--server", url, "--model", model, "--duration-s", str(secs)]
        for t in tenants:
            args += ["--tenant", t]
        print(f"== {name}", flush=True)
        before, walls = step_times(port, ADMIN), step_walls(port, ADMIN)
        preempted = preemptions(port, ADMIN)
        subprocess.run(args, check=True)
        steps, wall, device = (b - a for a, b in zip(before, step_times(port, ADMIN)))
        if steps:
            after = step_walls(port, ADMIN)
            # A build without the histogram shows the means alone.
            qs = [quantile(walls, after, q) for q in (0.5, 0.7, 0.9, 0.99)]
            spread = "" if None in qs else "; wall p50 / p70 / p90 / p99 " + " / ".join(f"{q:.2f}" for q in qs) + " ms"
            print(f"engine steps {steps:.0f}: wall {wall / steps * 1e3:.2f} ms, "
                  f"device {device / steps * 1e3:.2f} ms a step{spread}; "
                  f"preemptions {since(preempted, preemptions(port, ADMIN))}", flush=True)
    proc.send_signal(signal.SIGTERM)
    print(f"server exit {proc.wait(timeout=60)}")


if __name__ == "__main__":
    main()
