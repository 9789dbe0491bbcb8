/* A child's own speed (tests/bench/forkcost.sh): forkpairs N forks a child that times its N
 * malloc+free pairs of 64 bytes and prints the seconds; the parent waits for it. With
 * FORKPAIRS_WAIT set it prints "ready" and reads a byte from stdin before it forks. */
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void *volatile sink;

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 1000000;
    if (getenv("FORKPAIRS_WAIT")) { /* for a trace to attach with -p first */
        char b;
        printf("ready\n");
        fflush(stdout);
        if (read(0, &b, 1) != 1)
            return 2;
    }
    pid_t child = fork();
    if (child == 0) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        for (long i = 0; i < n; i++) {
            sink = malloc(64);
            free(sink);
        }
        clock_gettime(CLOCK_MONOTONIC, &b);
        printf("%.3f\n", (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9);
        fflush(stdout);
        _exit(0);
    }
    int status;
    return waitpid(child, &status, 0) == child && WIFEXITED(status) ? WEXITSTATUS(status) : 1;
}
