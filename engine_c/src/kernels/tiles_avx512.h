// tiles_avx512.h: loads, scales, prefetches and stores the avx512 build's 512-bit packed tiles (legacy_avx512.c, q8_avx512.c)
// share: two packed groups of 8 rows side by side, the first in the low 256 bits and the second in
// the high 256, so the 16 lanes are 16 rows. No float arithmetic, so they decide no bits. Internal; only
// included where KR_HAVE_AVX512 is defined.
#ifndef KRAFLA_KERNELS_TILES_AVX512_H
#define KRAFLA_KERNELS_TILES_AVX512_H

#include <immintrin.h>

#include "kernels/tiles_avx2.h"  // e8m0_half_8

// Two 256-bit loads, `first` in the low half and `second` in the high half.
static inline __m512i kr_load_pair(const char *first, const char *second) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)first)),
                              _mm256_loadu_si256((const __m256i *)second), 1);
}

// Two groups' 8 f16 values (16 bytes each) as 16 floats.
static inline __m512 kr_scales_pair(const char *first, const char *second) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)first)),
                                                   _mm_loadu_si128((const __m128i *)second), 1));
}

// Two groups' 8 E8M0 exponents each (mxfp4, 8 bytes each) as 16 floats 2^(e - 128): tiles_avx2.h's
// e8m0_half_8 of each group, the first in the low half.
static inline __m512 kr_e8m0_pair(const char *first, const char *second) {
    const __m512d low = _mm512_castpd256_pd512(_mm256_castps_pd(e8m0_half_8(first)));
    return _mm512_castpd_ps(_mm512_insertf64x4(low, _mm256_castps_pd(e8m0_half_8(second)), 1));
}

// Block b of the pair of groups at `next` (the tile after this one), fetched into L2 ahead of use
// (kquant_tile.h's prefetch_group says why not L1). Always inlined: as a plain static inline the
// 512-bit tiles called it out of line, and GCC deleted the calls, a function of prefetches alone
// having no effect it must keep, so until 4 Dec these tiles fetched nothing ahead. Made real, an
// L1 fetch slowed one-token q8_0 tiles of long rows by a third (bench/kernels.py --packed --types
// q8_0 --tokens 1, 896x4864: 63-71 -> 94 us), an L2 fetch gives 71-72 us, as none did, and 4864x896
// q4_0 51 us against 54 (measured while one-token steps still took these tiles; they now take
// KR_ONE_TOKEN_GROUPS' 256-bit tiles).
static inline __attribute__((always_inline)) void kr_prefetch_pair(const char *next, size_t group_stride,
                                                                    size_t block_bytes, int64_t b) {
    for (size_t line = 0; line < block_bytes; line += 64) {
        _mm_prefetch(next + (size_t)b * block_bytes + line, _MM_HINT_T1);
        _mm_prefetch(next + group_stride + (size_t)b * block_bytes + line, _MM_HINT_T1);
    }
}

// One token's 16 outputs (acc's lanes) to row[0..16), only those of [keep_begin, keep_end).
static inline void kr_store_pair(float *row, __m512 acc, int keep_begin, int keep_end) {
    if (keep_begin == 0 && keep_end == 16) {
        _mm512_storeu_ps(row, acc);
    } else {
        float lanes[16];
        _mm512_storeu_ps(lanes, acc);
        for (int r = keep_begin; r < keep_end; r++) row[r] = lanes[r];
    }
}

#endif
