/* hash-table (as in Heapprof): each thread makes its share of N insertions into its own
 * chained hash table, under random keys; each entry carries an array of a random number of
 * ints (1 to MAXLEN), which the insertion fills. Inserting an existing key replaces (frees)
 * the old entry. Heapprof made 7*10^6 insertions; here N.
 *
 *   hash-table P [SCALE [SECONDS]]
 */
#include "bench.h"

#define N 1000000
#define KEYS (1 << 18)
#define MAXLEN 64

struct entry {
    struct entry *next;
    uint64_t key;
    uint32_t len;
    int32_t data[];
};

static volatile uint64_t sink;

static void *worker(void *arg) {
    struct bench_thread *t = (struct bench_thread *)arg;
    long n = bench_part(t->b, t->id, N);
    long part = bench_part(t->b, t->id, KEYS);
    uint64_t keys = part > 0 ? (uint64_t)part : 1;
    size_t buckets = 1;
    while (buckets < keys)
        buckets <<= 1;
    struct entry **table = (struct entry **)calloc(buckets, sizeof *table);
    uint64_t seed = bench_seed(t->id), sum = 0;
    for (long i = 0; i < n; i++) {
        uint64_t r = bench_rand(&seed);
        uint64_t key = r % keys;
        uint32_t len = 1 + (uint32_t)((r >> 40) % MAXLEN);
        struct entry *e = (struct entry *)malloc(sizeof *e + len * sizeof(int32_t));
        e->key = key;
        e->len = len;
        for (uint32_t j = 0; j < len; j++)
            e->data[j] = (int32_t)(i + j);
        struct entry **p = &table[(key * 0x9E3779B97F4A7C15ULL) >> 40 & (buckets - 1)];
        while (*p && (*p)->key != key)
            p = &(*p)->next;
        if (*p) {
            struct entry *old = *p;
            e->next = old->next;
            sum += (uint64_t)old->data[old->len - 1];
            free(old);
        } else {
            e->next = NULL;
        }
        *p = e;
    }
    for (size_t b = 0; b < buckets; b++)
        for (struct entry *e = table[b], *next; e; e = next) {
            next = e->next;
            free(e);
        }
    free(table);
    sink += sum;
    return NULL;
}

int main(int argc, char **argv) {
    struct bench b;
    bench_args(&b, "hash-table", argc, argv);
    bench_start(&b);
    do
        bench_threads(&b, worker);
    while (bench_again(&b));
    bench_done(&b);
    return 0;
}
