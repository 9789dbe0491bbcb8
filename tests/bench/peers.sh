#!/usr/bin/env bash
# heaptrace against the other tracers this machine has, on the same `pairs N` loop (N
# malloc(64)+free pairs on one thread), interleaved in one batch: the added time per pair
# against a native run. The loop times itself, so attaching and detaching are left out.
#
#   heaptrace-calls, -counts, -stacks   heaptrace --mode M
#   inproc-counts, -stacks              heaptrace --in-process --mode M (no trap)
#   floor-bare-traps                    the three traps alone (`--floor bare-traps`)
#   heaptrack                           LD_PRELOAD, in-process (skipped if not installed)
#   bpftrace-*: skipped if bpftrace is not installed
#   bpftrace-count                      a count at malloc's and free's entries, as a naive
#                                       uprobe tool places them (free's first instruction is
#                                       single-stepped)
#   bpftrace-live                       what heaptrace's counts mode keeps, the way memleak
#                                       does: malloc's size by thread at entry, the block in a
#                                       map by address at return, deleted at free
#   bpftrace-stacks                     bpftrace-live plus a count per user stack at return
#
#   tests/bench/peers.sh [N] [REPS]        (from the repository root, as root)
set -euo pipefail
N=${1:-1000000}
REPS=${2:-5}
. tests/bench/pairs-setup.sh
command -v bpftrace >/dev/null || echo "peers.sh: bpftrace is not installed: its runs left out" >&2
libc=$(ldd "$pairs" | awk '/libc\.so/ {print $3}')
count="uprobe:$libc:malloc, uprobe:$libc:free { @[probe] = count(); }"
live="uprobe:$libc:malloc { @size[tid] = arg0; }
uretprobe:$libc:malloc /@size[tid]/ { @live[retval] = @size[tid]; delete(@size[tid]); @allocs = count(); }
uprobe:$libc:free /@live[arg0]/ { delete(@live[arg0]); @frees = count(); }"
stacks="uprobe:$libc:malloc { @size[tid] = arg0; }
uretprobe:$libc:malloc /@size[tid]/ { @live[retval] = @size[tid]; delete(@size[tid]); @sites[ustack] = count(); }
uprobe:$libc:free /@live[arg0]/ { delete(@live[arg0]); @frees = count(); }"
# The loop's time: the one line of the output that is only a number with six decimals.
loop() { grep -E '^[0-9]+\.[0-9]{6}$' | head -1; }
out=$(mktemp)
tmp=$(mktemp -d)
for _ in $(seq "$REPS"); do
    echo "native $("$pairs" "$N")" >>"$out"
    for m in calls counts stacks; do
        echo "heaptrace-$m $("$ht" -q --mode "$m" -- "$pairs" "$N" 2>/dev/null | loop)" >>"$out"
    done
    for m in counts stacks; do
        echo "inproc-$m $("$ht" -q --in-process --mode "$m" -- "$pairs" "$N" 2>/dev/null | loop)" \
            >>"$out"
    done
    echo "floor-bare-traps $("$ht" -q --floor bare-traps -- "$pairs" "$N" 2>/dev/null | loop)" >>"$out"
    if command -v heaptrack >/dev/null; then
        echo "heaptrack $(heaptrack -o "$tmp/ht" "$pairs" "$N" 2>/dev/null | loop)" >>"$out"
        rm -f "$tmp"/ht*
    fi
    if command -v bpftrace >/dev/null; then
        for s in count live stacks; do
            echo "bpftrace-$s $(bpftrace -e "${!s}" -c "$pairs $N" 2>/dev/null | loop)" >>"$out"
        done
    fi
done
python3 - "$out" "$N" <<'PY'
import statistics, sys
t = {}
for line in open(sys.argv[1]):
    how, *s = line.split()
    if s:
        t.setdefault(how, []).append(float(s[0]))
N = int(sys.argv[2])
m = lambda k: statistics.median(t[k])
print(f"N = {N} pairs, {len(t['native'])} interleaved runs each, medians of the loop time")
print("| tracer | loop time (s) | added per malloc+free pair |")
print("|---|---|---|")
for how in t:
    print(f"| {how} | {m(how):.3f} | {(m(how) - m('native')) / N * 1e6:.2f} us |")
print("runs (s):")
for how in t:
    print(f"  {how}:", " ".join(f"{x:.3f}" for x in t[how]))
PY
rm -rf "$out" "$tmp"
