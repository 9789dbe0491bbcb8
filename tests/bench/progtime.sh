#!/usr/bin/env bash
# What heaptrace's kernel programs cost per malloc+free pair in each --mode, from the kernel's
# BPF run-time statistics (`--probe-stats`), beside the floors' programs, which only count.
# Wall-clock runs (modes.sh) vary by 10-20 % from run to run here; program run times isolate
# the programs' own work from the traps around them. Both include the statistics' own two
# clock reads per run, which the difference to a floor cancels.
#
# Per pair: malloc_entry + alloc_return + free_entry, against the floor's same programs. Apart:
# mem_sys_enter/exit, the syscall tracepoints, which run on every syscall of the host where
# reservations are traced with them (not here: pairs' libc wrappers are probed instead), the
# sys_uretprobe syscall each malloc return makes included (about N runs each then).
#
#   tests/bench/progtime.sh [N] [REPS]        (from the repository root, as root)
set -euo pipefail
N=${1:-1000000}
REPS=${2:-3}
. tests/bench/pairs-setup.sh
dir=$(mktemp -d)
for r in $(seq "$REPS"); do
    for m in bare-entry bare-traps bare calls counts sizes stacks; do
        "$ht" -q --probe-stats $(modeflag "$m") --json "$dir/$m.$r.json" -- "$pairs" "$N" >/dev/null 2>&1
    done
done
python3 - "$dir" "$N" "$REPS" <<'PY'
import json, statistics, sys
d, N, reps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
modes = ["bare-entry", "bare-traps", "bare", "calls", "counts", "sizes", "stacks"]
floor = {"calls": "bare-entry", "counts": "bare-traps", "sizes": "bare-traps", "stacks": "bare"}
names = ["malloc_entry", "alloc_return", "free_entry", "mem_sys_enter", "mem_sys_exit"]
per = {}
for m in modes:
    rows = []
    for r in range(1, reps + 1):
        progs = {p["name"]: p for p in json.load(open(f"{d}/{m}.{r}.json"))["heaptrace"]["programs"]}
        # ns per pair: each program's total time over the N pairs (the syscall tracepoints'
        # runs are host-wide; only those of the pairs' uretprobe syscalls are about N).
        rows.append({n: progs[n]["run_ns"] / N if n in progs else 0.0 for n in names})
    per[m] = {n: statistics.median(r[n] for r in rows) for n in names}
print(f"N = {N} pairs, medians of {reps} runs, ns per pair of kernel program time")
print("| mode | malloc entry | return | free | programs | over the floor's | syscall tracepoints |")
print("|---|---|---|---|---|---|---|")
for m in modes:
    p = per[m]
    tp = p["mem_sys_enter"] + p["mem_sys_exit"]
    tot = p["malloc_entry"] + p["alloc_return"] + p["free_entry"]
    over = ""
    if m in floor:
        f = per[floor[m]]
        over = f'+{tot - (f["malloc_entry"] + f["alloc_return"] + f["free_entry"]):.0f}'
    print(f'| {m} | {p["malloc_entry"]:.0f} | {p["alloc_return"]:.0f} | {p["free_entry"]:.0f} | {tot:.0f} | {over} | {tp:.0f} |')
PY
rm -rf "$dir"
