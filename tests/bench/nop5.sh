#!/usr/bin/env bash
# What a probe on a 5-byte nop saves: tests/fixtures/customalloc.c built twice, as is and with
# `-pg -mfentry -mnop-mcount` (a 5-byte nop at each function's entry, which Linux 6.18+ turns
# from a trap into a call once probed), traced with `--allocator-symbols prefix:xx_`. Each
# iteration makes 6 calls that enter a probe (xx_malloc, xx_calloc and the xx_malloc inside it,
# xx_realloc, 2 xx_free), 4 of them with a return probe. REPS interleaved rounds of native and
# traced runs; wall time of the whole command, attach and detach included. Root needed.
#
#   tests/bench/nop5.sh [N] [REPS] [MODE]        (from the repository root)
set -euo pipefail
N=${1:-1000000}
REPS=${2:-5}
MODE=${3:-counts}
cargo build --release -q -p heaptrace
mkdir -p target/fixtures
cc="gcc -O1 -g -fno-builtin -fno-omit-frame-pointer -fno-pic -no-pie"
$cc -o target/fixtures/customalloc-plain tests/fixtures/customalloc.c
$cc -pg -mfentry -mnop-mcount -o target/fixtures/customalloc-nop5 tests/fixtures/customalloc.c
ht=target/release/heaptrace
exec 9>/tmp/heaptrace-tests.lock
flock 9
out=$(mktemp)
wall=$(mktemp)
run() { # NAME CMD...
    local name=$1
    shift
    /usr/bin/time -f %e -o "$wall" "$@" >/dev/null 2>&1
    echo "$name $(cat "$wall")" >>"$out"
}
for _ in $(seq "$REPS"); do
    for b in plain nop5; do
        run "native-$b" target/fixtures/customalloc-$b "$N" 0
        run "traced-$b" "$ht" -q --no-tui --mode "$MODE" --allocator-symbols prefix:xx_ -- \
            target/fixtures/customalloc-$b "$N" 0
    done
done
python3 - "$out" "$N" "$MODE" <<'PY'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    name, t = line.split()
    runs.setdefault(name, []).append(float(t))
N, mode = int(sys.argv[2]), sys.argv[3]
m = lambda k: statistics.median(runs[k])
print(f"N = {N} iterations, --mode {mode}, {len(runs['native-plain'])} interleaved runs each, medians")
print("| build | native (s) | traced (s) | added per iteration | added per probed call |")
print("|---|---|---|---|---|")
for b in ("plain", "nop5"):
    d = (m(f"traced-{b}") - m(f"native-{b}")) / N * 1e6
    print(f"| {b} | {m(f'native-{b}'):.3f} | {m(f'traced-{b}'):.3f} | {d:.2f} us | {d / 6:.2f} us |")
for k in sorted(runs):
    print(k, " ".join(f"{t:.3f}" for t in runs[k]))
PY
rm -f "$out" "$wall"
