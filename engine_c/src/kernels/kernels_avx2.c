// kernels_avx2.c: the kernels of kernels.h with AVX2/FMA/F16C intrinsics (suffix _avx2).
//
// Each computes exactly what its reference twin in quant_ref.c computes, in the same order of
// float operations (8 lanes, one fused multiply-add per lane and step, the fixed horizontal sum,
// a scalar fmaf tail), so the results agree bit for bit. The matmul is register-tiled: a tile of
// R weight rows x T tokens shares each activation load across R rows and each weight load across T
// tokens, and every (token, row) output still goes through the same sequence of operations as when
// computed alone, so the result never depends on n_tokens or on [row_begin, row_end). Tokens go in
// L2-sized blocks and the next row tile is prefetched; neither changes any arithmetic. The
// ISA=avx512 build compiles this same file and swaps the integer block sums for VNNI ones. q4_0
// weights go to legacy_avx2.c's tiles, which serve the whole family of q4_0, q4_1, q5_0 and q5_1
// (legacy.h).
#include "kernels/kernels.h"
#include "kernels/legacy.h"
#include "kernels/lowbit.h"
#include "krafla.h"

#if defined(KR_HAVE_AVX2)
#include "kernels/tiles_avx2.h"
#include <math.h>

// ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)), as kr_lanes_sum.
KR_INLINE float hsum8(__m256 v) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// ---------------------------------------------------------------------------------------------
// f16 rows

void kr_f16_to_f32_row_avx2(const kr_f16 *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i))));
    for (; i < n; i++) y[i] = f16_to_f32(x[i]);
}

void kr_f32_to_f16_row_avx2(const float *x, kr_f16 *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    for (; i < n; i++) y[i] = (kr_f16)_cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// ---------------------------------------------------------------------------------------------
// q8_0 quantization: the reference's scalar d and 1/d, x * id in vectors, and roundf's rounding
// (half away from zero, which no AVX rounding mode does) built from truncation.

KR_INLINE __m256i round_away_to_i32(__m256 v) {
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    const __m256 ordered = _mm256_cmp_ps(v, v, _CMP_ORD_Q);  // NaN -> 0, as the reference
    v = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
    const __m256 magnitude = _mm256_andnot_ps(sign_mask, v);
    __m256 whole = _mm256_round_ps(magnitude, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 up = _mm256_cmp_ps(_mm256_sub_ps(magnitude, whole), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    whole = _mm256_add_ps(whole, _mm256_and_ps(up, _mm256_set1_ps(1.0f)));
    return _mm256_cvttps_epi32(_mm256_and_ps(ordered, _mm256_or_ps(whole, _mm256_and_ps(v, sign_mask))));
}

// One block of 32: the f16 scale into *d, the quants into q, and (with_sum) their sum into *sum.
KR_INLINE void quantize_block_q8(const float *xb, kr_f16 *d_out, int8_t *q, const int with_sum, int32_t *sum) {
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    __m256 v[4];
    for (int i = 0; i < 4; i++) v[i] = _mm256_loadu_ps(xb + 8 * i);
    // max_ps(a, b) returns b when a is NaN: with the running maximum as b, NaNs are skipped
    __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        m = _mm256_max_ps(_mm256_andnot_ps(sign_mask, v[i]), m);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v[i], v[i], _CMP_UNORD_Q));
    }
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
    const float d = amax / 127.0f;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    *d_out = (kr_f16)_cvtss_sh(_mm256_movemask_ps(nan) ? NAN : d, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 scale = _mm256_set1_ps(id);
    const __m256i q0 = round_away_to_i32(_mm256_mul_ps(v[0], scale));
    const __m256i q1 = round_away_to_i32(_mm256_mul_ps(v[1], scale));
    const __m256i q2 = round_away_to_i32(_mm256_mul_ps(v[2], scale));
    const __m256i q3 = round_away_to_i32(_mm256_mul_ps(v[3], scale));
    // packs work within 128-bit halves; the permute puts the 4-byte groups back in order
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q0, q1), _mm256_packs_epi32(q2, q3));
    _mm256_storeu_si256((__m256i *)q, _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    if (with_sum) {
        const __m256i s8 = _mm256_add_epi32(_mm256_add_epi32(q0, q1), _mm256_add_epi32(q2, q3));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s8), _mm256_extracti128_si256(s8, 1));
        s4 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
        *sum = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 1)));
    }
}

