"""Nsight Systems' cuda_gpu_kern_sum report (CSV on stdin) as a short
table: the N kernels (default 20) with the most GPU time, with their
share of the total, launches and mean microseconds."""
import csv
import sys

n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
rows = [r for r in csv.DictReader(l for l in sys.stdin if "," in l)]
if not rows:
    sys.exit("no kernel summary")
total = sum(float(r["Total Time (ns)"]) for r in rows)
print(f"{'kernel':<60} {'share':>6} {'launches':>8} {'us each':>9} {'ms':>9}")
for r in sorted(rows, key=lambda r: -float(r["Total Time (ns)"]))[:n]:
    t = float(r["Total Time (ns)"])
    name = r["Name"].split("(")[0][:60]
    print(f"{name:<60} {100 * t / total:>5.1f}% {r['Instances']:>8} "
          f"{float(r['Avg (ns)']) / 1e3:>9.1f} {t / 1e6:>9.2f}")
print(f"{'all kernels':<60} {'':>6} {sum(int(r['Instances']) for r in rows):>8} {'':>9} {total / 1e6:>9.2f}")
