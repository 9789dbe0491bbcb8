#!/usr/bin/env bash
# Attach and detach time: `heaptrace -q --no-tui -p PID` on the spin fixture, from heaptrace's
# start to its "attached" line (attach), and from SIGTERM to its exit (detach, with the final
# read and summary). REPS runs, medians. Holds the tests' system-wide lock. Root needed.
#
#   tests/bench/attach.sh [REPS] [HEAPTRACE ARGS...]      (from the repository root)
set -euo pipefail
REPS=${1:-7}
shift || true
cargo build --release -q -p heaptrace
mkdir -p target/fixtures
gcc -O1 -g -fno-builtin -o target/fixtures/spin tests/fixtures/spin.c
exec 9>/tmp/heaptrace-tests.lock
flock 9
python3 - "$REPS" target/release/heaptrace target/fixtures/spin "$@" <<'PY'
import os, signal, statistics, subprocess, sys, time
reps, ht, spin, extra = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
target = subprocess.Popen([spin])
attach, detach, probes = [], [], None
try:
    for _ in range(reps):
        t0 = time.monotonic()
        p = subprocess.Popen([ht, "-q", "--no-tui", *extra, "-p", str(target.pid)],
                             stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        for line in p.stderr:
            if "attached" in line:
                attach.append(time.monotonic() - t0)
                probes = line.split()[2]
                break
        else:
            sys.exit("heaptrace ended before attaching")
        time.sleep(1.5)  # a round or so
        t1 = time.monotonic()
        p.send_signal(signal.SIGTERM)
        p.stderr.read()
        p.wait()
        detach.append(time.monotonic() - t1)
finally:
    target.kill()
med = statistics.median
print(f"{probes} probes, {reps} runs: attach median {med(attach):.3f} s, detach median {med(detach):.3f} s")
print("attach:", " ".join(f"{a:.3f}" for a in attach))
print("detach:", " ".join(f"{d:.3f}" for d in detach))
PY
