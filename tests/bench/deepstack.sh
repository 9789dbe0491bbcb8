#!/usr/bin/env bash
# Stacks mode on deep stacks, whose frames the walk reads in several reads: `deepspread N DEPTH
# PAD` (tests/bench/deepspread.c) at DEPTH 40 with 128-byte frames, with and without frame
# pointers, at DEPTH 80 with 32, and at DEPTH 10 with none (a stack one read holds), and `pairs`
# for the shallowest. Each BUILD (a heaptrace binary; default: this tree's release build) in
# every round, REPS interleaved rounds; added time per pair in stacks mode, medians of the
# loop's own time. Root.
#
#   tests/bench/deepstack.sh [REPS] [N] [BUILD...]     (from the repository root)
set -euo pipefail
REPS=${1:-5}
N=${2:-200000}
. tests/bench/pairs-setup.sh
builds=("${@:3}")
[ ${#builds[@]} -gt 0 ] || builds=("$ht")
ds=target/fixtures/deepspread
gcc -O2 -g -fno-omit-frame-pointer -Wall -o "$ds" tests/bench/deepspread.c
gcc -O2 -g -fomit-frame-pointer -Wall -o "$ds-nofp" tests/bench/deepspread.c
work=("$ds $N 40 128" "$ds-nofp $N 40 128" "$ds $N 80 32" "$ds $N 10 0" "$pairs $((N * 5))")
out=$(mktemp)
for _ in $(seq "$REPS"); do
    for i in "${!work[@]}"; do
        echo "$i native $(${work[$i]} | tail -1)" >>"$out"
        for b in "${!builds[@]}"; do
            echo "$i $b $("${builds[$b]}" -q --mode stacks -- ${work[$i]} 2>/dev/null | tail -1)" \
                >>"$out"
        done
    done
done
python3 - "$out" "${work[@]}" -- "${builds[@]}" <<'PY'
import statistics, sys
args = sys.argv[2:]
work, builds = args[:args.index("--")], args[args.index("--") + 1:]
runs = {}
for line in open(sys.argv[1]):
    i, b, s = line.split()
    runs.setdefault((int(i), b), []).append(float(s))
print("| workload | " + " | ".join(builds) + " |")
print("|---|" + "---|" * len(builds))
for i, w in enumerate(work):
    n = int(w.split()[1])
    native = statistics.median(runs[(i, "native")])
    cells = [f"{(statistics.median(runs[(i, str(b))]) - native) / n * 1e6:.2f} us"
             for b in range(len(builds))]
    name = " ".join(w.split()[:1] + w.split()[2:]).replace("target/fixtures/", "")
    print(f"| {name} | " + " | ".join(cells) + " |")
PY
rm -f "$out"
