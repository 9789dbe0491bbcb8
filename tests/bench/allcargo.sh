#!/usr/bin/env bash
# `--all` beside a Rust build: heaptrace traces every process on the host while cargo builds
# this workspace's xtask (serde, clap and the rest) into an empty target directory, then
# prints what it lost, the build's time and heaptrace's own CPU time and peak RSS.
#   sudo tests/bench/allcargo.sh [heaptrace options]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
ht=${HEAPTRACE:-$root/target/release/heaptrace}
out=$(mktemp -d)
/usr/bin/time -o "$out/time" -f "heaptrace: user %U s, sys %S s, peak RSS %M KiB" \
  "$ht" --all -q --no-tui --json "$out/all.json" "$@" > /dev/null 2> "$out/err" &
sleep 3
start=$(date +%s.%N)
(cd "$root" && CARGO_TARGET_DIR="$out/target" cargo build -q -p xtask)
echo "build: $(echo "$(date +%s.%N) - $start" | bc) s"
sleep 2
# time(1) ignores SIGINT: the signal goes to heaptrace itself.
pkill -INT -f -- "--json $out/all.json" || true
wait
python3 - "$out/all.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("allocations:", d["totals"]["allocations"])
print("lost:", {k: v for k, v in d["lost"].items() if v})
PY
cat "$out/time"
rm -rf "$out/target"
echo "json: $out/all.json"