void kr_quantize_row_q8_0_avx2(const float *x, kr_block_q8_0 *y, int64_t n) {
    for (int64_t b = 0; b < n / KR_QK; b++) quantize_block_q8(x + b * KR_QK, &y[b].d, y[b].q, 0, NULL);
}

void kr_quantize_row_q8_sum_avx2(const float *x, kr_block_q8_sum *y, int64_t n) {
    for (int64_t b = 0; b < n / KR_QK; b++) {
        kr_f16 d;
        quantize_block_q8(x + b * KR_QK, &d, y[b].q, 1, &y[b].sum);
        y[b].d = f16_to_f32(d);
    }
}

// ---------------------------------------------------------------------------------------------
// Integer block sums. A quantized dot product is exact integers per block (kernels.h), so these
// only have to be exact: 4 products per int32 lane, from unsigned weight bytes u (q8_0's
// magnitudes, u <= 128) and signed activation bytes s (in [-127, 127]: kr_quantize_row_q8_0 never
// makes -128). The ISA=avx512 build has VNNI, which multiplies, adds 4 neighbours and accumulates
// in int32 in one instruction; AVX2 multiplies and adds pairs into int16 (maddubs: 2 * 128 * 127 =
// 32512 fits one step, not two) and widens them (madd) every step.
#if defined(KR_HAVE_AVX512)
KR_INLINE __m256i isum_add_wide(__m256i acc, __m256i u, __m256i s) { return _mm256_dpbusd_epi32(acc, u, s); }
#else
KR_INLINE __m256i isum_add_wide(__m256i acc, __m256i u, __m256i s) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}
#endif

// ---------------------------------------------------------------------------------------------
// q8_0 matmul tiles, file layout: R <= 4 rows x T <= 4 tokens. Per block, each (row, token)
// pair's integer sum (lanes added up for 4 rows at once), then for each token the 4 rows' fused
// multiply-adds in the lanes of one 128-bit vector: acc = fma(d_w * d_a, sum, acc), block after
// block. `w` points at the tile's first row, `a` at its first token's prepared row; out relative
// to the tile. Used without packing, for the rows past a packed matrix's last group of 8, and for
// q8_0 keys in attention.
KR_INLINE void tile_q8_0_rows(const int R, const int T, const char *w, size_t w_stride, const char *a, size_t a_stride,
                              int64_t n_blocks, float *out, int64_t out_stride, const char *next) {
    const size_t w_block = sizeof(kr_block_q8_0), a_block = sizeof(kr_block_q8_0);
    __m128 acc[4];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) acc[t] = _mm_setzero_ps();
    for (int64_t b = 0; b < n_blocks; b++) {
        __m256i weights[4];
        float scales[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const char *block = w + r * w_stride + (size_t)b * w_block;
            if (next) _mm_prefetch(next + r * w_stride + (size_t)b * w_block, _MM_HINT_T0);
            weights[r] = _mm256_loadu_si256((const __m256i *)(block + 2));
            scales[r] = f16_to_f32(*(const kr_f16 *)block);
        }
        const __m128 w_scale = _mm_loadu_ps(scales);
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const char *block = a + t * a_stride + (size_t)b * a_block;
            const __m256i av = _mm256_loadu_si256((const __m256i *)(block + 2));
            __m256i lanes[4];
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++)
                lanes[r] = r < R ? isum_add_wide(_mm256_setzero_si256(), _mm256_abs_epi8(weights[r]), _mm256_sign_epi8(av, weights[r]))
                                 : _mm256_setzero_si256();
            const __m128i sums = sum4_epi32(lanes[0], lanes[1], lanes[2], lanes[3]);
            const float a_scale = f16_to_f32(((const kr_block_q8_0 *)block)->d);
            acc[t] = _mm_fmadd_ps(_mm_mul_ps(w_scale, _mm_set1_ps(a_scale)), _mm_cvtepi32_ps(sums), acc[t]);
        }
    }
    store_rows(R, T, acc, out, out_stride);
}

