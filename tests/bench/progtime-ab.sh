#!/usr/bin/env bash
# Two heaptrace builds side by side: the kernel programs' time per malloc+free pair
# (`--probe-stats`, as progtime.sh) and the loop's wall time (as modes.sh), REPS interleaved
# rounds of each mode under each build, so that both see the same machine. For a change to
# the programs: build the old commit elsewhere (a git worktree) and pass both binaries.
#
#   tests/bench/progtime-ab.sh OLD NEW [N] [REPS] [MODES]     (from the repository root, root)
#   e.g. tests/bench/progtime-ab.sh /tmp/base/target/release/heaptrace target/release/heaptrace
set -euo pipefail
OLD=$1
NEW=$2
N=${3:-1000000}
REPS=${4:-3}
MODES=${5:-calls counts sizes stacks}
. tests/bench/pairs-setup.sh
dir=$(mktemp -d)
for r in $(seq "$REPS"); do
    for m in $MODES; do
        for b in old new; do
            bin=$OLD
            [ "$b" = new ] && bin=$NEW
            "$bin" -q --probe-stats --mode "$m" --json "$dir/$b.$m.$r.json" -- "$pairs" "$N" \
                >"$dir/$b.$m.$r.wall" 2>/dev/null
        done
    done
done
python3 - "$dir" "$N" "$REPS" "$MODES" <<'PY'
import json, statistics, sys
d, N, reps, modes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4].split()
names = ["malloc_entry", "alloc_return", "free_entry"]
def prog(b, m, r):
    progs = {p["name"]: p for p in json.load(open(f"{d}/{b}.{m}.{r}.json"))["heaptrace"]["programs"]}
    return sum(progs[n]["run_ns"] for n in names if n in progs) / N
def wall(b, m, r):
    return float(open(f"{d}/{b}.{m}.{r}.wall").read().split()[0]) / N * 1e9
print(f"N = {N} pairs, {reps} interleaved rounds; ns per pair, median (runs)")
print("| mode | programs: old | new | loop (incl. probes): old | new |")
print("|---|---|---|---|---|")
for m in modes:
    cells = []
    for f in (prog, wall):
        for b in ("old", "new"):
            xs = [f(b, m, r) for r in range(1, reps + 1)]
            cells.append(f'{statistics.median(xs):.0f} ({" ".join(f"{x:.0f}" for x in xs)})')
    print(f"| {m} | " + " | ".join(cells) + " |")
PY
rm -rf "$dir"
