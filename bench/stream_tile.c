// stream_tile.c: how fast one core streams memory while it computes on what it reads as a one-token
// q4_K tile does, against the bare read of the same buffer in the same run: the ceiling of a
// generation step's share of the read roofline (docs/kernels.md, "The read roofline's loop").
// Each loop reads 1 GiB on huge pages (as krafla's packed weights) in "super-blocks" of 1024 bytes
// of 4-bit quants, as 4 chunk groups of 8 steps of 32 bytes, and gives the best of PASSES passes:
//   read          `vpxor (base,index)` of every 32 bytes into four accumulators (indexed_read.h,
//                 stream_read's faster loop)
//   and           each 32 bytes loaded, ANDed with two masks, both XORed into sums
//   vnni          a q4_K tile's integer work without its scales: low and high nibbles by AND, two
//                 VNNI products with 4 activation bytes broadcast from L1, the 8 steps' sums
//                 multiplied into a total per chunk group (kquant_tile.h's chunk_q45_K)
//   vnni-indexed  the same with each AND a `vpand (base,index)` (the engine's indexed_load.h, as
//                 the avx512 build's one-token tiles load their weights)
//   vnni-512      64-byte steps with 512-bit VNNI and 8 activation bytes broadcast per step
//                 (a packed layout krafla does not have: each row's chunks in 8-byte pairs)
//   vnni-512-permute  the same 64-byte steps on krafla's layout, whose 64 bytes are two chunks of the
//                 same 8 rows: each step's activations permuted (`vpermd`) from the chunk group's 64
//                 bytes, chunk 2j's word in the low 8 lanes and chunk 2j + 1's in the high 8
// The sums are not a matmul's; the loops only do its kind and amount of work per byte. Built and
// run by hand, on a machine with AVX-512 VNNI:
//     gcc -O2 -march=native -Iengine_c/src bench/stream_tile.c -o stream_tile && ./stream_tile [ROUNDS]
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "clock.h"

#if defined(__x86_64__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#include <immintrin.h>

#include "indexed_read.h"
#include "kernels/indexed_load.h"

#define PASSES 4
#define SUPER_BLOCK 1024

static int8_t activations[256] __attribute__((aligned(64)));

static __m256i read_indexed(const uint8_t *w, size_t n) { return indexed_read(w, n); }

static inline __m256i broadcast4(const int8_t *q) {
    int32_t v;
    memcpy(&v, q, 4);
    return _mm256_set1_epi32(v);
}

// The 32 bytes at w + at ANDed with mask: through the compiler's addresses, or as the avx512 build's
// one-token tiles load their weights (indexed_load.h).
static inline __attribute__((always_inline)) __m256i and_load(const uint8_t *w, size_t at, __m256i mask, const int indexed) {
    const char *p = (const char *)(w + at);
    return indexed ? kr_and_load_indexed(p, mask) : _mm256_and_si256(_mm256_loadu_si256((const __m256i *)p), mask);
}

// Every 32 bytes ANDed with the two nibble masks, then (products) multiplied as VNNI does, or
// (no products) only XORed into the sums.
static inline __attribute__((always_inline)) __m256i steps(const uint8_t *w, size_t n, const int products, const int indexed) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), high4 = _mm256_set1_epi8((char)0xf0);
    __m256i total = _mm256_setzero_si256();
    for (size_t b = 0; b < n; b += SUPER_BLOCK)
        for (int c = 0; c < 4; c++) {
            __m256i low = _mm256_setzero_si256(), high = low;
            for (int i = 0; i < 8; i++) {
                const size_t at = b + 256 * c + 32 * i;
                const __m256i x_low = and_load(w, at, low4, indexed), x_high = and_load(w, at, high4, indexed);
                if (products) {
                    low = _mm256_dpbusd_epi32(low, x_low, broadcast4(activations + 64 * c + 4 * i));
                    high = _mm256_dpbusd_epi32(high, x_high, broadcast4(activations + 64 * c + 32 + 4 * i));
                } else {
                    low = _mm256_xor_si256(low, x_low);
                    high = _mm256_xor_si256(high, x_high);
                }
            }
            total = products ? _mm256_add_epi32(total, _mm256_add_epi32(_mm256_mullo_epi32(low, low4),
                                                                        _mm256_mullo_epi32(_mm256_srai_epi32(high, 4), high4)))
                             : _mm256_add_epi32(total, _mm256_add_epi32(low, high));
        }
    return total;
}

static __m256i and_xor(const uint8_t *w, size_t n) { return steps(w, n, 0, 0); }
static __m256i vnni(const uint8_t *w, size_t n) { return steps(w, n, 1, 0); }
static __m256i vnni_indexed(const uint8_t *w, size_t n) { return steps(w, n, 1, 1); }