// ---------------------------------------------------------------------------------------------
// q8_0 matmul tiles, packed layout (kernels.h): G <= 2 groups of 8 rows x T <= 4 tokens. The
// lanes of a vector are a group's 8 rows: each step multiplies a 32-byte chunk (8 rows x 4 weights)
// by 4 activation bytes broadcast to every lane, and each block ends with one fused multiply-add
// for 8 outputs. acc[g][t] are the outputs of rows 8g..8g+7 of the tile for token t.
// `group_stride` is the distance between two groups (8 rows of the file), `next` the group after
// the tile (prefetched alongside, NULL if none).
#define Q8_GROUP_BLOCK (KR_PACK_ROWS * sizeof(kr_block_q8_0))  // 272 bytes: 16 of scales, 8 chunks

// The end of a block in a packed tile: acc[g][t] += (group g's 8 scales * token t's scale) * sums[g][t].
KR_INLINE void finish_block(const int G, const int T, const char *group_block, size_t group_stride,
                            const __m256 a_scale[4], __m256i sums[2][4], __m256 acc[2][4]) {
#pragma GCC unroll 2
    for (int g = 0; g < G; g++) {
        const __m256 w_scale = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(group_block + g * group_stride)));
#pragma GCC unroll 4
        for (int t = 0; t < T; t++)
            acc[g][t] = _mm256_fmadd_ps(_mm256_mul_ps(w_scale, a_scale[t]), _mm256_cvtepi32_ps(sums[g][t]), acc[g][t]);
    }
}

KR_INLINE void group_tile_q8_0(const int G, const int T, const char *w, size_t group_stride, const char *a,
                               size_t a_stride, int64_t n_blocks, __m256 acc[2][4], const char *next) {
    for (int64_t b = 0; b < n_blocks; b++) {
        const char *group_block = w + (size_t)b * Q8_GROUP_BLOCK;
        __m256i sums[2][4];
#pragma GCC unroll 4
        for (int g = 0; g < G; g++)
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) sums[g][t] = _mm256_setzero_si256();
        if (next)
            for (int line = 0; line < (int)Q8_GROUP_BLOCK; line += 64) _mm_prefetch(next + (size_t)b * Q8_GROUP_BLOCK + line, _MM_HINT_T0);
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            __m256i weights[2], magnitudes[2];
#pragma GCC unroll 2
            for (int g = 0; g < G; g++) {
                weights[g] = _mm256_loadu_si256((const __m256i *)(group_block + g * group_stride + 16 + 32 * i));
                magnitudes[g] = _mm256_abs_epi8(weights[g]);
            }
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                const __m256i av = broadcast4(((const kr_block_q8_0 *)(a + t * a_stride) + b)->q + 4 * i);
#pragma GCC unroll 2
                for (int g = 0; g < G; g++)
                    sums[g][t] = isum_add_wide(sums[g][t], magnitudes[g], _mm256_sign_epi8(av, weights[g]));
            }
        }
        __m256 a_scale[4];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) a_scale[t] = _mm256_set1_ps(f16_to_f32(((const kr_block_q8_0 *)(a + t * a_stride) + b)->d));
        finish_block(G, T, group_block, group_stride, a_scale, sums, acc);
    }
}


