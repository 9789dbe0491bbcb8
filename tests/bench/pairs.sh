#!/usr/bin/env bash
# Added time per malloc+free pair under heaptrace, entry probes placed (the default) and all at
# the entry (--probe-at-entry). Runs `pairs N` natively and under `heaptrace -q -- pairs N`,
# REPS interleaved rounds. Two measures: the loop's own time as pairs prints it, and the wall
# time of the whole command (/usr/bin/time), which also holds heaptrace's attach and detach.
# FUNC: the allocating function of the pairs (malloc, posix_memalign, aligned_alloc, valloc;
# large: malloc(40 MiB), an mmap and a munmap each).
# Root needed.
#
#   tests/bench/pairs.sh [N] [REPS] [FUNC]        (from the repository root)
set -euo pipefail
N=${1:-1000000}
REPS=${2:-5}
FUNC=${3:-malloc}
. tests/bench/pairs-setup.sh
out=$(mktemp)
wall=$(mktemp)
run() { # NAME CMD...
    local name=$1
    shift
    local loop
    loop=$(/usr/bin/time -f %e -o "$wall" "$@" "$pairs" "$N" "$FUNC" 2>/dev/null)
    echo "$name $loop $(cat "$wall")" >>"$out"
}
for _ in $(seq "$REPS"); do
    run native env
    run placed "$ht" -q --
    run entry "$ht" -q --probe-at-entry --
done
python3 - "$out" "$N" "$FUNC" <<'PY'
import statistics, sys
loop, wall = {}, {}
for line in open(sys.argv[1]):
    how, l, w = line.split()
    loop.setdefault(how, []).append(float(l))
    wall.setdefault(how, []).append(float(w))
N = int(sys.argv[2])
m = lambda d, k: statistics.median(d[k])
print(f"N = {N} pairs of {sys.argv[3]}+free, {len(loop['native'])} interleaved runs each, medians")
print("| probes | loop time (s) | added per pair (loop) | wall time (s) | added per pair (wall) |")
print("|---|---|---|---|---|")
for how in ("native", "placed", "entry"):
    dl = (m(loop, how) - m(loop, "native")) / N * 1e6
    dw = (m(wall, how) - m(wall, "native")) / N * 1e6
    print(f"| {how} | {m(loop, how):.3f} | {dl:.2f} us | {m(wall, how):.2f} | {dw:.2f} us |")
print("runs (loop s / wall s):")
for how in ("native", "placed", "entry"):
    print(f"  {how}:", " ".join(f"{l:.3f}/{w:.2f}" for l, w in zip(loop[how], wall[how])))
PY
rm -f "$out" "$wall"
