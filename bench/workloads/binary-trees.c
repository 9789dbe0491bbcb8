/* binary-trees (the Benchmarks Game's, as in Heapprof): trees of depth 4, 6, .., MAXDEPTH built
 * node by node, checked and freed, plus a stretch tree and a long-lived tree. Each node is one
 * malloc from a recursive function that calls itself at two places, so every node's allocation
 * stack is a different path: at depth 15 there are 2^16 unique stacks, the worst case for a
 * stack-collecting tracer. Each thread builds its share of the trees of every depth.
 *
 *   binary-trees P [SCALE [SECONDS]]
 */
#include "bench.h"

#define MAXDEPTH 15
#define MINDEPTH 4
/* Trees per depth d: 2^(MAXDEPTH - d + MINDEPTH) * ITER_SCALE. */
#define ITER_SCALE 0.35

struct node {
    struct node *left, *right;
};

static volatile uint64_t sink;

__attribute__((noinline)) static struct node *bottom_up(int depth) {
    struct node *n = (struct node *)malloc(sizeof *n);
    if (depth > 0) {
        n->left = bottom_up(depth - 1);
        n->right = bottom_up(depth - 1);
    } else {
        n->left = n->right = NULL;
    }
    return n;
}

__attribute__((noinline)) static long check(const struct node *n) {
    return n->left ? 1 + check(n->left) + check(n->right) : 1;
}

__attribute__((noinline)) static void delete_tree(struct node *n) {
    if (n->left) {
        delete_tree(n->left);
        delete_tree(n->right);
    }
    free(n);
}

static void *worker(void *arg) {
    struct bench_thread *t = (struct bench_thread *)arg;
    long sum = 0;
    for (int d = MINDEPTH; d <= MAXDEPTH; d += 2) {
        long iters = bench_part(t->b, t->id, (double)(1L << (MAXDEPTH - d + MINDEPTH)) * ITER_SCALE);
        for (long i = 0; i < iters; i++) {
            struct node *tree = bottom_up(d);
            sum += check(tree);
            delete_tree(tree);
        }
    }
    sink += (uint64_t)sum;
    return NULL;
}

int main(int argc, char **argv) {
    struct bench b;
    bench_args(&b, "binary-trees", argc, argv);
    bench_start(&b);
    do {
        struct node *stretch = bottom_up(MAXDEPTH + 1);
        sink += (uint64_t)check(stretch);
        delete_tree(stretch);
        struct node *long_lived = bottom_up(MAXDEPTH);
        bench_threads(&b, worker);
        sink += (uint64_t)check(long_lived);
        delete_tree(long_lived);
    } while (bench_again(&b));
    bench_done(&b);
    return 0;
}
