/* queue (as in Heapprof): each thread makes its share of N random steps on its own FIFO queue:
 * a step pushes a new node of 16 to 128 bytes (5 times in 8) or pops and frees the oldest (3
 * in 8). The queue grows to about N/4 nodes, which are freed at the end. Heapprof's queue
 * held up to 3*10^7 objects; here N steps in all.
 *
 *   queue P [SCALE [SECONDS]]
 */
#include "bench.h"

#define N 2400000
#define MINSIZE 16
#define MAXSIZE 128

struct node {
    struct node *next;
    uint64_t value;
};

static volatile uint64_t sink;

static void *worker(void *arg) {
    struct bench_thread *t = (struct bench_thread *)arg;
    long n = bench_part(t->b, t->id, N);
    uint64_t seed = bench_seed(t->id), sum = 0;
    struct node *head = NULL, *tail = NULL;
    for (long i = 0; i < n; i++) {
        uint64_t r = bench_rand(&seed);
        if (!head || (r & 7) < 5) {
            size_t size = MINSIZE + (size_t)((r >> 32) % (MAXSIZE - MINSIZE + 1));
            struct node *e = (struct node *)malloc(size);
            e->next = NULL;
            e->value = r;
            if (tail)
                tail->next = e;
            else
                head = e;
            tail = e;
        } else {
            struct node *e = head;
            head = e->next;
            if (!head)
                tail = NULL;
            sum += e->value;
            free(e);
        }
    }
    while (head) {
        struct node *e = head;
        head = e->next;
        free(e);
    }
    sink += sum;
    return NULL;
}

int main(int argc, char **argv) {
    struct bench b;
    bench_args(&b, "queue", argc, argv);
    bench_start(&b);
    do
        bench_threads(&b, worker);
    while (bench_again(&b));
    bench_done(&b);
    return 0;
}
