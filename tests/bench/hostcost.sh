#!/usr/bin/env bash
# What a trace costs the processes it does not trace: an unrelated process's loop of N
# malloc+free pairs (tests/fixtures/pairs.c, best of 3 runs of its own timer) alone, beside
# `heaptrace -- sleep` (probes bound to the command), and beside `heaptrace --follow-forks --
# sleep` (probes in every process that maps libc, the kernel counting only the tree).
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
    "$H" --no-tui -q "$@" -- sleep 60 2>/dev/null &
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
echo "beside heaptrace -- sleep: $(beside) s"
echo "beside heaptrace --follow-forks -- sleep: $(beside --follow-forks) s"
echo "alone again: $(best) s"