// One packed tile: computes the G x 8 rows for T tokens and stores the rows of [keep_begin,
// keep_end) (relative to the tile's first row: a row range may start or end inside a group).
KR_INLINE void group_tile(const int G, const int T, const char *w, size_t group_stride, const char *a,
                          size_t a_stride, int64_t n_blocks, float *out, int64_t out_stride, int keep_begin, int keep_end,
                          const char *next) {
    __m256 acc[2][4];
#pragma GCC unroll 2
    for (int g = 0; g < G; g++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[g][t] = _mm256_setzero_ps();
    group_tile_q8_0(G, T, w, group_stride, a, a_stride, n_blocks, acc, next);
    store_groups(G, T, acc, out, out_stride, keep_begin, keep_end);
}

// Float weights: 8 columns at a time into the lanes, then the scalar tail in order.
enum { WEIGHTS_F32, WEIGHTS_F16, WEIGHTS_BF16 };

KR_INLINE __m256 load8(const int kind, const char *row, int64_t k) {
    switch (kind) {
    case WEIGHTS_F16: return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const kr_f16 *)row + k)));
    case WEIGHTS_BF16:
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + k))), 16));
    default: return _mm256_loadu_ps((const float *)row + k);
    }
}

KR_INLINE float load1(const int kind, const char *row, int64_t k) {
    switch (kind) {
    case WEIGHTS_F16: return f16_to_f32(((const kr_f16 *)row)[k]);
    case WEIGHTS_BF16: return kr_bf16_to_f32(((const uint16_t *)row)[k]);
    default: return ((const float *)row)[k];
    }
}

KR_INLINE void tile_float(const int kind, const int R, const int T, const char *w, size_t w_stride, const char *a,
                          size_t a_stride, int64_t cols, float *out, int64_t out_stride, const char *next) {
    __m256 acc[4][4];
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[r][t] = _mm256_setzero_ps();
    const int64_t cols8 = cols - cols % 8;
    for (int64_t k = 0; k < cols8; k += 8) {
        __m256 weights[4];
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            weights[r] = load8(kind, w + r * w_stride, k);
            if (next) _mm_prefetch(next + r * w_stride + k * (kind == WEIGHTS_F32 ? 4 : 2), _MM_HINT_T0);
        }
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const __m256 x = _mm256_loadu_ps((const float *)(a + t * a_stride) + k);
#pragma GCC unroll 4
            for (int r = 0; r < R; r++) acc[r][t] = _mm256_fmadd_ps(weights[r], x, acc[r][t]);
        }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; r++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const float *x = (const float *)(a + t * a_stride);
            float sum = hsum8(acc[r][t]);
            for (int64_t k = cols8; k < cols; k++) sum = fmaf(load1(kind, w + r * w_stride, k), x[k], sum);
            out[t * out_stride + r] = sum;
        }
}

// One instance of the float tile per shape, for a weight kind known at compile time.
KR_INLINE void float_tiles(const int kind, int R, int T, const char *w, size_t w_stride, const char *a, size_t a_stride,
                           int64_t cols, float *out, int64_t out_stride, const char *next) {
#define CALL_FLOAT(r, t) tile_float(kind, r, t, w, w_stride, a, a_stride, cols, out, out_stride, next)
    KR_TILE_SHAPES(CALL_FLOAT)
}

// A file-layout tile (tile_loops.h's kr_row_tile) of any type this file multiplies; for float
// weights the blocks are columns.
static void tile(int32_t weight_type, int R, int T, const char *w, size_t w_stride, const char *a, size_t a_stride,
                 int64_t n_blocks, float *out, int64_t out_stride, const char *next) {
    switch (weight_type) {
    case KR_Q8_0:
#define CALL_Q8(r, t) tile_q8_0_rows(r, t, w, w_stride, a, a_stride, n_blocks, out, out_stride, next)
        KR_TILE_SHAPES(CALL_Q8)
        break;
    case KR_F32: float_tiles(WEIGHTS_F32, R, T, w, w_stride, a, a_stride, n_blocks, out, out_stride, next); break;
    case KR_F16: float_tiles(WEIGHTS_F16, R, T, w, w_stride, a, a_stride, n_blocks, out, out_stride, next); break;
    case KR_BF16: float_tiles(WEIGHTS_BF16, R, T, w, w_stride, a, a_stride, n_blocks, out, out_stride, next); break;
    default: break;  // kr_kernel_type_supported() is checked where a tensor's type enters
    }
}

