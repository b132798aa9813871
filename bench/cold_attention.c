// cold_attention.c: the attention kernels of several builds of libkrafla on one generation step's
// shape, interleaved in one process: for each of HEADS KV heads (a model's layers times its KV
// heads, each with its own DEPTH key and value rows, together larger than the last-level cache, so
// each head's rows come from memory as in a generation step), QUERIES queries' scores, softmax and
// weighted sum of values, through the test entry points of krafla.h. Per build: the median
// microseconds per head over ROUNDS rounds (and of the scores' and the softmax's parts), the bytes
// of keys and values read per second, and whether its outputs equal the first build's bit for bit.
//     gcc -O2 bench/cold_attention.c -o cold_attention -ldl
//     ./cold_attention f32 128 2048 6 56 20 build/avx512/libkrafla.so /tmp/other/avx512/libkrafla.so
// (TYPE HEAD_DIM DEPTH QUERIES HEADS ROUNDS: Qwen2.5-Coder-1.5B has 28 layers x 2 KV heads, 6
// queries per KV head, head_dim 128.)
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../engine_c/include/krafla.h"
#include "clock.h"
#include "dl.h"

#define MAX_BUILDS 8
#define MAX_ROUNDS 256
#define MAX_QUERIES 64

typedef int (*scores_fn)(int, int32_t, const void *, int64_t, int64_t, int64_t, const float *, int64_t,
                         const int32_t *, float *, kr_error *);
typedef int (*softmax_fn)(int, float *, int64_t, float, float, kr_error *);
typedef int (*values_fn)(int, int32_t, const void *, int64_t, int64_t, int64_t, const float *, int64_t,
                         const int32_t *, const int32_t *, float *, kr_error *);

typedef struct {
    const char *path;
    scores_fn scores;
    softmax_fn softmax;
    values_fn values;
    double seconds[MAX_ROUNDS], scores_seconds[MAX_ROUNDS], softmax_seconds[MAX_ROUNDS];  // a round, two parts
    float *out;  // the last head's outputs (QUERIES, head_dim)
} build;

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static float uniform(uint64_t *state) {
    *state = *state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)(*state >> 40) / (float)(1 << 24) - 0.5f;
}

// One round: every head's attention for `queries` queries at positions depth - queries .. depth - 1
// (a generation step's queries all sit at the last position; a group of query heads shares it).
static double round_of(build *b, int32_t type, int head_dim, const uint8_t *keys, const uint8_t *values,
                       size_t row_bytes, int heads, int depth, int queries, const float *q, float *scores,
                       double *scores_seconds, double *softmax_seconds) {
    int32_t begin[MAX_QUERIES], end[MAX_QUERIES];
    for (int i = 0; i < queries; i++) begin[i] = 0, end[i] = depth;
    size_t head_bytes = (size_t)depth * row_bytes;
    kr_error err = {0};
    double start = now();
    *scores_seconds = *softmax_seconds = 0;
    for (int h = 0; h < heads; h++) {
        const uint8_t *k = keys + (size_t)h * head_bytes, *v = values + (size_t)h * head_bytes;
        double scores_start = now();
        if (b->scores(0, type, k, (int64_t)row_bytes, depth, head_dim, q, queries, end, scores, &err)) goto failed;
        double softmax_start = now();
        *scores_seconds += softmax_start - scores_start;
        for (int i = 0; i < queries; i++)
            if (b->softmax(0, scores + (size_t)i * (size_t)depth, depth, 0.088f, 0.0f, &err)) goto failed;
        *softmax_seconds += now() - softmax_start;
        if (b->values(0, type, v, (int64_t)row_bytes, depth, head_dim, scores, queries, begin, end, b->out, &err))
            goto failed;
    }
    return now() - start;
failed:
    fprintf(stderr, "%s: %s\n", b->path, err.message);
    exit(1);
}

