// ab_generate.c: generation speed of several builds of libkrafla, interleaved in one process, so a
// shared machine's moods fall on every build alike. Each library is loaded on its own (RTLD_LOCAL)
// with its own copy of the model, packed as `krafla bench` packs it; then for ROUNDS rounds each
// generates TOKENS tokens one step at a time from an empty cache (the order reversed every other
// round, after one warm-up round). Per build: the median tokens/s and its range, and the median of
// its per-round ratio to the first build. A round's builds run seconds apart, so the ratios say
// much more than separate `krafla bench` runs minutes apart (docs/kernels.md, "One token reads one
// stream"):
//     gcc -O2 bench/ab_generate.c -o ab_generate -ldl
//     ./ab_generate MODEL.mlb THREADS TOKENS ROUNDS build/avx512/libkrafla.so /tmp/other/avx512/libkrafla.so
// The library loaded second has come out up to 6% ahead of the same build loaded first (Gemma 3
// 270M, 7 Dec; 3.6 GB MoE copies too): run a comparison in both orders.
// TOKENS written DEPTH+TOKENS (2048+32) generates at a context of DEPTH instead: each session first
// evaluates DEPTH prompt tokens once, and each round truncates back to them before its steps, so
// attention over a long cache is timed without timing the prompt (llama-bench's -d).
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../engine_c/include/krafla.h"
#include "clock.h"
#include "dl.h"

#define MAX_BUILDS 16
#define MAX_ROUNDS 256

typedef struct {
    const char *path;
    kr_session *session;
    int (*eval)(kr_session *, const int32_t *, int32_t, float *, kr_error *);
    int (*truncate)(kr_session *, int32_t, kr_error *);
    double tokens_per_s[MAX_ROUNDS];
} build;

static int by_value(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// Open the model with the library at b->path, packed in memory, and a session for `tokens` steps.
static void load(build *b, const char *model, int threads, int tokens) {
    void *library = dlopen(b->path, RTLD_NOW | RTLD_LOCAL);
    if (!library) {
        fprintf(stderr, "%s\n", dlerror());
        exit(1);
    }
    kr_model *(*open)(const char *, int32_t, kr_error *) = symbol(library, b->path, "kr_model_open");
    int (*pack)(kr_model *, int32_t, const char *, kr_error *) = symbol(library, b->path, "kr_model_pack");
    kr_session *(*session_new)(kr_model *, int32_t, int32_t, int32_t, kr_error *) =
        symbol(library, b->path, "kr_session_new");
    b->eval = symbol(library, b->path, "kr_session_eval");
    b->truncate = symbol(library, b->path, "kr_session_truncate");
    kr_error err = {0};
    kr_model *m = open(model, threads, &err);
    if (!m || pack(m, KR_PACK_ON, NULL, &err) || !(b->session = session_new(m, tokens + 1, KR_KV_F32, 512, &err))) {
        fprintf(stderr, "%s: %s\n", b->path, err.message);
        exit(1);
    }
}

// Token i of the prompt or the reply: any valid ids will do, speed does not depend on them.
static int32_t token_at(int i) { return 100 + 7 * (i % 1000); }

// Seconds for `tokens` one-token steps after the first `depth` positions (evaluated once before:
// fill_prompt).
static double generate(build *b, int depth, int tokens, float *logits) {
    kr_error err = {0};
    if (b->truncate(b->session, depth, &err)) goto failed;
    double start = now();
    for (int t = 0; t < tokens; t++) {
        int32_t token = token_at(depth + t);
        if (b->eval(b->session, &token, 1, logits, &err)) goto failed;
    }
    return now() - start;
failed:
    fprintf(stderr, "%s: %s\n", b->path, err.message);
    exit(1);
}

// The session's first `depth` positions, in one call (steps of the session's batch).
static void fill_prompt(build *b, int depth, float *logits) {
    if (!depth) return;
    int32_t *prompt = malloc(sizeof(int32_t) * (size_t)depth);
    if (!prompt) {
        fprintf(stderr, "out of memory for a prompt of %d tokens\n", depth);
        exit(1);
    }
    kr_error err = {0};
    for (int i = 0; i < depth; i++) prompt[i] = token_at(i);
    if (b->eval(b->session, prompt, depth, logits, &err)) {
        fprintf(stderr, "%s: %s\n", b->path, err.message);
        exit(1);
    }
    free(prompt);
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s MODEL.mlb THREADS TOKENS ROUNDS LIBRARY...\n", argv[0]);
        return 2;
    }
    const char *model = argv[1], *plus = strchr(argv[3], '+');
    int threads = atoi(argv[2]), depth = plus ? atoi(argv[3]) : 0, tokens = atoi(plus ? plus + 1 : argv[3]);
    int rounds = atoi(argv[4]), n = argc - 5;
    if (threads < 1 || depth < 0 || tokens < 1 || rounds < 1 || rounds > MAX_ROUNDS || n > MAX_BUILDS) {
        fprintf(stderr, "threads, tokens >= 1, depth >= 0; 1 <= rounds <= %d; at most %d libraries\n", MAX_ROUNDS,
                MAX_BUILDS);
        return 2;
    }
    static build builds[MAX_BUILDS];
    float *logits = malloc(sizeof(float) * (1 << 20));  // more than any vocabulary
    for (int i = 0; i < n; i++) {
        builds[i].path = argv[5 + i];
        load(&builds[i], model, threads, depth + tokens);
        fill_prompt(&builds[i], depth, logits);
    }
    for (int round = -1; round < rounds; round++)  // round -1: the warm-up
        for (int k = 0; k < n; k++) {
            build *b = &builds[round % 2 ? n - 1 - k : k];
            double seconds = generate(b, depth, tokens, logits);
            if (round >= 0) b->tokens_per_s[round] = tokens / seconds;
        }
    for (int i = 0; i < n; i++) {
        double speed[MAX_ROUNDS], ratio[MAX_ROUNDS];
        for (int r = 0; r < rounds; r++) speed[r] = builds[i].tokens_per_s[r], ratio[r] = speed[r] / builds[0].tokens_per_s[r];
        qsort(speed, (size_t)rounds, sizeof *speed, by_value);
        qsort(ratio, (size_t)rounds, sizeof *ratio, by_value);
        printf("%s: %.2f t/s (%.2f-%.2f), %.3fx the first (%.3f-%.3f), -t %d, %d tokens after %d, %d rounds\n",
               builds[i].path, speed[rounds / 2], speed[0], speed[rounds - 1], ratio[rounds / 2], ratio[0],
               ratio[rounds - 1], threads, tokens, depth, rounds);
    }
    free(logits);
    return 0;
}
