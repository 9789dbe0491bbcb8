#!/usr/bin/env bash
# What `--all --comm X` and `--all --cgroup X` cost the processes they leave out, and the one
# they keep: added time per malloc+free pair of `pairs N` run natively, under `heaptrace --all`
# (every process traced: what every process paid when the filters were user space's alone),
# under `--all --comm zzz` (pairs left out, by the kernel), `--all --comm pairs` (pairs kept) and
# `--all --cgroup zzz` (left out by its cgroup). Each --all trace is started,
# waited for, and stopped around the run; REPS interleaved rounds, medians of the loop's own time
# (pairs prints it). Root.
#
#   tests/bench/comm.sh [N] [REPS] [MODE]        (from the repository root)
set -euo pipefail
N=${1:-1000000}
REPS=${2:-5}
MODE=${3:-stacks}
. tests/bench/pairs-setup.sh
out=$(mktemp)
log=$(mktemp)
traced() { # label, heaptrace args...
    local label=$1
    shift
    "$ht" --all --no-tui -q --mode "$MODE" "$@" 2>"$log" &
    local tracer=$!
    until grep -q "attached" "$log"; do sleep 0.05; done
    echo "$label $("$pairs" "$N")" >>"$out"
    kill -INT "$tracer"
    wait "$tracer"
}
for _ in $(seq "$REPS"); do
    echo "native $("$pairs" "$N")" >>"$out"
    traced all
    traced left-out --comm zzz
    traced kept --comm pairs
    traced left-out-cgroup --cgroup zzz
done
python3 tests/bench/added.py "$out" "$N" "--mode $MODE, " run native all left-out kept left-out-cgroup
rm -f "$out" "$log"
