"""Starts `kiln serve` for the scripts that drive a real server
(shutdown_check.py, noisy_neighbour.py): a fresh data directory, a free
port, the log in the data directory, and a wait until the port answers."""

import os
import socket
import subprocess
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
