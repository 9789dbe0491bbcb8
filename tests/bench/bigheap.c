/* 10,000,000 live blocks of 100 bytes (1 GB of requests), then waits. */
#include <stdlib.h>
#include <unistd.h>
static void *volatile sink;
int main(void) {
    for (long i = 0; i < 10000000; i++)
        sink = malloc(100);
    write(1, "ready\n", 6);
    pause();
}
