#!/usr/bin/env bash
# Cost per malloc+free pair once attached: Hoard's threadtest (P = 1, 30,000 live blocks a
# round, ROUNDS rounds) started and held before its work, attached to with `heaptrace -q -p`
# (kernel path), `heaptrace -q -p --in-process`, in counts and stacks modes, and Debian's
# `heaptrack -p` (gdb injects its library; it records stacks), then let go; REPS interleaved
# rounds against native runs, by the program's own timer. Also the attach time of
# --in-process as heaptrace says it (stop to let go). Root.
#
#   tests/bench/inattach.sh [REPS] [ROUNDS]      (from the repository root)
set -euo pipefail
REPS=${1:-3}
ROUNDS=${2:-100}
. tests/bench/pairs-setup.sh
tt=target/fixtures/threadtest-held
cat >target/fixtures/held.c <<'C'
#include <stdio.h>
#include <unistd.h>
int tt_main(int, char **);
int main(int argc, char **argv) {
    char c;
    printf("ready\n");
    fflush(stdout);
    if (read(0, &c, 1) != 1) return 1;
    return tt_main(argc, argv);
}
C
gcc -O2 -g -fno-omit-frame-pointer -pthread -Dmain=tt_main -c -o target/fixtures/tt.o \
    bench/workloads/threadtest.c
gcc -O2 -pthread -o "$tt" target/fixtures/held.c target/fixtures/tt.o
scale=$(python3 -c "print(($ROUNDS + 0.5) / 70)")
python3 - "$REPS" "$ht" "$tt" "$scale" "$((30000 * ROUNDS))" <<'PY'
import os, signal, statistics, subprocess, sys, time, re
reps, ht, tt, scale, pairs = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
def run(flags):
    t = subprocess.Popen([tt, "1", scale], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    assert t.stdout.readline() == "ready\n"
    h, took = None, None
    if flags == "heaptrack":
        h = subprocess.Popen(["heaptrack", "-o", f"/tmp/inattach-heaptrack-{t.pid}", "-p",
                              str(t.pid)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             text=True)
        for line in h.stdout:
            if "injection finished" in line:
                break
        t.stdin.write("g"); t.stdin.flush()
        out = t.communicate()[0]
        h.communicate()
        for f in os.listdir("/tmp"):
            if f.startswith(f"inattach-heaptrack-{t.pid}"):
                os.remove(os.path.join("/tmp", f))
        return float(re.search(r"elapsed=([0-9.]+)", out).group(1)), None
    if flags is not None:
        h = subprocess.Popen([ht, "-q", "--no-tui", *flags, "-p", str(t.pid)],
                             stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        for line in h.stderr:
            if "attached" in line:
                m = re.search(r"loaded in ([0-9.]+) ms", line)
                took = float(m.group(1)) if m else None
                break
    t.stdin.write("g"); t.stdin.flush()
    out = t.communicate()[0]
    if h:
        h.send_signal(signal.SIGINT); h.communicate()
    return float(re.search(r"elapsed=([0-9.]+)", out).group(1)), took
ways = {"native": None, "kernel counts": ["--mode", "counts"], "kernel stacks": ["--mode", "stacks"],
        "in-process counts": ["--in-process", "--mode", "counts"],
        "in-process stacks": ["--in-process", "--mode", "stacks"],
        "heaptrack -p (stacks)": "heaptrack"}
runs, attach = {k: [] for k in ways}, []
for _ in range(reps):
    for k, f in ways.items():
        s, took = run(f)
        runs[k].append(s)
        if took is not None: attach.append(took)
nat = min(runs["native"])
print(f"threadtest P=1, {pairs} pairs, {reps} rounds; native best {nat:.3f} s")
print("| attached with | added per pair, best | median |")
print("|---|---|---|")
for k in ways:
    if k == "native": continue
    best = (min(runs[k]) - nat) / pairs * 1e6
    med = (statistics.median(runs[k]) - statistics.median(runs["native"])) / pairs * 1e6
    print(f"| {k} | {best:.3f} us | {med:.3f} us |")
print("in-process attach (stop to let go), ms:", " ".join(f"{a:.1f}" for a in attach))
for k, v in runs.items(): print(" ", k, " ".join(f"{x:.3f}" for x in v))
PY
