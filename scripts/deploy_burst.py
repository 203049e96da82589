"""A burst of deploys spread over a cluster's nodes, then how long until
every node serves every function's last version (issue 21: within 1 s of
the last 201). Run by scripts/cluster-bench.sh.

    deploy_burst.py KEY TENANT DEPLOYS URL... -- A.wasm PREFIX_A B.wasm PREFIX_B

Half as many functions as deploys, each deployed twice (version A then B,
or B then A), the deploys sent 16 at a time, in turn to each node. Then
every node is asked for every function, again and again, until each
answers with its last version's greeting prefix.
"""

import concurrent.futures as cf
import http.client
import sys
import time
import urllib.parse


def request(url, method, path, key=None, body=None):
    u = urllib.parse.urlparse(url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
    headers = {"authorization": f"Bearer {key}"} if key else {}
    c.request(method, path, body=body, headers=headers)
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def main():
    args = sys.argv[1:]
    split = args.index("--")
    key, tenant, deploys, *urls = args[:split]
    versions = [
        (open(args[split + 1 + 2 * i], "rb").read(), args[split + 2 + 2 * i].encode())
        for i in range(2)
    ]
    functions = int(deploys) // 2
    jobs = []
    for rnd in range(2):
        for f in range(functions):
            v = (f + rnd) % 2
            jobs.append((rnd, f, v, urls[(f + rnd) % len(urls)]))
    last = {f: versions[(f + 1) % 2][1] for f in range(functions)}

    def deploy(job):
        _, f, v, url = job
        status, body = request(url, "PUT", f"/v1/functions/f{f}", key, versions[v][0])
        if status != 201:
            raise SystemExit(f"deploy f{f} to {url}: {status} {body[:200]!r}")
        return time.monotonic()

    start = time.monotonic()
    with cf.ThreadPoolExecutor(16) as pool:
        # A function's second deploy goes after its first has answered.
        first = list(pool.map(deploy, jobs[:functions]))
        second = list(pool.map(deploy, jobs[functions:]))
    last_201 = max(first + second)
    elapsed = last_201 - start

    # Each node applies the announced changes in commit order, so the
    # functions deployed last are the ones to check first: once they are
    # current on a node, every earlier change is applied there too.
    order = [f for _, f, _, _ in reversed(jobs[functions:])]
    recent = {(u, f) for u in urls for f in order[:32]}
    pending = [(u, f) for f in order for u in urls]
    sweeps, stale_after_first, recent_ok_at = 0, None, {}

    def check(pair):
        url, f = pair
        status, body = request(url, "GET", f"/fn/{tenant}/f{f}/")
        return pair, status == 200 and body.startswith(last[f]), time.monotonic()

    with cf.ThreadPoolExecutor(8) as pool:
        while pending:
            sweeps += 1
            stale = []
            for pair, ok, at in pool.map(check, pending):
                if not ok:
                    stale.append(pair)
                elif pair in recent:
                    recent_ok_at[pair] = at
            pending = stale
            if sweeps == 1:
                stale_after_first = len(pending)
            if time.monotonic() - last_201 > 30:
                raise SystemExit(f"{len(pending)} (node, function) pairs still stale after 30 s")
    settled = time.monotonic() - last_201
    print(
        f"deploys={2 * functions} functions={functions} nodes={len(urls)} "
        f"burst_s={elapsed:.2f} deploys_per_s={2 * functions / elapsed:.0f} "
        f"stale_in_first_sweep={stale_after_first} sweeps={sweeps} "
        f"last_32_current_on_every_node_s_after_last_201<={max(recent_ok_at.values()) - last_201:.3f} "
        f"all_pairs_checked_current_s_after_last_201<={settled:.2f}"
    )


if __name__ == "__main__":
    main()
