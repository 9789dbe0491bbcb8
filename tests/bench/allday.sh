#!/usr/bin/env bash
# heaptrace's own memory under `--all` on a busy host: `heaptrace --all --no-tui -q --json`
# beside a loop of `gcc -O2 -c FILE` for SECONDS, its RSS read from /proc every STEP seconds;
# then SIGINT, and the time to its exit (last round, summary, JSON) and the JSON's size.
# Extra arguments go to heaptrace. Root needed.
#
#   [HEAPTRACE=BIN] tests/bench/allday.sh [SECONDS] [STEP] [FILE] [-- HEAPTRACE ARGS]
set -uo pipefail
args=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do args+=("$1"); shift; done
[ "${1:-}" = -- ] && shift
SECS=${args[0]:-180}
STEP=${args[1]:-30}
SRC=${args[2]:-tests/fixtures/sites.c}
HT=${HEAPTRACE:-target/release/heaptrace}
out=$(mktemp -d)
"$HT" --all --no-tui -q --json "$out/doc.json" "$@" >/dev/null 2>"$out/err" &
tracer=$!
for _ in $(seq 100); do grep -q attached "$out/err" && break; sleep 0.1; done
(while :; do gcc -O2 -c "$SRC" -o /dev/null; done) &
loop=$!
start=$(date +%s)
echo "elapsed_s rss_kib"
while [ $(($(date +%s) - start)) -lt "$SECS" ]; do
    sleep "$STEP"
    echo "$(($(date +%s) - start)) $(awk '/^VmRSS/ {print $2}' /proc/$tracer/status)"
done
kill "$loop"
wait "$loop" 2>/dev/null
echo "peak_rss_kib $(awk '/^VmHWM/ {print $2}' /proc/$tracer/status)"
t0=$(date +%s.%N)
kill -INT "$tracer"
wait "$tracer"
echo "exit_s $(echo "$(date +%s.%N) - $t0" | bc)"
echo "json_bytes $(stat -c %s "$out/doc.json")"
python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
print("processes", len(d["processes"]), "stacks", len(d["stacks"]), "folded", d.get("folded"))
' "$out/doc.json"
grep -v '^heaptrace: attached' "$out/err" | tail -3
if [ -n "${KEEP:-}" ]; then mv "$out/doc.json" "$KEEP"; fi
rm -rf "$out"
