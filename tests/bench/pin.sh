#!/usr/bin/env bash
# Counting with preemption off (plain adds, the default where the kernel has
# bpf_preempt_disable) against atomic adds (--atomic-counters), the same binary, interleaved:
# the added time per malloc+free pair of `pairs N` in counts, sizes and stacks modes, beside
# their floors (bare-traps, bare; see modes.sh). Medians of REPS runs of the loop's own time.
#
#   tests/bench/pin.sh [N] [REPS]        (from the repository root, as root)
set -euo pipefail
N=${1:-1000000}
REPS=${2:-11}
. tests/bench/pairs-setup.sh
out=$(mktemp)
for _ in $(seq "$REPS"); do
    echo "native $("$pairs" "$N")" >>"$out"
    for m in bare-traps bare; do
        echo "$m $("$ht" -q $(modeflag "$m") -- "$pairs" "$N" 2>/dev/null)" >>"$out"
    done
    for m in counts sizes stacks; do
        echo "$m $("$ht" -q $(modeflag "$m") -- "$pairs" "$N" 2>/dev/null)" >>"$out"
        echo "$m-atomic $("$ht" -q --mode "$m" --atomic-counters -- "$pairs" "$N" 2>/dev/null)" >>"$out"
    done
done
python3 tests/bench/added.py "$out" "$N" "" run native bare-traps bare counts counts-atomic sizes sizes-atomic stacks stacks-atomic
rm -f "$out"
