#!/usr/bin/env bash
# `--all` beside a compile loop: heaptrace traces every process on the host for SECONDS while
# g++ -O2 compiles SOURCE again and again, and prints what it lost and its own peak RSS.
#   sudo tests/bench/allcompile.sh SECONDS SOURCE.cpp [heaptrace options]
# AFTER=N starts the loop N seconds after heaptrace (its first compiler then maps files no
# process mapped at the attach); by default it starts a second before.
set -euo pipefail
secs=${1:?seconds}; src=${2:?C++ source}; shift 2
ht=${HEAPTRACE:-$(dirname "$0")/../../target/release/heaptrace}
out=$(mktemp -d)
after=${AFTER:-0}
(
  sleep "$after"
  end=$((SECONDS + secs - after)); n=0
  while [ $SECONDS -lt "$end" ]; do g++ -O2 -c "$src" -o "$out/loop.o"; n=$((n + 1)); done
  echo "compiles: $n" > "$out/loop"
) &
loop=$!
[ "$after" -gt 0 ] || sleep 1
/usr/bin/time -v timeout -s INT "$secs" "$ht" --all -q --no-tui --json "$out/all.json" "$@" \
  > /dev/null 2> "$out/err" || true
wait $loop
python3 - "$out/all.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print("allocations:", d["totals"]["allocations"])
print("lost:", {k: v for k, v in d["lost"].items() if v})
PY
grep -E "Maximum resident" "$out/err"
cat "$out/loop"
