#!/usr/bin/env bash
# Processes that come and go under `heaptrace --all`: RUNS runs of tests/bench/livestacks.c one
# after the other (STACKS distinct stacks each, 0.1 s, 100,000 blocks a second), with
# `--stack-map-size MAP` (default 2048) and 200 ms rounds. Prints, for each run, its allocations,
# those counted without a whole stack ("lost" in a frame), and its whole stacks. With ASLR each
# run's stacks are its own, so a tracer that keeps the stacks of processes gone runs out of
# room after MAP / STACKS runs. Holds the tests' system-wide lock. Root needed.
#
#   [HEAPTRACE=BIN] tests/bench/churn.sh [RUNS] [STACKS] [MAP]
set -euo pipefail
RUNS=${1:-8}
STACKS=${2:-400}
MAP=${3:-2048}
[ -n "${HEAPTRACE:-}" ] || cargo build --release -q -p heaptrace
HT=${HEAPTRACE:-target/release/heaptrace}
mkdir -p target/fixtures
gcc -O2 -g -fno-omit-frame-pointer -fno-builtin -o target/fixtures/livestacks tests/bench/livestacks.c
exec 9>/tmp/heaptrace-tests.lock
flock 9
out=$(mktemp -d)
"$HT" -q --no-tui --all --comm livestacks --stack-map-size "$MAP" --interval 200ms \
    --json "$out/doc.json" >/dev/null 2>"$out/err" &
tracer=$!
for _ in $(seq 50); do grep -q attached "$out/err" && break; sleep 0.1; done
for _ in $(seq "$RUNS"); do
    target/fixtures/livestacks "$STACKS" 0.1 100000
    sleep 0.6 # two rounds: one reads its last counts, the next sees it gone
done
kill -INT "$tracer"
wait "$tracer"
python3 - "$out/doc.json" <<'PY'
import json, sys
from collections import defaultdict
doc = json.load(open(sys.argv[1]))
calls, lost, whole = defaultdict(int), defaultdict(int), defaultdict(int)
for s in doc["stacks"]:
    calls[s["pid"]] += s["calls"]
    if any("lost" in f["function"] for f in s["frames"]):
        lost[s["pid"]] += s["calls"]
    else:
        whole[s["pid"]] += 1
print("run  allocations  without a whole stack  whole stacks")
for i, pid in enumerate(sorted(calls), 1):
    print(f"{i:>3}  {calls[pid]:>11}  {lost[pid]:>21}  {whole[pid]:>12}")
print("lost.stack:", doc["lost"]["stack"])
PY
rm -rf "$out"
