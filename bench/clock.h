// clock.h: the monotonic clock in seconds, for the standalone C benchmarks of this folder
// (stream_read.c, cold_matmul.c, ab_generate.c, cold_attention.c), each built by one gcc command
// that finds this file beside it.
#ifndef KRAFLA_BENCH_CLOCK_H
#define KRAFLA_BENCH_CLOCK_H

#include <time.h>

static inline double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

#endif
