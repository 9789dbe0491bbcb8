/* shbench (after MicroQuill's SmartHeap benchmark, as in Heapprof): each thread makes its share
 * of N random steps over an array of SLOTS blocks: a step frees the block in a random slot, if
 * any, and allocates a new one of 1 to 1000 bytes, whose ends it writes.
 * Heapprof made 2*10^6 steps in all; so does this.
 *
 *   shbench P [SCALE [SECONDS]]
 */
#include "bench.h"

#define N 2000000
#define SLOTS 4096
#define MAXSIZE 1000

static volatile uint64_t sink;

static void *worker(void *arg) {
    struct bench_thread *t = (struct bench_thread *)arg;
    long n = bench_part(t->b, t->id, N);
    uint64_t seed = bench_seed(t->id);
    char **slot = (char **)calloc(SLOTS, sizeof *slot);
    uint64_t sum = 0;
    for (long i = 0; i < n; i++) {
        uint64_t r = bench_rand(&seed);
        size_t k = r % SLOTS;
        size_t size = 1 + (size_t)((r >> 32) % MAXSIZE);
        if (slot[k]) {
            sum += (unsigned char)slot[k][0];
            free(slot[k]);
        }
        slot[k] = (char *)malloc(size);
        slot[k][0] = (char)i;
        slot[k][size - 1] = (char)k;
    }
    for (size_t k = 0; k < SLOTS; k++)
        free(slot[k]);
    free(slot);
    sink += sum;
    return NULL;
}

int main(int argc, char **argv) {
    struct bench b;
    bench_args(&b, "shbench", argc, argv);
    bench_start(&b);
    do
        bench_threads(&b, worker);
    while (bench_again(&b));
    bench_done(&b);
    return 0;
}
