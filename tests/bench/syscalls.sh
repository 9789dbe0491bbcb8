#!/usr/bin/env bash
# What tracing the memory behind malloc costs the rest of the host: ns per getppid and per
# mmap+munmap in bench/workloads/sysloop.c, run natively, beside `heaptrace -p IDLE` (probes
# on the idle process's libc wrappers of the memory syscalls), beside it with
# `--syscall-tracepoints` (the syscall tracepoints instead, as for an allocator file without
# such wrappers), and beside it with `--no-reservations`; REPS interleaved rounds, medians.
# Root needed.
#
#   tests/bench/syscalls.sh [REPS]        (from the repository root)
set -euo pipefail
REPS=${1:-5}
cargo build --release -q -p heaptrace
mkdir -p target/fixtures
gcc -O2 -o target/fixtures/sysloop bench/workloads/sysloop.c
ht=target/release/heaptrace
loop=target/fixtures/sysloop
exec 9>/tmp/heaptrace-tests.lock
flock 9
out=$(mktemp)
sleep 100000 &
idle=$!
beside() { # NAME [heaptrace options]
    local name=$1
    shift
    local log
    log=$(mktemp)
    "$ht" --no-tui -q -p "$idle" "$@" 2>"$log" &
    local pid=$!
    until grep -q attached "$log"; do sleep 0.1; done
    echo "$name $("$loop")" >>"$out"
    kill -INT "$pid"
    wait "$pid" || true
    rm -f "$log"
}
for _ in $(seq "$REPS"); do
    echo "native $("$loop")" >>"$out"
    beside traced
    beside tracepoints --syscall-tracepoints
    beside no-reservations --no-reservations
done
kill "$idle"
printf '%-16s %14s %18s\n' run "getppid ns" "mmap+munmap ns"
for name in native traced tracepoints no-reservations; do
    g=$(awk -v n="$name" '$1 == n { print $2 }' "$out" | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
    m=$(awk -v n="$name" '$1 == n { print $3 }' "$out" | sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }')
    printf '%-16s %14s %18s\n' "$name" "$g" "$m"
done
rm -f "$out"
