/* threadtest (Hoard's, as in Heapprof): ROUNDS rounds; in each, every thread allocates its
 * share of NOBJECTS small objects, writes each, then frees them all.
 * Heapprof ran 1000 rounds of 3*10^4 objects; here ROUNDS rounds.
 *
 *   threadtest P [SCALE [SECONDS]]
 */
#include "bench.h"

#define NOBJECTS 30000
#define ROUNDS 70
#define OBJSIZE 8

static volatile uint64_t sink;

static void *worker(void *arg) {
    struct bench_thread *t = (struct bench_thread *)arg;
    /* SCALE scales the rounds; the objects are split among the threads. */
    long n = (long)NOBJECTS * (t->id + 1) / t->b->threads - (long)NOBJECTS * t->id / t->b->threads;
    long rounds = (long)(ROUNDS * t->b->scale);
    if (rounds < 1)
        rounds = 1;
    char **a = (char **)malloc((size_t)n * sizeof *a);
    uint64_t sum = 0;
    for (long r = 0; r < rounds; r++) {
        for (long i = 0; i < n; i++) {
            a[i] = (char *)malloc(OBJSIZE);
            memset(a[i], (int)i, OBJSIZE);
        }
        for (long i = 0; i < n; i++) {
            sum += (unsigned char)a[i][OBJSIZE - 1];
            free(a[i]);
        }
    }
    free(a);
    sink += sum;
    return NULL;
}

int main(int argc, char **argv) {
    struct bench b;
    bench_args(&b, "threadtest", argc, argv);
    bench_start(&b);
    do
        bench_threads(&b, worker);
    while (bench_again(&b));
    bench_done(&b);
    return 0;
}
