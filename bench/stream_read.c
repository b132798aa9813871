// stream_read.c: this machine's read roofline, the bytes per second T threads can stream from memory.
// Each thread reads its own slice of a buffer much larger than the caches in 32-byte vectors (GCC's
// vector extension: one 256-bit load each with AVX2, two 128-bit ones without) folded into four XOR
// accumulators, so no arithmetic limits it; the figure is the best of PASSES passes over the whole
// buffer. The buffer is on huge pages where the system gives them (2 MiB-aligned, MADV_HUGEPAGE), as
// krafla's packed weights are (model/pack.c): on 4 KiB pages the same loop read 7% less at one thread
// (32.5 against 35 GB/s, 6 Dec), a roofline the engine then seemed to beat. Built and run by
// bench/compare.py --roofline:
//     gcc -O2 -march=native -pthread bench/stream_read.c -o stream_read && ./stream_read THREADS [MiB [WORK [BITS]]]
// Built without -march=native (or any AVX flag) the loop is SSE2 and reads about a tenth less.
//
// The same read has two loops on x86-64 with AVX2, run in turns, and the roofline is the faster:
// the compiler's (a pointer that steps through the slice: `vpxor (ptr)`) and one in assembly whose
// loads are all `vpxor (base,index)` (indexed_read.h). The loads, the xors and the bytes are the same, but on the
// Intel Xeon of 7 Dec the indexed form streamed 17-18 GB/s at one thread and 33-35 at two, where the
// compiler's read 14-15 and 28-29 (docs/kernels.md, "The read roofline's loop"). Both figures are
// in the output, with the faster as gb_per_s.
//
// WORK (0, 1, 2, 4 or 8; 0 the roofline) gives each 32-byte vector read that many dependent steps
// of an integer add and an xor before it is folded in, as a kernel computes on the weights it
// streams: how fast one core still reads when its loads share the out-of-order window with
// arithmetic (docs/kernels.md, "What a core streams while it computes"). BITS 512 (an AVX-512
// machine) reads and works on 64-byte vectors instead, half the instructions per byte: whether the
// loss to WORK is the number of instructions in flight. Both run the compiler's loop only.
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#if defined(__x86_64__) && defined(__AVX2__)
#include "indexed_read.h"
#define HAVE_INDEXED_LOOP 1
#else
#define HAVE_INDEXED_LOOP 0
#endif

#include "clock.h"

#define PASSES 10

typedef uint64_t lanes __attribute__((vector_size(32)));
typedef uint32_t words __attribute__((vector_size(32)));
typedef uint64_t wide_lanes __attribute__((vector_size(64)));
typedef uint32_t wide_words __attribute__((vector_size(64)));

typedef struct {
    const uint8_t *start;
    size_t bytes;
    int work;                     // add-and-xor steps per vector
    int wide;                     // 64-byte vectors instead of 32
    int indexed;                  // the assembly loop of base+index loads (WORK 0, 32-byte vectors)
    uint64_t folded;              // the XOR of the slice's 64-bit words (WORK 0), so the loads are not optimised away
} slice;

// t = (t + x) ^ 0x9e3779b9, `work` times, starting from x: two one-cycle vector operations a step
// that need the loaded value and that no compiler folds away.
#define WORKED(x, work, WORDS, LANES)                                               \
    ({                                                                              \
        WORDS t_ = (WORDS)(x);                                                      \
        for (int w_ = 0; w_ < (work); w_++) t_ = (t_ + (WORDS)(x)) ^ 0x9e3779b9u;   \
        (LANES)t_;                                                                  \
    })

// One slice with WORK add-and-xor steps per vector of LANES (a constant in each copy, so the loop unrolls).
#define READ_SLICE(WORK, NAME, WORDS, LANES)                                           \
    static void NAME##_##WORK(slice *s) {                                              \
        LANES a = {0}, b = {0}, c = {0}, d = {0};                                      \
        for (size_t i = 0; i + 4 * sizeof(LANES) <= s->bytes; i += 4 * sizeof(LANES)) { \
            const LANES *p = (const LANES *)(s->start + i);                            \
            a ^= WORKED(p[0], WORK, WORDS, LANES);                                     \
            b ^= WORKED(p[1], WORK, WORDS, LANES);                                     \
            c ^= WORKED(p[2], WORK, WORDS, LANES);                                     \
            d ^= WORKED(p[3], WORK, WORDS, LANES);                                     \
        }                                                                              \
        const LANES all = a ^ b ^ c ^ d;                                               \
        s->folded = 0;                                                                 \
        for (size_t k_ = 0; k_ < sizeof(LANES) / sizeof(uint64_t); k_++) s->folded ^= all[k_]; \
    }
