/* What every benchmark workload shares: its command line, the optional stop for an attach, the
 * timer, the threads and the one summary line.
 *
 *   WORKLOAD P [SCALE [SECONDS]]
 *
 * P        threads. The total work does not depend on P: the threads share it.
 * SCALE    multiplies the work (default 1; `cargo xtask bench --quick` uses less).
 * SECONDS  repeat the whole workload until this many seconds have passed (default 0: once).
 *
 * With HEAPTRACE_BENCH_STOP set in the environment, the workload stops itself (SIGSTOP) just
 * before its timer starts, so a tracer can attach with `heaptrace -p PID` and then send SIGCONT.
 *
 * The only output is one line on stdout:
 *   bench: NAME P=.. scale=.. reps=.. elapsed=SECONDS cpu=SECONDS
 * elapsed is the monotonic time from the timer's start to the end (process start-up, an attach
 * and exit are left out); cpu is the process's user+system time over its whole life, from
 * getrusage, which includes the time the kernel spends in probes on its threads.
 */
#ifndef BENCH_H
#define BENCH_H

#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

#ifdef __cplusplus
extern "C" {
#endif

struct bench {
    const char *name;
    int threads;
    double scale;
    double seconds;
    long reps;
    double t0;
};

/* One thread's share of the work. */
struct bench_thread {
    struct bench *b;
    int id;
    pthread_t tid;
};

static inline double bench_now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

/* A per-thread deterministic generator (xorshift64*), so every run makes the same calls. */
static inline uint64_t bench_rand(uint64_t *s) {
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1DULL;
}

static inline uint64_t bench_seed(int id) {
    return 0x9E3779B97F4A7C15ULL * (uint64_t)(id + 1) ^ 0xD1B54A32D192ED03ULL;
}

/* Thread id's part of n * SCALE units of work: the parts add up to the same total at every P. */
static inline long bench_part(const struct bench *b, int id, double n) {
    double total = n * b->scale;
    return (long)(total * (id + 1) / b->threads) - (long)(total * id / b->threads);
}

static inline void bench_args(struct bench *b, const char *name, int argc, char **argv) {
    memset(b, 0, sizeof *b);
    b->name = name;
    b->threads = argc > 1 ? atoi(argv[1]) : 0;
    b->scale = argc > 2 ? atof(argv[2]) : 1.0;
    b->seconds = argc > 3 ? atof(argv[3]) : 0.0;
    if (b->threads < 1 || b->threads > 1024 || !(b->scale > 0) || b->seconds < 0) {
        fprintf(stderr, "usage: %s P [SCALE [SECONDS]]\n", name);
        exit(2);
    }
}

/* Stop for an attach if asked, then start the timer. */
static inline void bench_start(struct bench *b) {
    if (getenv("HEAPTRACE_BENCH_STOP"))
        raise(SIGSTOP);
    b->t0 = bench_now();
}

/* Run fn on P threads (also when P = 1, so every P has the same shape) and wait for them. */
static inline void bench_threads(struct bench *b, void *(*fn)(void *)) {
    struct bench_thread *t = (struct bench_thread *)calloc((size_t)b->threads, sizeof *t);
    if (!t)
        abort();
    for (int i = 0; i < b->threads; i++) {
        t[i].b = b;
        t[i].id = i;
        if (pthread_create(&t[i].tid, NULL, fn, &t[i]) != 0)
            abort();
    }
    for (int i = 0; i < b->threads; i++)
        pthread_join(t[i].tid, NULL);
    free(t);
}

/* Count a repetition; true while SECONDS have not passed yet. */
static inline int bench_again(struct bench *b) {
    b->reps++;
    return b->seconds > 0 && bench_now() - b->t0 < b->seconds;
}

static inline void bench_done(struct bench *b) {
    double elapsed = bench_now() - b->t0;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    double cpu = (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec / 1e6 +
                 (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec / 1e6;
    printf("bench: %s P=%d scale=%g reps=%ld elapsed=%.6f cpu=%.6f\n", b->name, b->threads,
           b->scale, b->reps, elapsed, cpu);
    fflush(stdout);
}

#ifdef __cplusplus
}
#endif

#endif