int main(int argc, char **argv) {
    if (argc < 8) {
        fprintf(stderr, "usage: %s f32|f16 HEAD_DIM DEPTH QUERIES HEADS ROUNDS LIBRARY...\n", argv[0]);
        return 2;
    }
    int32_t type = strcmp(argv[1], "f16") == 0 ? KR_F16 : KR_F32;
    int head_dim = atoi(argv[2]), depth = atoi(argv[3]), queries = atoi(argv[4]), heads = atoi(argv[5]);
    int rounds = atoi(argv[6]), n_builds = argc - 7;
    if (head_dim < 1 || head_dim > 1024 || depth < 1 || queries < 1 || queries > MAX_QUERIES || heads < 1 ||
        rounds < 1 || rounds > MAX_ROUNDS || n_builds > MAX_BUILDS) {
        fprintf(stderr, "HEAD_DIM 1-1024, DEPTH >= 1, QUERIES 1-%d, HEADS >= 1, ROUNDS 1-%d, at most %d libraries\n",
                MAX_QUERIES, MAX_ROUNDS, MAX_BUILDS);
        return 2;
    }
    size_t row_bytes = (size_t)head_dim * (type == KR_F16 ? 2 : 4), bytes = (size_t)heads * (size_t)depth * row_bytes;
    uint8_t *keys = malloc(bytes), *values = malloc(bytes);
    float *q = malloc(sizeof(float) * (size_t)queries * (size_t)head_dim);
    float *scores = malloc(sizeof(float) * (size_t)queries * (size_t)depth);
    if (!keys || !values || !q || !scores) return 1;
    uint64_t state = 1;
    for (size_t i = 0; i < (size_t)queries * (size_t)head_dim; i++) q[i] = uniform(&state);
    size_t n_values = bytes / (type == KR_F16 ? 2 : 4);
    for (size_t i = 0; i < n_values; i++) {  // f16 rows: small values' bit patterns, whatever they are
        if (type == KR_F16) {
            ((uint16_t *)keys)[i] = (uint16_t)(0x3000 + (uint16_t)(uniform(&state) * 4096.0f));
            ((uint16_t *)values)[i] = (uint16_t)(0x3000 + (uint16_t)(uniform(&state) * 4096.0f));
        } else {
            ((float *)keys)[i] = uniform(&state);
            ((float *)values)[i] = uniform(&state);
        }
    }
    build builds[MAX_BUILDS] = {0};
    for (int i = 0; i < n_builds; i++) {
        build *b = &builds[i];
        b->path = argv[7 + i];
        void *library = dlopen(b->path, RTLD_NOW | RTLD_LOCAL);
        if (!library) {
            fprintf(stderr, "%s\n", dlerror());
            return 1;
        }
        b->scores = (scores_fn)symbol(library, b->path, "kr_test_attend_scores");
        b->softmax = (softmax_fn)symbol(library, b->path, "kr_test_attention_softmax");
        b->values = (values_fn)symbol(library, b->path, "kr_test_attend_values");
        if (!(b->out = malloc(sizeof(float) * (size_t)queries * (size_t)head_dim))) return 1;
    }
    for (int i = 0; i < n_builds; i++)  // a warm-up round each
        round_of(&builds[i], type, head_dim, keys, values, row_bytes, heads, depth, queries, q, scores,
                 builds[i].scores_seconds, builds[i].softmax_seconds);
    for (int r = 0; r < rounds; r++)
        for (int k = 0; k < n_builds; k++) {
            build *b = &builds[r % 2 ? n_builds - 1 - k : k];
            b->seconds[r] = round_of(b, type, head_dim, keys, values, row_bytes, heads, depth, queries, q, scores,
                                     &b->scores_seconds[r], &b->softmax_seconds[r]);
        }
    for (int i = 0; i < n_builds; i++) {
        build *b = &builds[i];
        qsort(b->seconds, (size_t)rounds, sizeof(double), by_value);
        qsort(b->scores_seconds, (size_t)rounds, sizeof(double), by_value);
        qsort(b->softmax_seconds, (size_t)rounds, sizeof(double), by_value);
        double median = b->seconds[rounds / 2] / heads, scores_median = b->scores_seconds[rounds / 2] / heads;
        double softmax_median = b->softmax_seconds[rounds / 2] / heads;
        int same = memcmp(b->out, builds[0].out, sizeof(float) * (size_t)queries * (size_t)head_dim) == 0;
        printf("%s: %.1f us per head (%.1f-%.1f; scores %.1f, softmax %.1f), keys and values %.1f GB/s, outputs %s the "
               "first build's\n", b->path, 1e6 * median, 1e6 * b->seconds[0] / heads, 1e6 * b->seconds[rounds - 1] / heads,
               1e6 * scores_median, 1e6 * softmax_median,
               2.0 * (double)depth * (double)row_bytes / median / 1e9, same ? "equal" : "DIFFER from");
    }
    return 0;
}