#define READ_SLICES(NAME, WORDS, LANES)                                                \
    READ_SLICE(0, NAME, WORDS, LANES)                                                  \
    READ_SLICE(1, NAME, WORDS, LANES)                                                  \
    READ_SLICE(2, NAME, WORDS, LANES)                                                  \
    READ_SLICE(4, NAME, WORDS, LANES)                                                  \
    READ_SLICE(8, NAME, WORDS, LANES)                                                  \
    static void NAME(slice *s) {                                                       \
        switch (s->work) {                                                             \
        case 1: NAME##_1(s); break;                                                    \
        case 2: NAME##_2(s); break;                                                    \
        case 4: NAME##_4(s); break;                                                    \
        case 8: NAME##_8(s); break;                                                    \
        default: NAME##_0(s); break;                                                   \
        }                                                                              \
    }
READ_SLICES(read_narrow, words, lanes)
READ_SLICES(read_wide, wide_words, wide_lanes)

#if HAVE_INDEXED_LOOP
// The slice's whole 256-byte steps as indexed_read.h reads them; the tail of fewer than 256 bytes as
// the compiler's loop reads it.
static void read_indexed(slice *s) {
    const size_t steps = s->bytes & ~(size_t)255;
    const __m256i all = indexed_read(s->start, steps);
    slice tail = {s->start + steps, s->bytes - steps, 0, 0, 0, 0};
    read_narrow(&tail);
    s->folded = tail.folded ^ (uint64_t)_mm256_extract_epi64(all, 0) ^ (uint64_t)_mm256_extract_epi64(all, 1) ^
                (uint64_t)_mm256_extract_epi64(all, 2) ^ (uint64_t)_mm256_extract_epi64(all, 3);
}
#endif

static void *read_slice(void *arg) {
    slice *s = arg;
#if HAVE_INDEXED_LOOP
    if (s->indexed) {
        read_indexed(s);
        return NULL;
    }
#endif
    if (s->wide) read_wide(s);
    else read_narrow(s);
    return NULL;
}

int main(int argc, char **argv) {
    int threads = argc > 1 ? atoi(argv[1]) : 1;
    size_t mib = argc > 2 ? (size_t)atol(argv[2]) : 1024;
    int work = argc > 3 ? atoi(argv[3]) : 0, bits = argc > 4 ? atoi(argv[4]) : 256;
    if (threads < 1 || threads > 256 || mib < 4 || (work != 0 && work != 1 && work != 2 && work != 4 && work != 8) ||
        (bits != 256 && bits != 512)) {
        fprintf(stderr, "usage: %s THREADS [MiB >= 4 [WORK: 0, 1, 2, 4 or 8 [BITS: 256 or 512]]]\n", argv[0]);
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
    // best[0]: the compiler's loop; best[1]: the indexed one, where it is built and WORK is 0 at 256 bits
    const int loops = HAVE_INDEXED_LOOP && work == 0 && bits == 256 ? 2 : 1;
    double best[2] = {1e30, 1e30};
    uint64_t folded[2] = {0, 0};  // each loop's XOR of every 64-bit word it read: equal when both read it all
    for (int pass = 0; pass < PASSES * loops; pass++) {
        const int loop = pass % loops;
        double start = now();
        for (int t = 0; t < threads; t++) {
            slices[t] = (slice){buffer + (size_t)t * per, per, work, bits == 512, loop, 0};
            pthread_create(&ids[t], NULL, read_slice, &slices[t]);
        }
        folded[loop] = 0;
        for (int t = 0; t < threads; t++) {
            pthread_join(ids[t], NULL);
            folded[loop] ^= slices[t].folded;
        }
        double seconds = now() - start;
        if (seconds < best[loop]) best[loop] = seconds;
    }
    const double read = (double)(per * (size_t)threads);
    const double fastest = best[1] < best[0] ? best[1] : best[0];
    printf("{\"threads\": %d, \"work\": %d, \"bits\": %d, \"bytes\": %zu, \"gb_per_s\": %.3f, \"compiler_loop_gb_per_s\": %.3f",
           threads, work, bits, per * (size_t)threads, read / fastest / 1e9, read / best[0] / 1e9);
    printf(", \"check\": \"%016llx\"", (unsigned long long)folded[0]);
    if (loops == 2)
        printf(", \"indexed_loop_gb_per_s\": %.3f, \"indexed_check\": \"%016llx\"", read / best[1] / 1e9,
               (unsigned long long)folded[1]);
    printf("}\n");
    free(buffer);
    return 0;
}
