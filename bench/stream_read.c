// stream_read.c: this machine's read roofline, the bytes per second T threads can stream from memory.
// Each thread reads its own slice of a buffer much larger than the caches with 256-bit loads (SSE2
// 128-bit without AVX2) folded into four XOR accumulators, so no arithmetic limits it; the figure is
// the best of PASSES passes over the whole buffer. Built and run by bench/compare.py --roofline:
//     gcc -O2 -march=native -pthread bench/stream_read.c -o stream_read && ./stream_read THREADS [MiB]
#include <immintrin.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define PASSES 10

typedef struct {
    const uint8_t *start;
    size_t bytes;
    uint64_t folded;              // kept so the loads are not optimised away
} slice;

static void *read_slice(void *arg) {
    slice *s = arg;
#ifdef __AVX2__
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    for (size_t i = 0; i + 128 <= s->bytes; i += 128) {
        const __m256i *p = (const __m256i *)(s->start + i);
        a = _mm256_xor_si256(a, _mm256_load_si256(p));
        b = _mm256_xor_si256(b, _mm256_load_si256(p + 1));
        c = _mm256_xor_si256(c, _mm256_load_si256(p + 2));
        d = _mm256_xor_si256(d, _mm256_load_si256(p + 3));
    }
    __m256i all = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
    s->folded = (uint64_t)_mm256_extract_epi64(all, 0) ^ (uint64_t)_mm256_extract_epi64(all, 3);
#else
    __m128i a = _mm_setzero_si128(), b = a, c = a, d = a;
    for (size_t i = 0; i + 64 <= s->bytes; i += 64) {
        const __m128i *p = (const __m128i *)(s->start + i);
        a = _mm_xor_si128(a, _mm_load_si128(p));
        b = _mm_xor_si128(b, _mm_load_si128(p + 1));
        c = _mm_xor_si128(c, _mm_load_si128(p + 2));
        d = _mm_xor_si128(d, _mm_load_si128(p + 3));
    }
    __m128i all = _mm_xor_si128(_mm_xor_si128(a, b), _mm_xor_si128(c, d));
    s->folded = (uint64_t)_mm_cvtsi128_si64(all);
#endif
    return NULL;
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    size_t mib = argc > 2 ? (size_t)atol(argv[2]) : 1024;
    if (threads < 1 || threads > 256 || mib < 64) {
        fprintf(stderr, "usage: %s THREADS [MiB >= 64]\n", argv[0]);
        return 2;
    }
    size_t bytes = mib << 20;
    uint8_t *buffer = aligned_alloc(4096, bytes);
    if (!buffer) {
        fprintf(stderr, "cannot allocate %zu MiB\n", mib);
        return 1;
    }
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