// Tile shape, rows x tokens: 4x4 for the file layout's q8_0 tiles (their 4 rows' sums are added
// up together); 3x4 for the float ones at several tokens (their weight conversion takes
// registers too), 4x1 at one token (more independent FMA chains).
static int tile_rows(int32_t weight_type, int64_t n_tokens) {
    if (weight_type == KR_Q8_0) return 4;
    return n_tokens == 1 ? 4 : 3;
}

void kr_matmul_avx2(int32_t weight_type, const void *w, int64_t cols, const void *prepared, int64_t n_tokens,
                    float *out, int64_t out_stride, int64_t row_begin, int64_t row_end) {
    if (kr_is_lowbit(weight_type)) {  // q2_K, q3_K, iq4_nl, iq4_xs, mxfp4: lowbit_avx2.c
        kr_matmul_lowbit_avx2(weight_type, w, cols, prepared, n_tokens, out, out_stride, row_begin, row_end);
        return;
    }
    if (kr_legacy_tiled(weight_type)) {  // q4_0, q4_1, q5_0, q5_1: legacy_avx2.c
        kr_matmul_legacy_avx2(weight_type, w, cols, prepared, n_tokens, out, out_stride, row_begin, row_end);
        return;
    }
    if (kr_is_kquant(weight_type)) {  // kquant_avx2.c
        kr_matmul_kquant_avx2(weight_type, w, cols, prepared, n_tokens, out, out_stride, row_begin, row_end);
        return;
    }
    kr_matmul_row_tiles(weight_type, w, cols, prepared, n_tokens, out, out_stride, row_begin, row_end,
                        tile_rows(weight_type, n_tokens), 4, tile);
}

// ---------------------------------------------------------------------------------------------
// Packed q8_0 weights (kr_pack_rows; owner: speed): the group tiles above over whole groups of 8 rows,
// the file layout's tiles over the rows past the last group. Tile shape, groups x tokens
// (measured with krafla bench, pp512 at one thread): KR_PACKED_GROUPS x KR_PACKED_TOKENS for
// several tokens, 2 x 2 for AVX2 (2 x 2 ran 1.04x faster than 2 x 3 and 1.03x faster than 1 x 4;
// 1 x 4 spills registers) and 2 x 8 for ISA=avx512 (q8_avx512.c's 512-bit tiles: a step of 4 or 8
// Qwen2.5-Coder sequences, whose output head is q8_0, 6 to 8% less CPU time than 2 x 4 in 256-bit
// tiles), KR_ONE_TOKEN_GROUPS x 1 for one token (kernels.h: one stream from memory). The build can
// override them to measure others; the results are the same bits whatever the tile.
#ifndef KR_PACKED_GROUPS
#define KR_PACKED_GROUPS 2
#endif
#ifndef KR_PACKED_TOKENS
#if defined(KR_HAVE_AVX512)
#define KR_PACKED_TOKENS 8  // q8_avx512.c's 512-bit tiles (a lone group: 256-bit tiles of up to 4)
#else
#define KR_PACKED_TOKENS 2
#endif
#endif

// The avx512 build takes every tile of two groups from q8_avx512.c (0 measures the 256-bit ones).
#ifndef KR_Q8_PAIR_TILE
#define KR_Q8_PAIR_TILE 1
#endif

