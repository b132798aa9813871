// stream_read.c: this machine's read roofline, the bytes per second T threads can stream from memory.
// Each thread reads its own slice of a buffer much larger than the caches in 32-byte vectors (GCC's
// vector extension: one 256-bit load each with AVX2, two 128-bit ones without) folded into four XOR
// accumulators, so no arithmetic limits it; the figure is the best of PASSES passes over the whole
// buffer. The buffer is on huge pages where the system gives them (2 MiB-aligned, MADV_HUGEPAGE), as
// krafla's packed weights are (model/pack.c): on 4 KiB pages the same loop read 7% less at one thread
// (32.5 against 35 GB/s, 6 Dec), a roofline the engine then seemed to beat. Built and run by
// bench/compare.py --roofline:
//     gcc -O2 -march=native -pthread bench/stream_read.c -o stream_read && ./stream_read THREADS [MiB]
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "clock.h"

#define PASSES 10

typedef uint64_t lanes __attribute__((vector_size(32)));

typedef struct {
    const uint8_t *start;
    size_t bytes;
    uint64_t folded;              // kept so the loads are not optimised away
} slice;

static void *read_slice(void *arg) {
    slice *s = arg;
    lanes a = {0}, b = {0}, c = {0}, d = {0};
    for (size_t i = 0; i + 4 * sizeof(lanes) <= s->bytes; i += 4 * sizeof(lanes)) {
        const lanes *p = (const lanes *)(s->start + i);
        a ^= p[0];
        b ^= p[1];
        c ^= p[2];
        d ^= p[3];
    }
    const lanes all = a ^ b ^ c ^ d;
    s->folded = all[0] ^ all[1] ^ all[2] ^ all[3];
    return NULL;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    size_t mib = argc > 2 ? (size_t)atol(argv[2]) : 1024;
    if (threads < 1 || threads > 256 || mib < 64) {
        fprintf(stderr, "usage: %s THREADS [MiB >= 64]\n", argv[0]);
        return 2;
    }
    size_t bytes = mib << 20;
    const size_t huge_page = (size_t)2 << 20;
    uint8_t *buffer = aligned_alloc(huge_page, bytes);  // bytes: a multiple of 1 MiB, 64 or more of them
    if (!buffer) {
        fprintf(stderr, "cannot allocate %zu MiB\n", mib);
        return 1;
    }
    madvise(buffer, bytes - bytes % huge_page, MADV_HUGEPAGE);  // a hint: without it, 4 KiB pages
    for (size_t i = 0; i < bytes; i++) buffer[i] = (uint8_t)(i * 2654435761u >> 24);  // every page resident
    size_t per = (bytes / (size_t)threads) & ~(size_t)127;
    slice slices[256];
    pthread_t ids[256];
    double best = 1e30;
    uint64_t folded = 0;
    for (int pass = 0; pass < PASSES; pass++) {
        double start = now();
        for (int t = 0; t < threads; t++) {
            slices[t] = (slice){buffer + (size_t)t * per, per, 0};
            pthread_create(&ids[t], NULL, read_slice, &slices[t]);
        }
        for (int t = 0; t < threads; t++) {
            pthread_join(ids[t], NULL);
            folded ^= slices[t].folded;
        }
        double seconds = now() - start;
        if (seconds < best) best = seconds;
    }
    printf("{\"threads\": %d, \"bytes\": %zu, \"gb_per_s\": %.3f, \"check\": %llu}\n", threads, per * (size_t)threads,
           (double)(per * (size_t)threads) / best / 1e9, (unsigned long long)(folded & 1));
    free(buffer);
    return 0;
}
