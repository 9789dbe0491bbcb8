#!/usr/bin/env bash
# Added time per malloc+free pair on a 5-frame stack (tests/bench/deeppairs.c) built without
# frame pointers (`nofp`: frames unwound from .eh_frame) and with them (`fp`): counts mode,
# stacks mode with unwind tables, stacks mode with frame pointers only (--unwind-table-size 0:
# the walk stops at the first frame without them), and with tables and --sample-bytes 65536. REPS interleaved rounds, medians
# of the loop's own time. Root.
#
#   tests/bench/unwind.sh [N] [REPS]        (from the repository root)
set -euo pipefail
N=${1:-1000000}
REPS=${2:-5}
. tests/bench/pairs-setup.sh
for v in nofp fp; do
    flag=-fomit-frame-pointer
    [ $v = fp ] && flag=-fno-omit-frame-pointer
    gcc -O2 -fno-builtin $flag -o target/fixtures/deeppairs-$v tests/bench/deeppairs.c
done
# Unquoted where used: two arguments.
rows="--unwind-table-size 1048576"
out=$(mktemp)
for _ in $(seq "$REPS"); do
    for v in nofp fp; do
        bin=target/fixtures/deeppairs-$v
        echo "native-$v $("$bin" "$N")" >>"$out"
        echo "counts-$v $("$ht" -q --mode counts -- "$bin" "$N" 2>/dev/null)" >>"$out"
        echo "stacks-$v $("$ht" -q --mode stacks $rows -- "$bin" "$N" 2>/dev/null)" >>"$out"
        echo "stacks-fponly-$v $("$ht" -q --mode stacks --unwind-table-size 0 -- "$bin" "$N" 2>/dev/null)" >>"$out"
        echo "stacks-s64k-$v $("$ht" -q --mode stacks $rows --sample-bytes 65536 -- "$bin" "$N" 2>/dev/null)" >>"$out"
    done
done
for v in nofp fp; do
    python3 tests/bench/added.py "$out" "$N" "$v: " mode native-$v counts-$v stacks-$v stacks-fponly-$v stacks-s64k-$v
done
rm -f "$out"
