#!/usr/bin/env bash
# Cost per malloc+free pair with many blocks live against one: Hoard's threadtest (P = 1,
# 30,000 live 8-byte blocks a round, ROUNDS rounds: 30,000 * ROUNDS pairs) and `pairs N` (one
# live block), natively and under `heaptrace -q` in the floors `bare-traps` (the three traps),
# `bare-read` (the traps and one read of the caller's stack: the least an exact stack takes)
# and `bare` (the traps and the stack walk) and in counts and stacks modes, REPS interleaved
# rounds; each BUILD (a heaptrace binary; default: this tree's release build) in every round.
# Per pair: (traced - native) / pairs, by each program's own timer, best and median, and each
# mode's ratio to its build's bare and bare-traps floors. Root.
#
#   tests/bench/livegap.sh [REPS] [ROUNDS] [N] [BUILD...]     (from the repository root)
set -euo pipefail
REPS=${1:-5}
ROUNDS=${2:-100}
N=${3:-1000000}
. tests/bench/pairs-setup.sh
builds=("${@:4}")
[ ${#builds[@]} -gt 0 ] || builds=("$ht")
tt=target/fixtures/threadtest
gcc -O2 -g -fno-omit-frame-pointer -pthread -Wall -o "$tt" bench/workloads/threadtest.c
scale=$(python3 -c "print(($ROUNDS + 0.5) / 70)")
out=$(mktemp)
ttime() { "$@" "$tt" 1 "$scale" 2>/dev/null | sed -n 's/.*elapsed=\([0-9.]*\).*/\1/p'; }
for _ in $(seq "$REPS"); do
    echo "threadtest - native $(ttime env)" >>"$out"
    echo "pairs - native $("$pairs" "$N")" >>"$out"
    for b in "${!builds[@]}"; do
        for m in bare-traps bare-read bare counts stacks; do
            echo "threadtest $b $m $(ttime "${builds[$b]}" -q $(modeflag "$m") --)" >>"$out"
            echo "pairs $b $m $("${builds[$b]}" -q $(modeflag "$m") -- "$pairs" "$N" 2>/dev/null)" \
                >>"$out"
        done
    done
done
python3 - "$out" "$((30000 * ROUNDS))" "$N" "${builds[@]}" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    w, b, m, s = line.split()
    runs.setdefault((w, b, m), []).append(float(s))
pairs = {"threadtest": int(sys.argv[2]), "pairs": int(sys.argv[3])}
builds = sys.argv[4:]
print("| workload | build | mode | added per pair, best | median | to bare, best | median "
      "| to bare-traps, best | median |")
print("|---|---|---|---|---|---|---|---|---|")
for w in pairs:
    for b, path in enumerate(builds):
        def add(m, f):
            return (f(runs[(w, str(b), m)]) - f(runs[(w, "-", "native")])) / pairs[w] * 1e6
        for m in ("bare-traps", "bare-read", "bare", "counts", "stacks"):
            best, med = add(m, min), add(m, statistics.median)
            r1, r2 = best / add("bare", min), med / add("bare", statistics.median)
            t1 = best / add("bare-traps", min)
            t2 = med / add("bare-traps", statistics.median)
            print(f"| {w} | {path} | {m} | {best:.2f} us | {med:.2f} us | {r1:.2f} | {r2:.2f} "
                  f"| {t1:.2f} | {t2:.2f} |")
print("runs (s):")
for k, v in runs.items():
    print(" ", *k, " ".join(f"{x:.3f}" for x in v))
PY
rm -f "$out"
