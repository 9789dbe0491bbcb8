/* tests/bench/deepstack.sh: N malloc(64)+free pairs, each DEPTH calls deep (one recursive
 * function whose frames hold PAD bytes each, so that the stack spans DEPTH * (PAD + ~48) bytes),
 * built with or without frame pointers. Prints the loop's own time in seconds, as pairs.c does.
 *
 *   deepspread N DEPTH PAD */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
static void *volatile sink;
static int depth, frame;
__attribute__((noinline)) static void level(int d) {
    volatile char pad[frame > 0 ? frame : 1]; /* a frame of PAD bytes on the stack */
    pad[0] = (char)d;
    if (d == 0) { sink = malloc(64); free(sink); }
    else level(d - 1);
    __asm__ volatile("" : : "r"(pad) : "memory");
}
int main(int argc, char **argv) {
    long n = atol(argv[1]); depth = atoi(argv[2]); frame = atoi(argv[3]);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < n; i++) level(depth);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    printf("%.6f\n", (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9);
    return 0;
}
