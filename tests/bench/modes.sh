#!/usr/bin/env bash
# Added time per malloc+free pair in each --mode (calls, counts, sizes, stacks), entry probes placed,
# and the floors, hidden modes whose programs only count: `bare-entry` (calls mode's probes: malloc
# entry and free+9), `bare-traps` (counts and sizes modes' probes: + malloc's return), `bare`
# (stacks mode's: + a stack walk at the return). And
# for `stacks-s64k`: stacks mode with --sample-bytes 65536 (a 64-byte block is sampled with
# probability 1 - exp(-64/65536), about 1 in 1000). And `counts-nores`, `stacks-nores`: with
# --no-reservations (no probes on the memory syscalls' wrappers); `counts-tp`, `stacks-tp`: with
# the memory syscalls traced by the syscall tracepoints instead, which also run for the
# sys_uretprobe syscall of every malloc return. `counts-atomic`, `stacks-atomic`: with
# --atomic-counters (every counter an atomic add, as before the programs turned preemption off).
# With bpftrace installed, two floors that owe nothing to heaptrace: `bpftrace-entry` counts at
# malloc's entry (`push %r12`, an emulated trap, as free+9's `push %rbp` is) and
# `bpftrace-return` adds a count at malloc's return. Debian's bpftrace 0.17 cannot probe
# free+9 (built without uprobe offset checks), so these rows leave free untraced: three traps
# cost about bpftrace-return + (bpftrace-entry - native).
# Runs `pairs N` natively and under `heaptrace -q --mode M -- pairs N`, REPS interleaved rounds,
# and reports medians of the loop's own time (pairs prints it; attach/detach left out). Root.
#
#   tests/bench/modes.sh [N] [REPS]        (from the repository root)
set -euo pipefail
N=${1:-1000000}
REPS=${2:-5}
. tests/bench/pairs-setup.sh
libc=$(ldd "$pairs" | awk '/libc\.so/ {print $3}')
bt_entry="uprobe:$libc:malloc { @entries = count(); }"
bt_return="$bt_entry uretprobe:$libc:malloc { @returns = count(); }"
bt=()
command -v bpftrace >/dev/null && bt=(bpftrace-entry bpftrace-return)
out=$(mktemp)
for _ in $(seq "$REPS"); do
    echo "native $("$pairs" "$N")" >>"$out"
    for m in bare-entry bare-traps bare calls counts sizes stacks; do
        echo "$m $("$ht" -q $(modeflag "$m") -- "$pairs" "$N" 2>/dev/null)" >>"$out"
    done
    echo "stacks-s64k $("$ht" -q --mode stacks --sample-bytes 65536 -- "$pairs" "$N" 2>/dev/null)" >>"$out"
    for m in counts stacks; do
        echo "$m-nores $("$ht" -q --mode "$m" --no-reservations -- "$pairs" "$N" 2>/dev/null)" >>"$out"
        echo "$m-tp $("$ht" -q --mode "$m" --syscall-tracepoints -- "$pairs" "$N" 2>/dev/null)" >>"$out"
        echo "$m-atomic $("$ht" -q --mode "$m" --atomic-counters -- "$pairs" "$N" 2>/dev/null)" >>"$out"
    done
    if [ ${#bt[@]} -gt 0 ]; then
        # The loop's time is the one output line that is only a number with six decimals.
        for p in entry return; do
            prog="bt_$p"
            echo "bpftrace-$p $(bpftrace -e "${!prog}" -c "$pairs $N" 2>/dev/null |
                grep -E '^[0-9]+\.[0-9]{6}$' | head -1)" >>"$out"
        done
    fi
done
python3 tests/bench/added.py "$out" "$N" "" mode native bare-entry bare-traps bare calls counts sizes stacks stacks-s64k counts-nores stacks-nores counts-tp stacks-tp counts-atomic stacks-atomic "${bt[@]}"
rm -f "$out"
