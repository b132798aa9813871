// tiles_avx2.h: the pieces the AVX2 matmul tiles of kernels_avx2.c (q8_0, float weights) and
// legacy_avx2.c (q4_0, q4_1, q5_0, q5_1, iq4_nl, mxfp4) share: scalar f16 and E8M0 scales, activation broadcast, the horizontal
// sums of 4 rows, the switches that pick one instance of a tile per shape, and the stores that end
// a tile (the loops around the tiles are tile_loops.h's). None of them does float arithmetic, so
// they decide no bits. Internal; only included where KR_HAVE_AVX2 is defined.
#ifndef KRAFLA_KERNELS_TILES_AVX2_H
#define KRAFLA_KERNELS_TILES_AVX2_H

#include "kernels/kernels.h"
#include "kernels/tile_loops.h"

#include <immintrin.h>

#define KR_INLINE static inline __attribute__((always_inline))

KR_INLINE float f16_to_f32(kr_f16 h) { return _cvtsh_ss(h); }

// 8 E8M0 bytes (mxfp4's exponents e) as 8 floats, lowbit.h's kr_e8m0_half lane by lane: the bits
// (e - 1) << 23, or 0x00200000 << e for the subnormal e < 2. Exact: no rounding.
KR_INLINE __m256 e8m0_half_8(const char *bytes) {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)bytes));
    const __m256i normal = _mm256_slli_epi32(_mm256_sub_epi32(e, _mm256_set1_epi32(1)), 23);
    const __m256i subnormal = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), e);
    const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(2), e);
    return _mm256_castsi256_ps(_mm256_blendv_epi8(normal, subnormal, small));
}

// 4 activation bytes (elements at..at+3) in every int32 lane.
KR_INLINE __m256i broadcast4(const int8_t *q) {
    int32_t v;
    __builtin_memcpy(&v, q, 4);
    return _mm256_set1_epi32(v);
}

// The 8 int32 lane sums of 4 vectors, added up per vector: {sum v0, sum v1, sum v2, sum v3}.
KR_INLINE __m128i sum4_epi32(__m256i v0, __m256i v1, __m256i v2, __m256i v3) {
    const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(v0, v1), _mm256_hadd_epi32(v2, v3));
    return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

// One tile of any shape up to R = 4 rows x T = 4 tokens (file layout), or G = 2 groups of 8 rows x
// T = 4 tokens (packed): the tiles' loops need the shape as constants, so one instance per shape,
// chosen here. CALL(r, t) / CALL(g, t) calls the instance.
#define KR_SHAPES_UP_TO_2(CALL) \
    case 1 * 8 + 1: CALL(1, 1); break; case 1 * 8 + 2: CALL(1, 2); break; \
    case 1 * 8 + 3: CALL(1, 3); break; case 1 * 8 + 4: CALL(1, 4); break; \
    case 2 * 8 + 1: CALL(2, 1); break; case 2 * 8 + 2: CALL(2, 2); break; \
    case 2 * 8 + 3: CALL(2, 3); break; case 2 * 8 + 4: CALL(2, 4); break;
#define KR_TILE_SHAPES(CALL) \
    switch (R * 8 + T) { \
    KR_SHAPES_UP_TO_2(CALL) \
    case 3 * 8 + 1: CALL(3, 1); break; case 3 * 8 + 2: CALL(3, 2); break; \
    case 3 * 8 + 3: CALL(3, 3); break; case 3 * 8 + 4: CALL(3, 4); break; \
    case 4 * 8 + 1: CALL(4, 1); break; case 4 * 8 + 2: CALL(4, 2); break; \
    case 4 * 8 + 3: CALL(4, 3); break; case 4 * 8 + 4: CALL(4, 4); break; \
    default: break; \
    }
#define KR_GROUP_SHAPES(CALL) \
    switch (G * 8 + T) { \
    KR_SHAPES_UP_TO_2(CALL) \
    default: break; \
    }

// The end of a file-layout tile: acc[t] holds token t's outputs of the tile's R rows in its lanes.
KR_INLINE void store_rows(const int R, const int T, const __m128 acc[4], float *out, int64_t out_stride) {
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) {
        float lanes[4];
        _mm_storeu_ps(lanes, acc[t]);
        for (int r = 0; r < R; r++) out[t * out_stride + r] = lanes[r];
    }
}

// The end of a packed tile: acc[g][t] holds token t's outputs of rows 8g..8g+7 of the tile; the
// rows of [keep_begin, keep_end) are stored.
KR_INLINE void store_groups(const int G, const int T, __m256 acc[2][4], float *out, int64_t out_stride, int keep_begin,
                            int keep_end) {
#pragma GCC unroll 2
    for (int g = 0; g < G; g++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            float *row = out + t * out_stride + KR_PACK_ROWS * g;
            if (keep_begin <= KR_PACK_ROWS * g && KR_PACK_ROWS * (g + 1) <= keep_end) {
                _mm256_storeu_ps(row, acc[g][t]);
            } else {
                float lanes[KR_PACK_ROWS];
                _mm256_storeu_ps(lanes, acc[g][t]);
                for (int r = 0; r < KR_PACK_ROWS; r++)
                    if (keep_begin <= KR_PACK_ROWS * g + r && KR_PACK_ROWS * g + r < keep_end) row[r] = lanes[r];
            }
        }
}

#endif
