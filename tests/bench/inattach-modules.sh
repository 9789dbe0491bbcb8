#!/usr/bin/env bash
# The attach of `heaptrace -p PID --in-process` (stop to let go, as heaptrace says it) and its
# detach (the GOT written back) on a process with MODULES shared libraries of its own loaded
# and THREADS threads in malloc and free all the time; REPS attaches, one after another.
# Root.
#
#   tests/bench/inattach-modules.sh [REPS] [MODULES] [THREADS]   (from the repository root)
set -euo pipefail
REPS=${1:-5}
MODULES=${2:-50}
THREADS=${3:-16}
cargo build --release -q -p heaptrace
ht=target/release/heaptrace
dir=target/fixtures/inattach-modules
rm -rf "$dir" && mkdir -p "$dir"
for i in $(seq 1 "$MODULES"); do
    printf '#include <stdlib.h>\nvoid *m%d(size_t n) { return malloc(n + %d); }\n' "$i" "$i" \
        >"$dir/m$i.c"
    gcc -O1 -shared -fPIC -o "$dir/libm$i.so" "$dir/m$i.c"
done
calls=$(for i in $(seq 1 "$MODULES"); do printf 'free(m%d(16)); ' "$i"; done)
decls=$(for i in $(seq 1 "$MODULES"); do printf 'void *m%d(size_t);\n' "$i"; done)
cat >"$dir/main.c" <<C
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
$decls
static void *work(void *a) {
    for (;;) { $calls }
    return a;
}
int main(int argc, char **argv) {
    int n = atoi(argv[1]);
    pthread_t t;
    for (int i = 1; i < n; i++) pthread_create(&t, NULL, work, NULL);
    printf("ready\n");
    fflush(stdout);
    char c;
    while (read(0, &c, 1) > 0) {
    }
    return 0;
}
C
gcc -O1 -pthread -o "$dir/main" "$dir/main.c" -L"$dir" $(for i in $(seq 1 "$MODULES"); do
    printf -- '-lm%d ' "$i"; done) -Wl,-rpath,"$(realpath "$dir")"
# Its stdin a fifo this script holds open: it ends when the script does.
mkfifo "$dir/in"
"$dir/main" "$THREADS" <"$dir/in" >"$dir/out" &
target=$!
exec 3>"$dir/in"
until grep -q ready "$dir/out"; do sleep 0.05; done
echo "load average: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "modules mapped: $(grep -c '\.so' /proc/$target/maps | tr -d ' ') lines of .so mappings," \
    "threads: $(ls /proc/$target/task | wc -l)"
for r in $(seq 1 "$REPS"); do
    log="$dir/run$r.log"
    : >"$log"
    "$ht" -q --no-tui --in-process --mode stacks -p "$target" 2>"$log" >/dev/null &
    h=$!
    until grep -q attached "$log"; do sleep 0.01; done
    sleep 0.5
    kill -INT $h
    wait $h || true
    echo "run $r: $(grep -o 'loaded in [0-9.]* ms, [0-9]* GOT entries redirected' "$log");" \
        "$(grep -o 'written back in [0-9.]* ms' "$log")"
done
