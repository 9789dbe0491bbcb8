#!/usr/bin/env bash
# What a trace costs the processes it does not trace: an unrelated process's loop of N
# malloc+free pairs (tests/fixtures/pairs.c, best of 3 runs of its own timer) alone, beside
# `heaptrace --no-follow-forks -- sleep` (probes bound to the command), beside `heaptrace --
# sleep` (its forks followed, each held at its fork for probes bound to it), and beside
# `heaptrace -p PID --follow-forks` (the tree seized, its forks held the same way).
#
#   tests/bench/hostcost.sh [HEAPTRACE] [N]
set -euo pipefail
cd "$(dirname "$0")/../.."
H=${1:-target/release/heaptrace}
N=${2:-1000000}
bin=$(mktemp -d)/pairs
gcc -O2 -o "$bin" tests/fixtures/pairs.c
best() { for _ in 1 2 3; do "$bin" "$N"; done | sort -n | head -1; }
beside() {
    "$H" --no-tui -q "$@" 2>/dev/null &
    local hp=$!
    sleep 3
    echo "$(best)"
    kill -INT "$hp"
    wait "$hp" 2>/dev/null || true
}
# Alone on the host's probes: no probing test or bench may run meanwhile.
exec 9>/tmp/heaptrace-tests.lock
flock 9
echo "alone: $(best) s"
echo "beside heaptrace --no-follow-forks -- sleep: $(beside --no-follow-forks -- sleep 60) s"
echo "beside heaptrace -- sleep (forks followed): $(beside -- sleep 60) s"
sleep 60 &
sp=$!
echo "beside heaptrace -p PID --follow-forks: $(beside -p "$sp" --follow-forks) s"
kill "$sp"
echo "alone again: $(best) s"
