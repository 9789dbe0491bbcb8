/* tests/bench/unwind.sh: N malloc(64)+free pairs, each malloc 5 frames deep (d4 <- d3 <- d2 <-
 * d1 <- main, then libc's start), built with or without frame pointers. Prints the loop's own
 * time in seconds, as pairs.c does.
 *
 *   deeppairs N */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static void *volatile sink;

#define LEVEL(name, next)                                                                     \
    __attribute__((noinline)) static void name(void) {                                     \
        next();                                                                              \
        __asm__ volatile("" ::: "memory");                                                   \
    }

__attribute__((noinline)) static void d4(void) {
    sink = malloc(64);
    free(sink);
    __asm__ volatile("" ::: "memory");
}
LEVEL(d3, d4)
LEVEL(d2, d3)
LEVEL(d1, d2)

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n; i++)
        d1();
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("%.6f\n", (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9);
    return 0;
}
