/* Many distinct live stacks, then steady churn: the daemon's cost at scale.
 *
 *   livestacks STACKS SECONDS RATE
 *
 * Allocates one block from each of STACKS distinct call paths (a recursion of DEPTH levels
 * whose every level calls on from one of two call sites, chosen by a bit of the path's index)
 * and keeps it live. Then, for SECONDS, frees and reallocates RATE blocks a second, each
 * through its own path again, so every stack stays live and keeps being seen. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#define DEPTH 15 /* 2^15 paths >= any STACKS asked for */

static void *descend(unsigned path, int level);

__attribute__((noinline)) static void *left(unsigned path, int level) {
    void *p = descend(path, level + 1);
    __asm__ volatile("" ::: "memory"); /* no tail call: keep this frame on the stack */
    return p;
}

__attribute__((noinline)) static void *right(unsigned path, int level) {
    void *p = descend(path, level + 1);
    __asm__ volatile("" ::: "memory");
    return p;
}

__attribute__((noinline)) static void *descend(unsigned path, int level) {
    if (level == DEPTH)
        return malloc(16 + (path & 63));
    void *p = (path >> level) & 1 ? right(path, level) : left(path, level);
    __asm__ volatile("" ::: "memory");
    return p;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: livestacks STACKS SECONDS RATE\n");
        return 2;
    }
    unsigned stacks = (unsigned)atoi(argv[1]);
    double seconds = atof(argv[2]);
    long rate = atol(argv[3]);
    if (stacks == 0 || stacks > (1u << DEPTH) || rate <= 0)
        return 2;
    void **live = calloc(stacks, sizeof *live);
    /* One loop, so that every path's blocks come from one call site in main: the first pass
     * fills (free(NULL) does nothing), unthrottled; later ones churn in 10 ms steps of rate/100
     * blocks, walking the paths round robin. */
    long step = rate / 100 > 0 ? rate / 100 : 1;
    unsigned next = 0;
    long done = 0;
    double start = now(), tick = start;
    while (now() - start < seconds) {
        for (long k = 0; k < step; k++, done++) {
            free(live[next]);
            live[next] = descend(next, 0);
            next = (next + 1) % stacks;
        }
        if (done < stacks) {
            tick = now();
            continue;
        }
        tick += 0.01;
        double wait = tick - now();
        if (wait > 0)
            usleep((useconds_t)(wait * 1e6));
    }
    for (unsigned i = 0; i < stacks; i++)
        free(live[i]);
    free(live);
    return 0;
}
