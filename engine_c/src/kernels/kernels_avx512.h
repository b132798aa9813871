// kernels_avx512.h: the AVX-512 VNNI pieces the ISA=avx512 build adds to kernels_avx2.c's tiles.
// Internal; only included where KR_HAVE_AVX512 is defined.
#ifndef KRAFLA_KERNELS_AVX512_H
#define KRAFLA_KERNELS_AVX512_H

#include "kernels/kernels.h"

#include <immintrin.h>

// Integer block sums with VNNI (kernels_avx2.c explains the AVX2 ones they replace): multiply 4
// unsigned weight bytes by 4 signed activation bytes, add them and accumulate in int32, one
// instruction; exact, so the same sums as the AVX2 int16 pairs.
static inline __attribute__((always_inline)) __m256i kr_isum_add_avx512(__m256i acc, __m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(acc, u, s);
}
static inline __attribute__((always_inline)) __m256i kr_isum_lanes_avx512(__m256i acc) { return acc; }
static inline __attribute__((always_inline)) __m256i kr_isum_add_wide_avx512(__m256i acc, __m256i u, __m256i s) {
    return _mm256_dpbusd_epi32(acc, u, s);
}

// One token against two packed groups of q4_0 rows (16 rows from `w`, the second group
// `group_stride` bytes after the first), n_blocks blocks of prepared activations `a`; stores rows
// [keep_begin, keep_end) of the 16 to out. `next`: the tile after it, prefetched (or NULL).
void kr_pair_tile_q4_0_avx512(const char *w, size_t group_stride, const char *a, int64_t n_blocks, float *out,
                              int keep_begin, int keep_end, const char *next);

#endif
