#!/usr/bin/env bash
# The daemon's cost under process churn: `heaptrace -q --no-tui --all` (stacks mode, 1 round/s)
# while a shell starts processes for SECONDS: each loop is a bash whose 20 command
# substitutions fork and exec readlink (some 40 processes, each forked image dropped at its
# exec), as a pyenv shim does. Prints the processes started, heaptrace's CPU seconds (user,
# system) and peak RSS (/usr/bin/time), how many ended processes it folded, and the
# allocations counted without a whole stack (a "lost" frame). Holds the tests' system-wide
# lock. Root needed.
#
#   [HEAPTRACE=BIN] tests/bench/churncpu.sh [SECONDS]
set -euo pipefail
SECONDS_=${1:-30}
[ -n "${HEAPTRACE:-}" ] || cargo build --release -q -p heaptrace
HT=${HEAPTRACE:-target/release/heaptrace}
exec 9>/tmp/heaptrace-tests.lock
flock 9
out=$(mktemp -d)
/usr/bin/time -f "%U %S %M" -o "$out/time" "$HT" -q --no-tui --all --json "$out/doc.json" \
    >/dev/null 2>"$out/err" &
tracer=$!
for _ in $(seq 50); do grep -q attached "$out/err" 2>/dev/null && break; sleep 0.1; done
sleep 1
end=$((SECONDS + SECONDS_))
loops=0
while [ $SECONDS -lt $end ]; do
    bash -c 'for i in $(seq 20); do v=$(readlink -f /tmp); done'
    loops=$((loops + 1))
done
# heaptrace (and time, which waits on): interrupted as Ctrl-C would.
pkill -INT -f -- "--json $out/doc.json" || true
wait "$tracer" || true
read -r user sys rss < "$out/time"
folded=$(grep -o '\[[0-9]* exited processes\]' "$out/err" | head -1 || true)
lost=$(/usr/bin/python3 - "$out/doc.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
calls = lambda s: s["calls"]
lost = lambda s: any("lost" in f["function"] for f in s["frames"])
total = sum(map(calls, doc["stacks"]))
gone = sum(calls(s) for s in doc["stacks"] if lost(s))
print(f"{gone} of {total} allocations without a whole stack ({100 * gone / max(total, 1):.1f} %)")
PY
)
echo "loops $loops (about $((loops * 41)) processes) in ${SECONDS_} s; heaptrace CPU user ${user} s, system ${sys} s; peak RSS $((rss / 1024)) MiB; ${folded:-nothing folded}; $lost"
rm -rf "$out"
