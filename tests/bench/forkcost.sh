#!/usr/bin/env bash
# What a launched command's fork pays (tests/bench/forkpairs.c: the child times its own N
# malloc+free pairs; best of 3): alone, under `heaptrace --no-follow-forks --` (not followed:
# its inherited breakpoints are taken out at its fork), and under `heaptrace --` (followed,
# counted: a trap per call), and a fork of a process traced with `heaptrace -p` (not followed:
# its inherited breakpoints are taken out as it runs).
#
#   tests/bench/forkcost.sh [HEAPTRACE] [N]
set -euo pipefail
cd "$(dirname "$0")/../.."
H=${1:-target/release/heaptrace}
N=${2:-1000000}
bin=$(mktemp -d)/forkpairs
gcc -O2 -o "$bin" tests/bench/forkpairs.c
best() { for _ in 1 2 3; do "$@" "$bin" "$N" 2>/dev/null | head -1; done | sort -n | head -1; }
exec 9>/tmp/heaptrace-tests.lock
flock 9
echo "alone: $(best) s"
echo "heaptrace --no-follow-forks --: $(best "$H" --no-tui -q --no-follow-forks --) s"
echo "heaptrace -- (followed): $(best "$H" --no-tui -q --) s"
# The process forks once heaptrace -p is attached.
pid_run() {
    local d; d=$(mktemp -d)
    mkfifo "$d/in"
    FORKPAIRS_WAIT=1 "$bin" "$N" <"$d/in" >"$d/out" &
    local pid=$!
    exec 7>"$d/in"
    until grep -q ready "$d/out"; do sleep 0.01; done
    "$H" --no-tui -p "$pid" >/dev/null 2>"$d/err" &
    local tracer=$!
    until grep -q attached "$d/err"; do sleep 0.01; done
    echo g >&7
    exec 7>&-
    wait "$pid" "$tracer" || true
    grep -v ready "$d/out" | head -1
    rm -rf "$d"
}
echo "heaptrace -p (a fork after the attach): $(for _ in 1 2 3; do pid_run; done | sort -n | head -1) s"
