#!/usr/bin/env bash
# The daemon's own cost at scale: `heaptrace -q --no-tui --mode stacks` (1 round/s) launching
# tests/bench/livestacks.c, which keeps STACKS distinct stacks live, then frees and reallocates
# RATE blocks a second through the same paths for SECONDS. Reports heaptrace's CPU time
# (utime+stime of /proc/PID/stat, children excluded) as a percentage of one core over the steady
# state (from WARM seconds after attaching to 2 s before the workload's end), and its peak RSS
# (VmHWM) over the same span, and the kernel memory of its BPF maps (fdinfo's memlock, each map
# once). REPS runs, medians. Holds the tests' system-wide lock. Root needed.
# With TUI=KEY set, heaptrace runs with its live view on a 200x50 pseudo-terminal instead of
# --no-tui, KEY pressed first (1 timeline, 2 sites, ...), and is quit with q at the end.
#
#   [TUI=2] tests/bench/daemon.sh [REPS] [STACKS] [SECONDS] [RATE] [HEAPTRACE ARGS...]
set -euo pipefail
REPS=${1:-5}
STACKS=${2:-10000}
SECONDS_=${3:-30}
RATE=${4:-10000}
shift 4 || shift $#
[ -n "${HEAPTRACE:-}" ] || cargo build --release -q -p heaptrace
mkdir -p target/fixtures
gcc -O2 -g -fno-omit-frame-pointer -fno-builtin -o target/fixtures/livestacks tests/bench/livestacks.c
exec 9>/tmp/heaptrace-tests.lock
flock 9
python3 - "$REPS" "$STACKS" "$SECONDS_" "$RATE" "${HEAPTRACE:-target/release/heaptrace}" target/fixtures/livestacks "$@" <<'PY'
import fcntl, json, os, pty, statistics, struct, subprocess, sys, tempfile, termios, threading, time
reps, stacks, seconds, rate = map(int, sys.argv[1:5])
ht, work, extra = sys.argv[5], sys.argv[6], sys.argv[7:]
WARM = 6
tick = os.sysconf("SC_CLK_TCK")
tui = os.environ.get("TUI")

def cpu(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / tick  # utime, stime

def map_memory(pid):
    """The kernel memory of heaptrace's BPF maps (memlock of each map once, from fdinfo), MiB."""
    seen = {}
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            info = dict(l.split(":", 1) for l in open(f"/proc/{pid}/fdinfo/{fd}") if ":" in l)
        except OSError:
            continue
        if "map_id" in info and "memlock" in info:
            seen[info["map_id"].strip()] = int(info["memlock"])
    return sum(seen.values()) / (1 << 20)

def hwm(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024

pcts, rss, kmem, seen = [], [], [], []
for _ in range(reps):
    out = tempfile.NamedTemporaryFile(suffix=".json", delete=False).name
    args = [ht, "-q", "--mode", "stacks", "--force", "--json", out, *extra,
            "--", work, str(stacks), str(seconds), str(rate)]
    if tui:
        pid, fd = pty.fork()
        if pid == 0:
            os.execv(ht, args)
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 200, 0, 0))
        def read_all():
            try:
                while os.read(fd, 65536):
                    pass
            except OSError:
                pass
        drain = threading.Thread(target=read_all, daemon=True)
        drain.start()
        time.sleep(3)  # no "attached" line on a live view: loading and attaching take < 1 s
        os.write(fd, tui.encode())
        time.sleep(WARM - 3)
    else:
        p = subprocess.Popen(args[:2] + ["--no-tui"] + args[2:],
                             stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        pid = p.pid
        err = []
        for line in p.stderr:
            err.append(line)
            if "attached" in line:
                break
        drain = threading.Thread(target=lambda: err.extend(p.stderr), daemon=True)
        drain.start()
        time.sleep(WARM)
    c0, w0 = cpu(pid), time.monotonic()
    time.sleep(max(1, seconds - WARM - 2))
    c1, w1 = cpu(pid), time.monotonic()
    peak = hwm(pid)
    kmem.append(map_memory(pid))
    if tui:
        time.sleep(3)  # the workload ends; the view stays up until quit
        os.write(fd, b"q")
        os.waitpid(pid, 0)
    else:
        p.wait()
        drain.join()
    doc = json.load(open(out))
    os.unlink(out)
    pcts.append(100 * (c1 - c0) / (w1 - w0))
    rss.append(peak)
    seen.append((len(doc.get("stacks", [])), doc["lost"]))
med = statistics.median
view = f"live view, screen {tui}" if tui else "--no-tui"
print(f"{stacks} live stacks, {rate} frees+mallocs/s, {seconds} s, {view}, {reps} runs (medians):")
print(f"daemon CPU {med(pcts):.2f}% of one core over the steady state; peak RSS {med(rss):.1f} MiB")
print("CPU %:", " ".join(f"{x:.2f}" for x in pcts))
print("peak RSS MiB:", " ".join(f"{x:.1f}" for x in rss))
print(f"kernel memory of its maps (memlock): {med(kmem):.1f} MiB")
print("stacks in the JSON, losses:", seen[-1][0], {k: v for k, v in seen[-1][1].items() if v})
PY
