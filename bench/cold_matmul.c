// cold_matmul.c: how fast a one-token packed matmul streams its weights from memory, as generation
// does: each of T threads (1 by default) multiplies one token by its own distinct (rows, cols)
// matrices of a weight type, one after the other, over far more bytes than the caches hold (1 GiB
// in all by default, on huge pages as the engine's packed copy is), and gives the weight bytes per
// second of the best of 6 passes. Compare it with bench/stream_read.c's plain read of the same
// memory (`stream_read T`); beside a model's generation at T threads, the difference is what the
// engine's steps lose between matmuls (their joins and serial work). A total of a few
// MiB keeps the matrices in L3 instead: the tile's speed without memory stalls (bench/kernels.py
// measures that too). It calls the engine's internal kernels (kernels.h), which the library
// exports:
//     make build/avx512/libkrafla.so
//     gcc -O2 -D_GNU_SOURCE -Iengine_c/include -Iengine_c/src bench/cold_matmul.c -Lbuild/avx512 -lkrafla
//         -Wl,-rpath,$PWD/build/avx512 -o cold_matmul          (one command)
//     ./cold_matmul TYPE ROWS COLS [MiB [THREADS]]    # TYPE a kr_type number: 4 q4_0, 10 q4_K, 12 q6_K (krafla.h)
// The weights are arbitrary bytes: the kernels' speed does not depend on the values, but for one
// thing: mxfp4's E8M0 scales taken as they come span 2^-127 to 2^128, and the float steps of the tiny
// ones run into denormals, which the CPU computes in microcode (4.3 GB/s from L3 where iq4_nl gives
// 28, 7 Dec). They are set near 2^0, as a model's are.
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "clock.h"
#include "kernels/kernels.h"
#include "kernels/legacy.h"

#define PASSES 6

typedef struct {
    int32_t type;
    int64_t rows, cols;
    const char *weights;  // `count` matrices of `matrix` bytes
    size_t matrix;
    int count;
    const void *prepared;
    float *out;
} share;

static void *multiply(void *arg) {
    const share *s = arg;
    for (int i = 0; i < s->count; i++)
        kr_matmul_packed(s->type, s->weights + (size_t)i * s->matrix, s->rows, s->cols, s->prepared, 1, s->out, s->rows, 0,
                         s->rows);
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s TYPE ROWS COLS [MiB [THREADS]]\n", argv[0]);
        return 2;
    }
    const int32_t type = atoi(argv[1]);
    const int64_t rows = atol(argv[2]), cols = atol(argv[3]), mib = argc > 4 ? atol(argv[4]) : 1024;
    const int threads = argc > 5 ? atoi(argv[5]) : 1;
    if (!kr_weight_type_supported(type) || rows < 8 || cols < 256 || cols % 256 || mib < 1 || threads < 1 || threads > 64) {
        fprintf(stderr, "a packable kr_type, rows >= 8 and cols a multiple of 256, MiB >= 1, 1 to 64 threads\n");
        return 2;
    }
    const size_t matrix = kr_weight_row_bytes(type, cols) * (size_t)rows, huge_page = (size_t)2 << 20;
    const int per_thread = (size_t)mib << 20 > matrix * (size_t)threads ? (int)(((size_t)mib << 20) / matrix / (size_t)threads) : 1;
    const int count = per_thread * threads;
    const size_t bytes = (matrix * (size_t)count + huge_page - 1) / huge_page * huge_page;
    char *weights = aligned_alloc(huge_page, bytes);
    float *x = malloc(sizeof(float) * (size_t)cols), *out = malloc(sizeof(float) * (size_t)rows * (size_t)threads);
    void *prepared = aligned_alloc(64, (kr_activation_bytes(type, 1, cols) + 63) / 64 * 64);
    if (!weights || !x || !out || !prepared) {
        fprintf(stderr, "out of memory\n");
        return 1;
    }
    madvise(weights, bytes, MADV_HUGEPAGE);
    for (size_t i = 0; i < bytes; i++) weights[i] = (char)(i * 2654435761u >> 24);  // every page resident
    if (type == KR_MXFP4)  // each group block's 8 E8M0 scales near 2^0, not 2^-127..2^128 (below)
        for (size_t block = 0; block + 8 <= (size_t)count * matrix; block += kr_legacy_group_block_bytes(type))
            for (int r = 0; r < 8; r++) weights[block + (size_t)r] = (char)(120 + (block / 8 + (size_t)r) % 16);
    for (int64_t i = 0; i < cols; i++) x[i] = 0.1f * (float)(i % 7 - 3);
    kr_prepare_activations(type, x, cols, prepared, 0, 1);
    double best = 1e30;
    for (int pass = 0; pass < PASSES; pass++) {
        share shares[64];
        pthread_t ids[64];
        double start = now();
        for (int t = 0; t < threads; t++) {
            shares[t] = (share){type, rows, cols, weights + (size_t)t * (size_t)per_thread * matrix, matrix, per_thread,
                                prepared, out + (size_t)t * (size_t)rows};
            if (t) pthread_create(&ids[t], NULL, multiply, &shares[t]);
        }
        multiply(&shares[0]);
        for (int t = 1; t < threads; t++) pthread_join(ids[t], NULL);
        double seconds = now() - start;
        if (seconds < best) best = seconds;
    }
    printf("%s %lldx%lld, %d matrices (%.0f MiB), %d thread%s: %.2f GB/s\n", kr_type_name(type), (long long)rows,
           (long long)cols, count, (double)(matrix * (size_t)count) / (1 << 20), threads, threads > 1 ? "s" : "",
           (double)(matrix * (size_t)count) / best / 1e9);
    free(weights), free(x), free(out), free(prepared);
    return 0;
}