static void packed_tile(int32_t weight_type, int G, int T, const char *w, size_t group_stride, const char *a, size_t a_stride,
                        int64_t n_blocks, float *out, int64_t out_stride, int keep_begin, int keep_end, const char *next,
                        int resume) {
    (void)resume;  // never resumed: kr_slice_blocks cuts no type of these tiles into slices
    (void)weight_type;  // q8_0
#if defined(KR_HAVE_AVX512)
    if (G == 2 && KR_Q8_PAIR_TILE) {
        kr_q8_0_pair_tile_avx512(T, w, group_stride, a, a_stride, n_blocks, out, out_stride, keep_begin, keep_end, next);
        return;
    }
    if (T > 4) {
        kr_group_tile_by_fours(packed_tile, weight_type, G, T, w, group_stride, a, a_stride, n_blocks, out, out_stride,
                               keep_begin, keep_end, next, resume);
        return;
    }
#endif
#define CALL_GQ8(g, t) group_tile(g, t, w, group_stride, a, a_stride, n_blocks, out, out_stride, keep_begin, keep_end, next)
    KR_GROUP_SHAPES(CALL_GQ8)
}

void kr_matmul_packed_avx2(int32_t weight_type, const void *w, int64_t rows, int64_t cols, const void *prepared,
                           int64_t n_tokens, float *out, int64_t out_stride, int64_t row_begin, int64_t row_end) {
    if (kr_legacy_tiled(weight_type)) {  // q4_0, q4_1, q5_0, q5_1, iq4_nl, mxfp4: legacy_avx2.c
        kr_matmul_packed_legacy_avx2(weight_type, w, rows, cols, prepared, n_tokens, out, out_stride, row_begin, row_end);
        return;
    }
    if (kr_is_kquant(weight_type)) {  // kquant_avx2.c
        kr_matmul_packed_kquant_avx2(weight_type, w, rows, cols, prepared, n_tokens, out, out_stride, row_begin, row_end);
        return;
    }
    if (!kr_packable(weight_type)) {  // float weights: the file layout
        kr_matmul_avx2(weight_type, w, cols, prepared, n_tokens, out, out_stride, row_begin, row_end);
        return;
    }
    const int max_groups = n_tokens == 1 ? KR_ONE_TOKEN_GROUPS : KR_PACKED_GROUPS, max_tokens = n_tokens == 1 ? 1 : KR_PACKED_TOKENS;
    kr_matmul_group_tiles(weight_type, w, rows, cols, prepared, n_tokens, out, out_stride, row_begin, row_end, max_groups,
                          max_tokens, packed_tile, kr_matmul_avx2);
}

// ---------------------------------------------------------------------------------------------
// Vector kernels

float kr_dot_f32_avx2(const float *a, const float *b, int64_t n) {
    float out;
    tile_float(WEIGHTS_F32, 1, 1, (const char *)a, 0, (const char *)b, 0, n, &out, 0, NULL);
    return out;
}

float kr_dot_f16_f32_avx2(const kr_f16 *a, const float *b, int64_t n) {
    float out;
    tile_float(WEIGHTS_F16, 1, 1, (const char *)a, 0, (const char *)b, 0, n, &out, 0, NULL);
    return out;
}

void kr_axpy_f32_avx2(float a, const float *x, float *y, int64_t n) {
    const __m256 scale = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(scale, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
    for (; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}

void kr_axpy_f16_f32_avx2(float a, const kr_f16 *x, float *y, int64_t n) {
    const __m256 scale = _mm256_set1_ps(a);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 xv = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(x + i)));
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(scale, xv, _mm256_loadu_ps(y + i)));
    }
    for (; i < n; i++) y[i] = fmaf(a, f16_to_f32(x[i]), y[i]);
}

void kr_dot_rows_avx2(int32_t type, const void *rows, size_t row_stride, int64_t n_rows, const float *x, int64_t n, float *out) {
    // the matmul tiles with one token: each row goes through kr_dot_*'s exact sequence
    for (int64_t i = 0; i < n_rows; i += 4) {
        const int R = (int)(n_rows - i < 4 ? n_rows - i : 4);
        const char *first = (const char *)rows + (size_t)i * row_stride;
        const char *next = i + 4 < n_rows ? first + 4 * row_stride : NULL;
        tile(type == KR_F16 ? KR_F16 : KR_F32, R, 1, first, row_stride, (const char *)x, 0, n, out + i, 1, next);
    }
}

