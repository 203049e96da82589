#!/usr/bin/env python3
"""SIGTERM under load: `kiln serve` must end its streams cleanly and exit 0.

Starts KILN (a `kiln` binary) with the given serve arguments, floods it with
streaming chat requests whose clients go away after the first bytes, opens
streams that stay, sends SIGTERM, and checks that each open stream ends with
`[DONE]` or a shutting-down error event and that the process exits 0 (no
signal, no segmentation fault). Prints one line per check; exits 1 if any
fails.

    scripts/shutdown_check.py KILN NAME SOURCE [serve args...]
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from kiln_serve import Server

ADMIN = "shutdown-check-admin"


def request(port, method, path, token, body=b"", timeout=600):
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    head = (
        f"{method} {path} HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {token}\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    s.sendall(head.encode() + body)
    return s


def exchange(port, method, path, token, body=b""):
    s = request(port, method, path, token, body)
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    head, rest = data.split(b"\r\n\r\n", 1)
    length = int([l for l in head.split(b"\r\n") if l.lower().startswith(b"content-length")][0].split(b":")[1])
    while len(rest) < length:
        rest += s.recv(65536)
    s.close()
    return int(head.split(b" ")[1]), json.loads(rest)


def stream_body(model, tokens):
    return json.dumps({
        "model": model, "stream": True, "max_tokens": tokens, "temperature": 0.7,
        "messages": [{"role": "user", "content": "Write a very long story about a kiln."}],
    }).encode()


def main():
    kiln, model, serve_args = sys.argv[1], sys.argv[2], sys.argv[3:]
    server = Server(kiln, ADMIN, model, serve_args[0], serve_args[1:])
    proc, port, log = server.proc, server.port, server.log
    if server.up_s is None:
        print("FAIL the server did not come up")
        print(server.log_text()[-3000:])
        return 1
    print(f"up in {server.up_s:.1f} s")
    keys = {}
    for name in ["flood", "keep"]:
        status, answer = exchange(port, "POST", "/v1/tenants", ADMIN, f'{{"name": "{name}"}}'.encode())
        assert status == 201, answer
        keys[name] = answer["api_key"]

    # 200 clients that start a stream and go away (past the tenant's cap of
    # 32 calls in flight, the rest are refused: a flood all the same).
    def walk_away():
        try:
            s = request(port, "POST", "/v1/chat/completions", keys["flood"], stream_body(model, 512))
            s.recv(1024)
            s.close()
        except OSError:
            pass
    flood = [threading.Thread(target=walk_away) for _ in range(200)]
    for t in flood:
        t.start()
    for t in flood:
        t.join()
    print("flood of 200 walked-away streams sent")

    # Streams that stay until the signal.
    kept = []
    for _ in range(8):
        s = request(port, "POST", "/v1/chat/completions", keys["keep"], stream_body(model, 4000))
        got = b""
        while b'"content"' not in got:
            chunk = s.recv(65536)
            if not chunk:
                break
            got += chunk
        kept.append((s, got))
    print(f"{len(kept)} streams open")
    os.kill(proc.pid, signal.SIGTERM)
    sent = time.time()
    ok = True
    for i, (s, got) in enumerate(kept):
        s.settimeout(60)
        try:
            while True:
                chunk = s.recv(65536)
                if not chunk:
                    break
                got += chunk
        except OSError as e:
            print(f"FAIL stream {i}: {e}")
            ok = False
            continue
        clean = b"data: [DONE]" in got or b"shutting down" in got
        closed = got.endswith(b"0\r\n\r\n")
        print(f"{'ok  ' if clean and closed else 'FAIL'} stream {i} ended "
              f"({'last event' if clean else 'cut'}, {'closed' if closed else 'unterminated'})")
        if not (clean and closed):
            print("   its last bytes:", got[-300:])
        ok &= clean and closed
    try:
        code = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = "hung"
    took = time.time() - sent
    log.close()
    text = server.log_text()
    fine = code == 0 and "Segmentation" not in text and "panicked" not in text
    print(f"{'ok  ' if fine else 'FAIL'} exit code {code} after {took:.1f} s; "
          f"engines stopped: {text.count('engine stopped')}")
    if not (ok and fine):
        print(text[-4000:])
    return 0 if ok and fine else 1


if __name__ == "__main__":
    sys.exit(main())
