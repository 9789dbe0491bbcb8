"""Added time per malloc+free pair, from `LABEL SECONDS` lines (the loop time `pairs` prints),
one or more runs per label: medians, each against the median of the first label (the native
runs), then every run. Shared by the pairs benchmarks (modes.sh, comm.sh).

    python3 tests/bench/added.py FILE N HEADING COLUMN LABEL...
"""
import statistics
import sys

path, n, heading, column, *labels = sys.argv[1:]
n = int(n)
runs = {}
for line in open(path):
    label, seconds = line.split()
    runs.setdefault(label, []).append(float(seconds))
median = {label: statistics.median(runs[label]) for label in labels}
base = median[labels[0]]
print(f"{heading}N = {n} pairs, {len(runs[labels[0]])} interleaved runs each, medians of the loop time")
print(f"| {column} | loop time (s) | added per malloc+free pair |")
print("|---|---|---|")
for label in labels:
    print(f"| {label} | {median[label]:.3f} | {(median[label] - base) / n * 1e6:.2f} us |")
print("runs (s):")
for label in labels:
    print(f"  {label}:", " ".join(f"{x:.3f}" for x in runs[label]))