// y[e] = fma(weights[i], row_i[e], y[e]) for i in order; y is kept in registers across the rows,
// `width` vectors of 8 at a time.
KR_INLINE void axpy_rows_chunk(const int half, const int width, const float *weights, const char *rows, size_t row_stride,
                               int64_t n_rows, float *y) {
    __m256 acc[4];
#pragma GCC unroll 4
    for (int v = 0; v < width; v++) acc[v] = _mm256_loadu_ps(y + 8 * v);
    for (int64_t i = 0; i < n_rows; i++) {
        const __m256 weight = _mm256_set1_ps(weights[i]);
        const char *row = rows + (size_t)i * row_stride;
#pragma GCC unroll 4
        for (int v = 0; v < width; v++) {
            const __m256 value = half ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const kr_f16 *)row + 8 * v)))
                                      : _mm256_loadu_ps((const float *)row + 8 * v);
            acc[v] = _mm256_fmadd_ps(weight, value, acc[v]);
        }
    }
#pragma GCC unroll 4
    for (int v = 0; v < width; v++) _mm256_storeu_ps(y + 8 * v, acc[v]);
}

// KV cache q8_0 (owner: speed): one block of 32 values at a time, y in registers across the rows;
// per element fma(weight * d, (float)q, y), the reference's operations.
static void axpy_rows_q8_0(const float *weights, const char *rows, size_t row_stride, int64_t n_rows, float *y, int64_t n) {
    for (int64_t b = 0; b < n / KR_QK; b++) {
        __m256 acc[4];
        for (int v = 0; v < 4; v++) acc[v] = _mm256_loadu_ps(y + b * KR_QK + 8 * v);
        for (int64_t i = 0; i < n_rows; i++) {
            const kr_block_q8_0 *block = (const kr_block_q8_0 *)(rows + (size_t)i * row_stride) + b;
            const __m256 scale = _mm256_set1_ps(weights[i] * f16_to_f32(block->d));
            for (int v = 0; v < 4; v++) {
                const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(block->q + 8 * v))));
                acc[v] = _mm256_fmadd_ps(scale, q, acc[v]);
            }
        }
        for (int v = 0; v < 4; v++) _mm256_storeu_ps(y + b * KR_QK + 8 * v, acc[v]);
    }
}

void kr_axpy_rows_avx2(int32_t type, const float *weights, const void *rows, size_t row_stride, int64_t n_rows, float *y,
                       int64_t n) {
    if (type == KR_Q8_0) {
        axpy_rows_q8_0(weights, rows, row_stride, n_rows, y, n);
        return;
    }
    const int half = type == KR_F16;
    const size_t elem = half ? 2 : 4;
    int64_t e = 0;
    for (; e + 32 <= n; e += 32) {
        if (half) axpy_rows_chunk(1, 4, weights, (const char *)rows + e * elem, row_stride, n_rows, y + e);
        else axpy_rows_chunk(0, 4, weights, (const char *)rows + e * elem, row_stride, n_rows, y + e);
    }
    for (; e + 8 <= n; e += 8) {
        if (half) axpy_rows_chunk(1, 1, weights, (const char *)rows + e * elem, row_stride, n_rows, y + e);
        else axpy_rows_chunk(0, 1, weights, (const char *)rows + e * elem, row_stride, n_rows, y + e);
    }
    for (; e < n; e++) {
        float sum = y[e];
        for (int64_t i = 0; i < n_rows; i++) {
            const char *row = (const char *)rows + (size_t)i * row_stride;
            sum = fmaf(weights[i], half ? f16_to_f32(((const kr_f16 *)row)[e]) : ((const float *)row)[e], sum);
        }
        y[e] = sum;
    }
}

// ---------------------------------------------------------------------------------------------
// exp and the functions built on it: kr_exp_one_ref's operations, 8 at a time

