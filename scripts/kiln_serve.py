"""Starts `kiln serve` for the scripts that drive a real server
(shutdown_check.py, noisy_neighbour.py): a fresh data directory, a free
port, the log in the data directory, and a wait until the port answers."""

import json
import os
import socket
import subprocess
import sys
import tempfile
import time


class Server:
    """A `kiln serve` process: `proc`, `port`, `data` (its data directory),
    `log` (the open log file) and `up_s` (seconds until it answered)."""

    def __init__(self, kiln, admin, model, source, serve_args):
        self.data = tempfile.mkdtemp()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.log = open(os.path.join(self.data, "server.log"), "wb")
        self.proc = subprocess.Popen(
            [kiln, "serve", "--listen", f"127.0.0.1:{self.port}", "--data-dir", self.data,
             "--drain-timeout-s", "3", "--model", f"{model}={source}", *serve_args],
            stdout=self.log, stderr=self.log, env=dict(os.environ, KILN_ADMIN_TOKEN=admin))
        start = time.time()
        self.up_s = None
        while time.time() - start <= 300 and self.proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                self.up_s = time.time() - start
                return
            except OSError:
                time.sleep(0.5)

    def log_text(self):
        """The server's log so far."""
        return open(os.path.join(self.data, "server.log"), errors="replace").read()


def start_from_argv(admin):
    """Starts the server of `SCRIPT SERVER LOADGEN NAME SOURCE [serve
    args...]` and waits for it; returns it with the loadgen binary and the
    model's name, or exits with the server's log."""
    server, loadgen, model, source, serve_args = (
        sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])
    srv = Server(server, admin, model, source, serve_args)
    if srv.up_s is None:
        print(srv.log_text()[-3000:])
        raise SystemExit("the server did not come up")
    print(f"{server}: up in {srv.up_s:.1f} s", flush=True)
    return srv, loadgen, model


def exchange(port, admin, method, path, body=b""):
    """One admin HTTP request: (status, the answer's body as bytes)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    s.sendall(
        f"{method} {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {admin}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"connection: close\r\n\r\n".encode() + body
    )
    reply = b""
    while chunk := s.recv(65536):
        reply += chunk
    s.close()
    head, rest = reply.split(b"\r\n\r\n", 1)
    return int(head.split(b" ")[1]), rest


def call(port, admin, method, path, body):
    """One admin API call (JSON in and out); exits on an error status."""
    status, rest = exchange(port, admin, method, path, json.dumps(body).encode())
    if status >= 300:
        raise SystemExit(f"{method} {path}: {status} {rest[:300]!r}")
    return json.loads(rest) if rest.strip() else {}


def step_walls(port, admin):
    """The engines' step wall-time histogram from /metrics: {upper bound
    in seconds: steps at most that long}, summed over pools."""
    _, text = exchange(port, admin, "GET", "/metrics")
    counts = {}
    for line in text.decode(errors="replace").splitlines():
        if line.startswith("kiln_engine_step_wall_seconds_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            counts[bound] = counts.get(bound, 0.0) + float(line.rsplit(" ", 1)[-1])
    return counts


def quantile(before, after, q):
    """Quantile q of the steps counted between two `step_walls` readings,
    in ms, interpolated inside its bucket (None with no step; the last
    finite bound, an understatement, when it falls past it)."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    if not counts or counts[-1] <= 0:
        return None
    want, lower, below = q * counts[-1], 0.0, 0.0
    for bound, count in zip(bounds, counts):
        if count >= want:
            if bound == float("inf"):
                return lower * 1e3
            inside = (want - below) / (count - below) if count > below else 1.0
            return (lower + inside * (bound - lower)) * 1e3
        lower, below = bound, count
    return lower * 1e3


def step_times(port, admin):
    """The engines' step counters from /metrics: (steps, wall seconds,
    device seconds), summed over pools."""
    _, text = exchange(port, admin, "GET", "/metrics")
    steps = wall = device = 0.0
    for line in text.decode(errors="replace").splitlines():
        value = line.rsplit(" ", 1)[-1]
        if line.startswith("kiln_engine_steps_total{"):
            steps += float(value)
        elif line.startswith("kiln_engine_step_seconds_total{"):
            if 'time="wall"' in line:
                wall += float(value)
            elif 'time="device"' in line:
                device += float(value)
    return steps, wall, device


def preemptions(port, admin):
    """Sequences the engines preempted so far, from /metrics, summed over
    pools (None from a build without the counter)."""
    _, text = exchange(port, admin, "GET", "/metrics")
    counts = [float(line.rsplit(" ", 1)[-1]) for line in text.decode(errors="replace").splitlines()
              if line.startswith("kiln_engine_preemptions_total{")]
    return sum(counts) if counts else None


def since(before, after):
    """`after - before` of two `preemptions` readings, as text ("n/a"
    without the counter)."""
    return "n/a" if before is None or after is None else f"{after - before:.0f}"


def routing(port, admin):
    """Requests routed to each decode pool and session requests that
    spilled from a saturated pool, from /metrics: ({pool: requests},
    spills), summed over models."""
    _, text = exchange(port, admin, "GET", "/metrics")
    pools, spills = {}, 0.0
    for line in text.decode(errors="replace").splitlines():
        value = line.rsplit(" ", 1)[-1]
        if line.startswith("kiln_pool_requests_total{"):
            pool = line.split('pool="', 1)[1].split('"', 1)[0]
            pools[pool] = pools.get(pool, 0.0) + float(value)
        elif line.startswith("kiln_pool_spills_total{"):
            spills += float(value)
    return pools, spills
