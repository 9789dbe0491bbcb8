/* linux-scalability (Lever & Boreham): each thread makes its share of N malloc(32) calls,
 * keeping every block, then frees them all. Heapprof made 10^7 per thread; here N in all,
 * split among the threads.
 *
 *   linux-scalability P [SCALE [SECONDS]]
 */
#include "bench.h"

#define N 2000000
#define SIZE 32

static volatile uint64_t sink;

static void *worker(void *arg) {
    struct bench_thread *t = (struct bench_thread *)arg;
    long n = bench_part(t->b, t->id, N);
    char **a = (char **)malloc((size_t)n * sizeof *a);
    uint64_t sum = 0;
    for (long i = 0; i < n; i++) {
        a[i] = (char *)malloc(SIZE);
        a[i][0] = (char)i;
    }
    for (long i = 0; i < n; i++) {
        sum += (unsigned char)a[i][0];
        free(a[i]);
    }
    free(a);
    sink += sum;
    return NULL;
}

int main(int argc, char **argv) {
    struct bench b;
    bench_args(&b, "linux-scalability", argc, argv);
    bench_start(&b);
    do
        bench_threads(&b, worker);
    while (bench_again(&b));
    bench_done(&b);
    return 0;
}