KR_INLINE __m256 exp8(__m256 x) {
    const __m256 c = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-104.0f)), _mm256_set1_ps(89.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(c, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-0.693145752f), c);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-1.42860677e-06f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    // e / 2 truncated toward zero, as C's integer division
    const __m256i e = _mm256_cvtps_epi32(n);
    const __m256i e1 = _mm256_cvtps_epi32(_mm256_round_ps(_mm256_mul_ps(n, _mm256_set1_ps(0.5f)), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC));
    const __m256i e2 = _mm256_sub_epi32(e, e1);
    const __m256i bias = _mm256_set1_epi32(127);
    const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e1, bias), 23));
    const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e2, bias), 23));
    const __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
    return _mm256_blendv_ps(y, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));  // NaN stays itself
}

void kr_exp_f32_avx2(const float *x, float *y, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, exp8(_mm256_loadu_ps(x + i)));
    for (; i < n; i++) y[i] = kr_exp_one_ref(x[i]);
}

float kr_exp_shift_sum_f32_avx2(float *x, int64_t n, float shift) {
    const __m256 shift8 = _mm256_set1_ps(shift);
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), shift8));
        _mm256_storeu_ps(x + i, e);
        acc = _mm256_add_ps(acc, e);
    }
    float sum = hsum8(acc);
    for (; i < n; i++) {
        x[i] = kr_exp_one_ref(x[i] - shift);
        sum += x[i];
    }
    return sum;
}

// Two passes over a row that stays in cache: the greatest value (and whether any is NaN or +inf:
// not less than +inf), then the first id holding it. The maximum is a value of the row, so the
// search finds it; -0 and +0 compare equal, as in the reference.
int64_t kr_argmax_f32_avx2(const float *x, int64_t n) {
    if (n <= 0) return -1;
    const __m256 inf = _mm256_set1_ps(INFINITY);
    __m256 best = _mm256_set1_ps(-INFINITY), bad = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        bad = _mm256_or_ps(bad, _mm256_cmp_ps(v, inf, _CMP_NLT_UQ));
        best = _mm256_max_ps(best, v);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, best);
    float top = lanes[0];
    for (int j = 1; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
    int any_bad = _mm256_movemask_ps(bad) != 0;
    for (int64_t k = i; k < n; k++) {
        any_bad |= !(x[k] < INFINITY);
        top = x[k] > top ? x[k] : top;
    }
    if (any_bad || top == -INFINITY) return -1;
    const __m256 top8 = _mm256_set1_ps(top);
    for (i = 0; i + 8 <= n; i += 8) {
        const int hits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), top8, _CMP_EQ_OQ));
        if (hits) return i + __builtin_ctz((unsigned)hits);
    }
    for (; i < n; i++)
        if (x[i] == top) return i;
    return -1;  // not reached: top is one of the values
}

void kr_silu_mul_f32_avx2(float *gate, const float *up, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_xor_ps(g, sign))));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
    if (i < n) kr_silu_mul_f32_ref(gate + i, up + i, n - i);
}

void kr_gelu_tanh_mul_f32_avx2(float *gate, const float *up, int64_t n) {
    const __m256 one = _mm256_set1_ps(1.0f), two = _mm256_set1_ps(2.0f), half = _mm256_set1_ps(0.5f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 inner = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(0.044715f), g), _mm256_mul_ps(g, g), g);
        const __m256 z = _mm256_mul_ps(_mm256_set1_ps(0.797884583f), inner);
        const __m256 t = _mm256_sub_ps(one, _mm256_div_ps(two, _mm256_add_ps(exp8(_mm256_mul_ps(two, z)), one)));
        const __m256 gelu = _mm256_mul_ps(_mm256_mul_ps(half, g), _mm256_add_ps(one, t));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(gelu, _mm256_loadu_ps(up + i)));
    }
    if (i < n) kr_gelu_tanh_mul_f32_ref(gate + i, up + i, n - i);
}

#else
typedef int kr_kernels_avx2_not_built;  // ISA=generic: this file is empty
#endif
