/* What heaptrace's syscall tracepoints cost every process on the host: ns per getppid and per
 * mmap+munmap of a page, in a loop. Not a traced program: run beside a trace (tests/bench/
 * syscalls.sh). */
#include <stdio.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

static double ns_since(struct timespec a) {
    struct timespec b;
    clock_gettime(CLOCK_MONOTONIC, &b);
    return (b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec);
}

int main(void) {
    const int n = 2000000;
    struct timespec a;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < n; i++)
        syscall(SYS_getppid);
    double g = ns_since(a) / n;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < n / 10; i++) {
        void *p = mmap(0, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        munmap(p, 4096);
    }
    double m = ns_since(a) / (n / 10);
    printf("%.0f %.0f\n", g, m);
    return 0;
}
