#!/usr/bin/env bash
# What a launched command's fork pays (tests/bench/forkpairs.c: the child times its own N
# malloc+free pairs; best of 3): alone, under `heaptrace --no-follow-forks --` (not followed:
# its inherited breakpoints are taken out at its fork), and under `heaptrace --` (followed,
# counted: a trap per call).
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
