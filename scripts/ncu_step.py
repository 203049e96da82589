"""Sums Nsight Compute's kernel durations (ncu --csv, gpu__time_duration)
over the largest whole decode step of a `kiln bench` run (or, with
`prefill` after the CSV, the last step that embeds the most tokens): a step
starts at its embedding gather. Prints one row per kernel name and grid."""
import collections
import csv
import sys

rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
head = rows[0]
name_i, grid_i, val_i = (head.index(c) for c in ("Kernel Name", "Grid Size", "Metric Value"))
ks = [(r[name_i], r[grid_i], float(r[val_i].replace(",", ""))) for r in rows[1:]]
starts = [i for i, k in enumerate(ks) if k[0].startswith("embed_")] + [len(ks)]
steps = [ks[a:b] for a, b in zip(starts, starts[1:])]
# A decode-only step embeds as many tokens as it samples rows: the grids
# of its embedding gather and its argmax match. Take the last of the
# largest such steps (a step cut off by the run's end has no argmax).
def rows(step):
    grids = [k[1] for k in step if k[0].startswith(("embed_", "argmax_"))]
    return int(grids[0].strip("()").split(",")[0]) if len(grids) == 2 and grids[0] == grids[1] else 0
def embedded(step):
    return int(step[0][1].strip("()").split(",")[0]) if step else 0
prefill = sys.argv[2:] == ["prefill"]
size, kind = (embedded, "prefill") if prefill else (rows, "decode")
if len(steps) < 2 or max(map(size, steps)) == 0:
    sys.exit(f"no whole {kind} step among {len(steps)} profiled")
best = max(map(size, steps))
step = [s for s in steps if size(s) == best][-1]
print(f"{kind} step of {best} rows ({len(steps)} steps profiled)")
tot = collections.defaultdict(lambda: [0, 0.0])
for name, grid, ns in step:
    key = f"{name.split('(')[0]} {grid}"
    tot[key][0] += 1
    tot[key][1] += ns
print(f"{'kernel':<52} {'launches':>8} {'us':>9} {'us each':>8}")
for key, (n, ns) in sorted(tot.items(), key=lambda x: -x[1][1]):
    print(f"{key[:52]:<52} {n:>8} {ns / 1e3:>9.1f} {ns / 1e3 / n:>8.2f}")
print(f"{'sum':<52} {len(step):>8} {sum(k[2] for k in step) / 1e3:>9.1f}")
