#!/usr/bin/env bash
# `heaptrace --all --serve` for DURATION seconds while a compile loop runs (gcc building the C
# fixtures, over and over: thousands of short processes), scraped every second (/metrics and
# /debug/pprof/allocs). heaptrace's RSS is sampled every 30 s; at the end, its rounds, late
# rounds, longest gap between rounds and losses, from /metrics. Takes the tests' system-wide
# lock for its whole length. Root needed.
#
#   tests/bench/soak.sh [DURATION] [INTERVAL]        (from the repository root)
set -euo pipefail
DURATION=${1:-1800}
INTERVAL=${2:-1s}
cargo build --release -q -p heaptrace
ht=target/release/heaptrace
exec 9>/tmp/heaptrace-tests.lock
flock 9
P=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
log=$(mktemp -d)
"$ht" --all --no-tui -q --interval "$INTERVAL" --serve "127.0.0.1:$P" 2>"$log/stderr" &
tracer=$!
for _ in $(seq 600); do
    curl -sf -o /dev/null "http://127.0.0.1:$P/metrics" && break
    sleep 0.1
done
(
    while true; do
        for f in tests/fixtures/*.c; do
            gcc -O2 -g -pthread -o "$log/fx" "$f" 2>/dev/null || true
        done
    done
) &
compiler=$!
(
    while true; do
        curl -s -o /dev/null -w "%{http_code} %{time_total}\n" "http://127.0.0.1:$P/metrics" >>"$log/metrics" || true
        curl -s -o /dev/null -w "%{http_code} %{time_total}\n" "http://127.0.0.1:$P/debug/pprof/allocs" >>"$log/allocs" || true
        sleep 1
    done
) &
scraper=$!
start=$(date +%s)
while (($(date +%s) - start < DURATION)); do
    echo "$(($(date +%s) - start)) $(awk '/VmRSS/ {print $2}' /proc/$tracer/status)" >>"$log/rss"
    sleep 30
done
curl -s "http://127.0.0.1:$P/metrics" >"$log/final"
kill "$scraper" "$compiler"
wait "$scraper" "$compiler" 2>/dev/null || true
kill -INT "$tracer"
wait "$tracer" || echo "heaptrace exited $?"
python3 - "$log" "$DURATION" <<'PY'
import statistics, sys
d = sys.argv[1]
rss = [tuple(map(int, l.split())) for l in open(f"{d}/rss")]
print(f"{int(sys.argv[2])} s of --all --serve, a compile loop, a scrape a second")
print("RSS (MiB) at t (s):", " ".join(f"{t}:{kb/1024:.0f}" for t, kb in rss))
half = [kb for t, kb in rss if t >= int(sys.argv[2]) // 2]
print(f"RSS first {rss[0][1]/1024:.0f} MiB, max {max(kb for _, kb in rss)/1024:.0f} MiB, "
      f"second half {min(half)/1024:.0f}-{max(half)/1024:.0f} MiB")
for name in ("metrics", "allocs"):
    rows = [l.split() for l in open(f"{d}/{name}")]
    ok = [float(t) * 1000 for c, t in rows if c == "200"]
    print(f"/{name}: {len(rows)} scrapes, {len(ok)} answered 200, median {statistics.median(ok):.1f} ms, "
          f"max {max(ok):.1f} ms")
final = open(f"{d}/final").read().splitlines()
for l in final:
    if l.startswith(("heaptrace_rounds", "heaptrace_round_gap", "heaptrace_losses_total",
                     "heaptrace_resident", "heaptrace_traced", "heaptrace_cpu")):
        if not (l.startswith("heaptrace_losses_total") and l.endswith(" 0")):
            print(l)
PY
echo "logs in $log"