// Lanes 0-7 word `word` of a vector, lanes 8-15 word `word` + 1.
static inline __m512i pair_words(const int word) { return _mm512_mask_set1_epi32(_mm512_set1_epi32(word), 0xff00, word + 1); }

// 64-byte steps with 512-bit VNNI: step j's activations as 8 bytes broadcast (the 8-byte-pair layout)
// or (permute) chunk 2j's and 2j + 1's words permuted from the chunk group's 64 bytes (krafla's layout).
static inline __attribute__((always_inline)) __m256i steps_512(const uint8_t *w, size_t n, const int permute) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), high4 = _mm512_set1_epi8((char)0xf0);
    __m512i total = _mm512_setzero_si512();
    for (size_t b = 0; b < n; b += SUPER_BLOCK)
        for (int c = 0; c < 4; c++) {
            const __m512i group = _mm512_load_si512((const void *)(activations + 64 * c));
            __m512i low = _mm512_setzero_si512(), high = low;
            for (int j = 0; j < 4; j++) {
                const __m512i x = _mm512_loadu_si512((const void *)(w + b + 256 * c + 64 * j));
                __m512i a_low, a_high;
                if (permute) {
                    a_low = _mm512_permutexvar_epi32(pair_words(2 * j), group);
                    a_high = _mm512_permutexvar_epi32(pair_words(8 + 2 * j), group);
                } else {
                    int64_t bytes_low, bytes_high;
                    memcpy(&bytes_low, activations + 64 * c + 8 * j, 8);
                    memcpy(&bytes_high, activations + 64 * c + 32 + 8 * j, 8);
                    a_low = _mm512_set1_epi64(bytes_low);
                    a_high = _mm512_set1_epi64(bytes_high);
                }
                low = _mm512_dpbusd_epi32(low, _mm512_and_si512(x, low4), a_low);
                high = _mm512_dpbusd_epi32(high, _mm512_and_si512(x, high4), a_high);
            }
            total = _mm512_add_epi32(total, _mm512_add_epi32(_mm512_mullo_epi32(low, low4),
                                                             _mm512_mullo_epi32(_mm512_srai_epi32(high, 4), high4)));
        }
    return _mm512_castsi512_si256(_mm512_xor_si512(total, _mm512_shuffle_i64x2(total, total, 0x4e)));
}

static __m256i vnni_512(const uint8_t *w, size_t n) { return steps_512(w, n, 0); }
static __m256i vnni_512_permute(const uint8_t *w, size_t n) { return steps_512(w, n, 1); }

typedef __m256i loop_fn(const uint8_t *w, size_t n);
static const struct {
    const char *name;
    loop_fn *run;
} LOOPS[] = {{"read", read_indexed}, {"and", and_xor}, {"vnni", vnni}, {"vnni-indexed", vnni_indexed}, {"vnni-512", vnni_512},
                {"vnni-512-permute", vnni_512_permute}};
#define N_LOOPS (int)(sizeof(LOOPS) / sizeof(LOOPS[0]))

int main(int argc, char **argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 2;
    const size_t bytes = (size_t)1 << 30, huge_page = (size_t)2 << 20;
    uint8_t *buffer = aligned_alloc(huge_page, bytes);
    if (!buffer || rounds < 1) {
        fprintf(stderr, buffer ? "usage: %s [ROUNDS >= 1]\n" : "%s: cannot allocate 1 GiB\n", argv[0]);
        return buffer ? 2 : 1;
    }
    madvise(buffer, bytes, MADV_HUGEPAGE);
    for (size_t i = 0; i < bytes; i++) buffer[i] = (uint8_t)(i * 2654435761u >> 24);
    for (int i = 0; i < 256; i++) activations[i] = (int8_t)(i * 7);
    uint32_t check = 0;
    for (int round = 0; round < rounds; round++) {
        printf("round %d:", round + 1);
        for (int l = 0; l < N_LOOPS; l++) {
            double best = 1e30;
            for (int pass = 0; pass < PASSES; pass++) {
                const double start = now();
                check ^= (uint32_t)_mm256_extract_epi32(LOOPS[l].run(buffer, bytes), 0);
                const double seconds = now() - start;
                if (seconds < best) best = seconds;
            }
            printf("  %s %.2f GB/s", LOOPS[l].name, (double)bytes / best / 1e9);
            fflush(stdout);
        }
        printf("\n");
    }
    printf("(check %u)\n", check & 1);
    free(buffer);
    return 0;
}
#else
int main(void) {
    fprintf(stderr, "stream_tile: needs x86-64 with AVX-512 VNNI (build with -march=native on such a CPU)\n");
    return 1;
}
#endif
