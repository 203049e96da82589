"""Where a captured decode step's time goes: reads the kernel trace of a
`kiln bench` run (scripts/step_trace.c's CSV, or Nsight Systems'
`cuda_gpu_trace` report: start, duration, grid width and name of every
kernel, graph nodes included), takes its last decode-only steps of the
most rows (a step runs from its embedding gather through its argmax,
whose grids match), and prints per kernel and grid width (one kernel
serves products of several shapes) the mean time a step, its share of the
step's wall time that no earlier kernel of the step covers (programmatic
launches overlap neighbours), and the step's idle gaps.

Usage: python3 step_trace.py TRACE.csv [STEPS]   (STEPS: last N, default 8)
"""
import collections
import csv
import shutil
import subprocess
import sys


def demangled(names):
    """C++ names readable where c++filt is installed, else as they are."""
    if not shutil.which("c++filt"):
        return {n: n for n in names}
    names = sorted(names)
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout
    return dict(zip(names, out.splitlines())) if out.count("\n") >= len(names) - 1 else {n: n for n in names}


def col(head, *names):
    for n in names:
        for i, h in enumerate(head):
            if h.strip().lower() == n.lower():
                return i
    sys.exit(f"no column {names} in {head}")


rows = list(csv.reader(open(sys.argv[1])))
start_at = next(i for i, r in enumerate(rows) if any("Start" in c for c in r))
head, body = rows[start_at], rows[start_at + 1:]
s_i, d_i = col(head, "Start (ns)", "Start"), col(head, "Duration (ns)", "Duration")
g_i, n_i = col(head, "GrdX"), col(head, "Name")
ks = []
for r in body:
    if len(r) <= max(s_i, d_i, g_i, n_i) or not r[g_i].strip():
        continue  # copies and memsets have no grid
    ks.append((int(r[s_i]), int(r[d_i]), int(r[g_i]), ",".join(r[n_i:])))
readable = demangled({k[3] for k in ks})
ks = [(s, d, g, readable[n].removeprefix("void ").split("(")[0].split("<")[0].strip()) for s, d, g, n in ks]
ks.sort()
starts = [i for i, k in enumerate(ks) if k[3].startswith("embed_")] + [len(ks)]
steps = [ks[a:b] for a, b in zip(starts, starts[1:])]


def decode_rows(step):
    ends = [k for k in step if k[3].startswith("argmax_")]
    return step[0][2] if len(ends) == 1 and ends[0][2] == step[0][2] else 0


best = max(map(decode_rows, steps), default=0)
if best == 0:
    sys.exit(f"no whole decode step among {len(steps)} traced")
want = int(sys.argv[2]) if len(sys.argv) > 2 else 8
# Only a step's own kernels: it ends at its argmax (later launches belong
# to the host's next step or a prefill lane).
chosen = []
for s in steps:
    if decode_rows(s) == best:
        end = max(i for i, k in enumerate(s) if k[3].startswith("argmax_"))
        chosen.append(s[: end + 1])
chosen = chosen[-want:]
busy = collections.defaultdict(float)
exposed = collections.defaultdict(float)
count = collections.Counter()
spans, gaps = [], []
for s in chosen:
    reach, gap = s[0][0], 0
    for start, dur, grid, name in s:
        name = f"{name} [{grid}]"
        end = start + dur
        busy[name] += dur
        count[name] += 1
        exposed[name] += max(0, end - max(start, reach))
        gap += max(0, start - reach)
        reach = max(reach, end)
    spans.append(reach - s[0][0])
    gaps.append(gap)
n = len(chosen)
span = sum(spans) / n / 1e3
print(f"decode steps of {best} rows: last {n} of {len(steps)} traced; step {span:.1f} us")
print(f"{'kernel [grid width]':<52} {'a step':>6} {'us':>8} {'exposed us':>10} {'share':>6}")
for name in sorted(busy, key=lambda k: -exposed[k]):
    e = exposed[name] / n / 1e3
    print(f"{name[-52:]:<52} {count[name] / n:>6.1f} {busy[name] / n / 1e3:>8.1f} {e:>10.1f} {e / span:>6.1%}")
g = sum(gaps) / n / 1e3
print(f"{'(idle between kernels)':<52} {'':>6} {'':>8} {g:>10.1f} {g / span:>6.1%}")
