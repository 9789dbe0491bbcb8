#!/usr/bin/env bash
# What `--serve` costs. (1) Scrape times: `heaptrace -q --serve -- livestacks STACKS` keeps
# STACKS distinct stacks live; SCRAPES timed GETs each of /metrics and /debug/pprof/heap
# (curl's total time; best and median), and the answers' sizes. (2) The traced processes' cost
# per call with and without --serve, in one batch: `pairs N` under heaptrace, REPS interleaved
# runs each, a client scraping /metrics and /debug/pprof/heap every 100 ms during the
# --serve runs. Root needed.
#
#   tests/bench/serve.sh [STACKS] [SCRAPES] [N] [REPS]        (from the repository root)
set -euo pipefail
STACKS=${1:-10000}
SCRAPES=${2:-20}
N=${3:-1000000}
REPS=${4:-5}
. tests/bench/pairs-setup.sh
gcc -O2 -g -fno-omit-frame-pointer -fno-builtin -o target/fixtures/livestacks tests/bench/livestacks.c
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
served() { # PORT: waits until /metrics answers 200
    for _ in $(seq 300); do
        curl -sf -o /dev/null "http://127.0.0.1:$1/metrics" && return 0
        sleep 0.1
    done
    return 1
}

P=$(port)
"$ht" -q --no-tui --serve "127.0.0.1:$P" -- target/fixtures/livestacks "$STACKS" 60 100000 &
tracer=$!
served "$P"
sleep 5 # every stack allocated and named
times=$(mktemp)
for path in /metrics /debug/pprof/heap; do
    for _ in $(seq "$SCRAPES"); do
        curl -s -o /dev/null -w "$path %{time_total} %{size_download}\n" "http://127.0.0.1:$P$path" >>"$times"
    done
done
samples=$(curl -s "http://127.0.0.1:$P/debug/pprof/heap" | python3 -c '
import gzip, sys
b = gzip.decompress(sys.stdin.buffer.read())
# profile.proto field 2 (sample), length-delimited: count them at the top level.
i = n = 0
def varint(i):
    v = s = 0
    while True:
        c = b[i]; i += 1; v |= (c & 0x7f) << s; s += 7
        if c < 0x80: return v, i
while i < len(b):
    key, i = varint(i)
    if key & 7 == 2:
        ln, i = varint(i); n += key >> 3 == 2; i += ln
    elif key & 7 == 0:
        _, i = varint(i)
    else:
        raise SystemExit("unexpected wire type")
print(n)')
kill -INT "$tracer"
wait "$tracer" || true
python3 - "$times" "$STACKS" "$samples" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    path, t, size = line.split()
    rows.setdefault(path, []).append((float(t), int(size)))
print(f"livestacks {sys.argv[2]}: the heap profile holds {sys.argv[3]} samples")
print("| path | best (ms) | median (ms) | size (bytes) |")
print("|---|---|---|---|")
for path, r in rows.items():
    ts = [t * 1000 for t, _ in r]
    print(f"| {path} | {min(ts):.1f} | {statistics.median(ts):.1f} | {r[-1][1]} |")
PY
rm -f "$times"

out=$(mktemp)
scrape() { # PORT: GETs both endpoints every 100 ms until killed
    while true; do
        curl -s -o /dev/null "http://127.0.0.1:$1/metrics" || true
        curl -s -o /dev/null "http://127.0.0.1:$1/debug/pprof/heap" || true
        sleep 0.1
    done
}
for _ in $(seq "$REPS"); do
    echo "plain $("$ht" -q -- "$pairs" "$N" malloc 2>/dev/null)" >>"$out"
    P=$(port)
    (sleep 0.5; scrape "$P") &
    client=$!
    echo "serve $("$ht" -q --serve "127.0.0.1:$P" -- "$pairs" "$N" malloc 2>/dev/null)" >>"$out"
    kill "$client"
    wait "$client" 2>/dev/null || true
done
python3 - "$out" "$N" <<'PY'
import statistics, sys
loop = {}
for line in open(sys.argv[1]):
    how, l = line.split()
    loop.setdefault(how, []).append(float(l))
N = int(sys.argv[2])
m = {k: statistics.median(v) for k, v in loop.items()}
print(f"N = {N} malloc+free pairs under heaptrace, {len(loop['plain'])} interleaved runs each, medians")
print("| run | loop time (s) | per pair (us) |")
print("|---|---|---|")
for how in ("plain", "serve"):
    print(f"| {how} | {m[how]:.3f} | {m[how] / N * 1e6:.3f} |")
print(f"serve / plain: {m['serve'] / m['plain']:.3f}")
for how in ("plain", "serve"):
    print(f"  {how}:", " ".join(f"{v:.3f}" for v in loop[how]))
PY
rm -f "$out"
