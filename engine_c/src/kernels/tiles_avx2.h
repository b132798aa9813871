// tiles_avx2.h: the pieces the AVX2 matmul tiles of kernels_avx2.c (q8_0, float weights) and
// legacy_avx2.c (q4_0, q4_1, q5_0, q5_1) share: scalar f16, activation broadcast, the horizontal
// sums of 4 rows, and the switches that pick one instance of a tile per shape. None of them does
// float arithmetic, so they decide no bits. Internal; only included where KR_HAVE_AVX2 is defined.
#ifndef KRAFLA_KERNELS_TILES_AVX2_H
#define KRAFLA_KERNELS_TILES_AVX2_H

#include "kernels/kernels.h"

#include <immintrin.h>

#define KR_INLINE static inline __attribute__((always_inline))

KR_INLINE float f16_to_f32(kr_f16 h) { return _cvtsh_ss(h); }

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
#define KR_TILE_SHAPES(CALL) \
    switch (R * 8 + T) { \
    case 1 * 8 + 1: CALL(1, 1); break; case 1 * 8 + 2: CALL(1, 2); break; \
    case 1 * 8 + 3: CALL(1, 3); break; case 1 * 8 + 4: CALL(1, 4); break; \
    case 2 * 8 + 1: CALL(2, 1); break; case 2 * 8 + 2: CALL(2, 2); break; \
    case 2 * 8 + 3: CALL(2, 3); break; case 2 * 8 + 4: CALL(2, 4); break; \
    case 3 * 8 + 1: CALL(3, 1); break; case 3 * 8 + 2: CALL(3, 2); break; \
    case 3 * 8 + 3: CALL(3, 3); break; case 3 * 8 + 4: CALL(3, 4); break; \
    case 4 * 8 + 1: CALL(4, 1); break; case 4 * 8 + 2: CALL(4, 2); break; \
    case 4 * 8 + 3: CALL(4, 3); break; case 4 * 8 + 4: CALL(4, 4); break; \
    default: break; \
    }

#define KR_GROUP_SHAPES(CALL) \
    switch (G * 8 + T) { \
    case 1 * 8 + 1: CALL(1, 1); break; case 1 * 8 + 2: CALL(1, 2); break; \
    case 1 * 8 + 3: CALL(1, 3); break; case 1 * 8 + 4: CALL(1, 4); break; \
    case 2 * 8 + 1: CALL(2, 1); break; case 2 * 8 + 2: CALL(2, 2); break; \
    case 2 * 8 + 3: CALL(2, 3); break; case 2 * 8 + 4: CALL(2, 4); break; \
    default: break; \
    }


// Tokens are taken in blocks whose prepared activations fit in L2 (about 256 KiB), so each row tile
// finds them there; the weights are read once per block.
#define KR_ACTIVATION_BLOCK_BYTES (256 * 1024)

// The packed matmul of a type whose blocks are 32 wide (kernels.h, "Packed weights"), given its two
// kinds of tile:
//   tile:      G <= max_groups groups of 8 rows x T <= max_tokens tokens, the groups at w and
//              w + group_stride, the tokens' prepared rows at a (a_stride apart), out relative to the
//              tile's first row; stores the rows [keep_begin, keep_end) of the tile. `next`: the
//              group after the tile, prefetched (NULL if none).
//   file_rows: the file layout's matmul, for the rows past the last whole group of 8.
// Tokens go in L2-sized blocks; within a block, groups outside and tokens inside, so a tile's
// weights stay in L1 while the block's tokens pass over them. Only integer bookkeeping: each
// output's arithmetic is its tile's, whatever the shape or row range.
typedef void kr_packed_tile_avx2(int32_t type, int G, int T, const char *w, size_t group_stride, const char *a,
                                 size_t a_stride, int64_t n_blocks, float *out, int64_t out_stride, int keep_begin,
                                 int keep_end, const char *next);
typedef void kr_file_rows_avx2(int32_t type, const void *w, int64_t cols, const void *prepared, int64_t n_tokens, float *out,
                               int64_t out_stride, int64_t row_begin, int64_t row_end);

static inline void kr_matmul_packed_tiles_avx2(int32_t type, const void *w, int64_t rows, int64_t cols, const void *prepared,
                                               int64_t n_tokens, float *out, int64_t out_stride, int64_t row_begin,
                                               int64_t row_end, int max_groups, int max_tokens, kr_packed_tile_avx2 *tile,
                                               kr_file_rows_avx2 *file_rows) {
    const int64_t grouped = rows - rows % KR_PACK_ROWS;
    if (row_end > grouped) {  // the rows past the last group are in file layout
        file_rows(type, w, cols, prepared, n_tokens, out, out_stride, row_begin > grouped ? row_begin : grouped, row_end);
        row_end = grouped;
    }
    if (row_begin >= row_end) return;
    const size_t group_stride = KR_PACK_ROWS * kr_weight_row_bytes(type, cols);
    const size_t a_stride = kr_activation_row_bytes(type, cols);
    int64_t block_tokens = a_stride ? (int64_t)(KR_ACTIVATION_BLOCK_BYTES / a_stride) : n_tokens;  // cols 0: no blocks
    block_tokens = block_tokens < max_tokens ? max_tokens : block_tokens - block_tokens % max_tokens;
    const int64_t group_begin = row_begin / KR_PACK_ROWS, group_end = (row_end + KR_PACK_ROWS - 1) / KR_PACK_ROWS;
    for (int64_t b0 = 0; b0 < n_tokens; b0 += block_tokens) {
        const int64_t b1 = n_tokens - b0 < block_tokens ? n_tokens : b0 + block_tokens;
        for (int64_t g0 = group_begin; g0 < group_end; g0 += max_groups) {
            const int G = (int)(group_end - g0 < max_groups ? group_end - g0 : max_groups);
            const int64_t first = g0 * KR_PACK_ROWS;
            const int keep_begin = (int)(row_begin > first ? row_begin - first : 0);
            const int keep_end = (int)(row_end - first < G * KR_PACK_ROWS ? row_end - first : G * KR_PACK_ROWS);
            const char *tile_w = (const char *)w + (size_t)g0 * group_stride;
            const char *next = g0 + G < group_end ? tile_w + (size_t)G * group_stride : NULL;
            for (int64_t t0 = b0; t0 < b1; t0 += max_tokens) {
                const int T = (int)(b1 - t0 < max_tokens ? b1 - t0 : max_tokens);
                tile(type, G, T, tile_w, group_stride, (const char *)prepared + (size_t)t0 * a_stride, a_stride, cols / KR_QK,
                     out + t0 * out_stride + first, out_stride, keep_begin, keep_end, t0 == b0 ? next : NULL);
            }
        }
    }
}

#endif
