// lowbit_avx2.c: the low-bit weight matmul (lowbit.h: q2_K, q3_K, iq4_xs, iq4_nl, mxfp4) with AVX2
// intrinsics, file layout. A tile is R <= 4 rows x T <= 4 tokens: per block each row is decoded
// once into bytes (the grids by one shuffle of the nibbles; for one token a super-block's sums are
// formed straight from its bytes instead), every token's integer sums are formed against it, 4
// rows' sums are added up together, and each token takes its 4 rows' fused multiply-adds in the
// lanes of one 128-bit vector: lowbit_ref.c's float steps, lane by lane.
//
// The ISA=avx512 build compiles this file too: the decoded super-blocks' sums run 64 weights per
// 512-bit step, the blocks of 32 take VNNI's dpbusd. The integer sums are exact either way, so every
// build gives the reference's bits.
#include "kernels/lowbit.h"
#include "krafla.h"

#if defined(KR_HAVE_AVX2)
#include "kernels/tiles_avx2.h"

#include <string.h>

// ---------------------------------------------------------------------------------------------
// Decoding one block: the reference's kr_lowbit_block, vector by vector

// 16 nibbles -> 32 bytes in element order (low nibbles first), each looked up in a 16-entry grid.
KR_INLINE __m256i grid_nibbles(const uint8_t *qs, __m256i grid) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)qs), low4 = _mm_set1_epi8(0x0f);
    const __m256i nibbles = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(bytes, 4), low4), _mm_and_si128(bytes, low4));
    return _mm256_shuffle_epi8(grid, nibbles);
}

KR_INLINE __m256i grid_of(const int8_t values[16]) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)values));
}

// Weights 32c..32c+31 of a super-block as signed bytes: for q2_K and q3_K bits 2s..2s+1 of qs[32h + l]
// (c = 4h + s), q3_K taking 4 unless bit c of hmask[l] is set; for iq4_xs sub-block c's nibbles in the grid.
KR_INLINE __m256i super_chunk(const int32_t type, const char *block, const int c, const __m256i grid) {
    if (type == KR_IQ4_XS) return grid_nibbles(((const kr_block_iq4_xs *)block)->qs + 16 * c, grid);
    const uint8_t *qs = type == KR_Q2_K ? ((const kr_block_q2_K *)block)->qs : ((const kr_block_q3_K *)block)->qs;
    const __m256i bits = _mm256_loadu_si256((const __m256i *)(qs + 32 * (c / 4)));
    __m256i value = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * (c % 4)), _mm256_set1_epi8(3));
    if (type == KR_Q3_K) {
        const __m256i hmask = _mm256_loadu_si256((const __m256i *)((const kr_block_q3_K *)block)->hmask);
        const __m256i unset = _mm256_andnot_si256(_mm256_srli_epi16(hmask, c), _mm256_set1_epi8(1));
        value = _mm256_sub_epi8(value, _mm256_slli_epi16(unset, 2));
    }
    return value;
}

// The 16 scales of a super-block as signed bytes; d (and q2_K's dmin and mins, else 0) into `out`.
KR_INLINE __m128i super_scales(const int32_t type, const char *block, kr_lowbit_block *out) {
    const __m128i low4 = _mm_set1_epi8(0x0f);
    if (type == KR_Q2_K) {
        const kr_block_q2_K *b = (const kr_block_q2_K *)block;
        const __m128i packed = _mm_loadu_si128((const __m128i *)b->scales);
        _mm256_store_si256((__m256i *)out->min, _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(packed, 4), low4)));
        out->d = f16_to_f32(b->d);
        out->dmin = f16_to_f32(b->dmin);
        return _mm_and_si128(packed, low4);
    }
    memset(out->min, 0, sizeof out->min);
    out->dmin = 0.0f;
    if (type == KR_Q3_K) {
        const kr_block_q3_K *b = (const kr_block_q3_K *)block;
        // scale j: the low nibble (j < 8) or high nibble of byte j % 8, over bits 2(j/4).. of byte 8 + j % 4
        const __m128i packed = _mm_loadl_epi64((const __m128i *)b->scales);
        int32_t tops;
        memcpy(&tops, b->scales + 8, 4);
        const __m128i low = _mm_unpacklo_epi64(_mm_and_si128(packed, low4), _mm_and_si128(_mm_srli_epi16(packed, 4), low4));
        const __m128i top = _mm_and_si128(_mm_srlv_epi32(_mm_set1_epi32(tops), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
        out->d = f16_to_f32(b->d);
        return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(top, 4)), _mm_set1_epi8(32));
    }
    // byte i: sub-block j = i / 2's scale, its low 4 bits nibble j of scales_l, its top 2 bits 2j.. of scales_h
    const kr_block_iq4_xs *b = (const kr_block_iq4_xs *)block;
    const __m128i odd = _mm_setr_epi8(0, 0, -1, -1, 0, 0, -1, -1, 0, 0, -1, -1, 0, 0, -1, -1), three = _mm_set1_epi8(3);
    int32_t packed;
    memcpy(&packed, b->scales_l, 4);
    const __m128i nibbles = _mm_shuffle_epi8(_mm_cvtsi32_si128(packed), _mm_setr_epi8(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
    const __m128i low = _mm_blendv_epi8(_mm_and_si128(nibbles, low4), _mm_and_si128(_mm_srli_epi16(nibbles, 4), low4), odd);
    // 32-bit lane L: scales_h >> 4L, whose bits 0..1 top sub-block 2L's scale and bits 2..3 sub-block 2L + 1's
    const __m128i tops = _mm_srlv_epi32(_mm_set1_epi32(b->scales_h), _mm_setr_epi32(0, 4, 8, 12));
    const __m128i spread = _mm_shuffle_epi8(tops, _mm_setr_epi8(0, 0, 0, 0, 4, 4, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12));
    const __m128i top = _mm_blendv_epi8(_mm_and_si128(spread, three), _mm_and_si128(_mm_srli_epi16(spread, 2), three), odd);
    out->d = f16_to_f32(b->d);
    return _mm_sub_epi8(_mm_or_si128(low, _mm_slli_epi16(top, 4)), _mm_set1_epi8(32));
}

// scale_lanes[c]: scale[2c] in the low 8 int16, scale[2c + 1] in the high 8 (the madd pairs of chunk c).
KR_INLINE __m256i scale_lane(__m128i scales, const int c) {
    const __m128i pick = _mm_unpacklo_epi64(_mm_set1_epi8((char)(2 * c)), _mm_set1_epi8((char)(2 * c + 1)));
    return _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scales, pick));
}

// Several tokens: each row's super-block decoded once into kr_lowbit_block.
KR_INLINE void decode_super(const int32_t type, const char *block, kr_lowbit_block *out) {
    const __m256i grid = grid_of(kr_kvalues_iq4nl);
    const __m128i scales = super_scales(type, block, out);
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        _mm256_store_si256((__m256i *)(out->q + 32 * c), super_chunk(type, block, c, grid));
        _mm256_store_si256((__m256i *)out->scale_lanes[c], scale_lane(scales, c));
    }
}

// The products of 32 weights q and activations a, in int16 pairs (|q| times a with q's sign: a pair is
// at most 2 * 127 * 127 < 32767; q2_K's weights are unsigned already).
KR_INLINE __m256i product_pairs(const int32_t type, __m256i q, __m256i a) {
    return type == KR_Q2_K ? _mm256_maddubs_epi16(q, a) : _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(a, q));
}

// One token: a row's super-block straight from its bytes, no decoded copy (generation). The same
// integer sums as super_sums below, in 8 int32 lanes.
KR_INLINE __m256i super_sums_direct(const int32_t type, const char *block, const int8_t *a, kr_lowbit_block *scalars) {
    const __m256i grid = grid_of(kr_kvalues_iq4nl);
    const __m128i scales = super_scales(type, block, scalars);
    __m256i acc = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        const __m256i pairs = product_pairs(type, super_chunk(type, block, c, grid), _mm256_loadu_si256((const __m256i *)(a + 32 * c)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, scale_lane(scales, c)));
    }
    return acc;
}

// ---------------------------------------------------------------------------------------------
// Integer sums of one row's decoded super-block against one token's q8_K block, in 8 int32 lanes
// (their total is isum): the products in pairs, then the pairs times the sub-block scales.

#if defined(KR_HAVE_AVX512)
KR_INLINE __m256i super_sums(const int32_t type, const kr_lowbit_block *w, const int8_t *a) {
    __m512i acc = _mm512_setzero_si512();
    for (int k = 0; k < 4; k++) {
        const __m512i q = _mm512_loadu_si512((const void *)(w->q + 64 * k));
        __m512i x = _mm512_loadu_si512((const void *)(a + 64 * k)), u = q;
        if (type != KR_Q2_K) {
            x = _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(q), _mm512_setzero_si512(), x);
            u = _mm512_abs_epi8(q);
        }
        const __m512i pairs = _mm512_maddubs_epi16(u, x);
        acc = _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_loadu_si512((const void *)w->scale_lanes[2 * k])));
    }
    return _mm256_add_epi32(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
}
#else
KR_INLINE __m256i super_sums(const int32_t type, const kr_lowbit_block *w, const int8_t *a) {
    __m256i acc = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {
        const __m256i q = _mm256_load_si256((const __m256i *)(w->q + 32 * c));
        const __m256i x = _mm256_loadu_si256((const __m256i *)(a + 32 * c));
        const __m256i pairs = product_pairs(type, q, x);
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_load_si256((const __m256i *)w->scale_lanes[c])));
    }
    return acc;
}
#endif

// q2_K's msum: the mins times the activations' sums of 16, in 8 int32 lanes.
KR_INLINE __m256i min_sums(const kr_lowbit_block *w, const kr_block_q8_K *a) {
    return _mm256_madd_epi16(_mm256_load_si256((const __m256i *)w->min), _mm256_loadu_si256((const __m256i *)a->bsums));
}

// The 32 products of one block of 32 (q, and u = |q|) against one token's block, in 8 int32 lanes.
KR_INLINE __m256i block_sums(__m256i q, __m256i u, const int8_t *a) {
    const __m256i x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)a), q);
#if defined(KR_HAVE_AVX512)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
#endif
}

// ---------------------------------------------------------------------------------------------
// Tiles

KR_INLINE void tile_super(const int32_t type, const int R, const int T, const char *w, size_t w_stride, const char *a,
                          size_t a_stride, int64_t n_blocks, float *out, int64_t out_stride, const char *next) {
    const size_t block_bytes = kr_lowbit_block_bytes(type);
    kr_lowbit_block decoded[4];
    __m128 acc[4];
    for (int t = 0; t < T; t++) acc[t] = _mm_setzero_ps();
    for (int64_t b = 0; b < n_blocks; b++) {
        float d[4] = {0}, dmin[4] = {0};
        __m256i direct[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
        for (int r = 0; r < R; r++) {
            const char *block = w + (size_t)r * w_stride + (size_t)b * block_bytes;
            if (next) _mm_prefetch(next + (size_t)r * w_stride + (size_t)b * block_bytes, _MM_HINT_T0);
            if (T == 1)
                direct[r] = super_sums_direct(type, block, ((const kr_block_q8_K *)a + b)->q, &decoded[r]);
            else
                decode_super(type, block, &decoded[r]);
            d[r] = decoded[r].d;
            dmin[r] = decoded[r].dmin;
        }
        const __m128 dw = _mm_loadu_ps(d), dminw = _mm_loadu_ps(dmin);
        for (int t = 0; t < T; t++) {
            const kr_block_q8_K *x = (const kr_block_q8_K *)(a + (size_t)t * a_stride) + b;
            __m256i sums[4] = {direct[0], direct[1], direct[2], direct[3]};
            if (T > 1)
                for (int r = 0; r < R; r++) sums[r] = super_sums(type, &decoded[r], x->q);
            const __m128 da = _mm_set1_ps(x->d);
            acc[t] = _mm_fmadd_ps(_mm_mul_ps(dw, da), _mm_cvtepi32_ps(sum4_epi32(sums[0], sums[1], sums[2], sums[3])), acc[t]);
            if (type == KR_Q2_K) {
                __m256i mins[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
                for (int r = 0; r < R; r++) mins[r] = min_sums(&decoded[r], x);
                acc[t] = _mm_fnmadd_ps(_mm_mul_ps(dminw, da), _mm_cvtepi32_ps(sum4_epi32(mins[0], mins[1], mins[2], mins[3])), acc[t]);
            }
        }
    }
    store_rows(R, T, acc, out, out_stride);
}

KR_INLINE void tile_32(const int32_t type, const int R, const int T, const char *w, size_t w_stride, const char *a,
                       size_t a_stride, int64_t n_blocks, float *out, int64_t out_stride, const char *next) {
    const size_t block_bytes = kr_lowbit_block_bytes(type);
    const __m256i grid = grid_of(type == KR_MXFP4 ? kr_kvalues_mxfp4 : kr_kvalues_iq4nl);
    __m128 acc[4];
    for (int t = 0; t < T; t++) acc[t] = _mm_setzero_ps();
    for (int64_t b = 0; b < n_blocks; b++) {
        __m256i q[4], u[4];
        float d[4] = {0};
        for (int r = 0; r < R; r++) {
            const char *block = w + (size_t)r * w_stride + (size_t)b * block_bytes;
            if (next && b % 4 == 0) _mm_prefetch(next + (size_t)r * w_stride + (size_t)b * block_bytes, _MM_HINT_T0);
            if (type == KR_MXFP4) {
                q[r] = grid_nibbles(((const kr_block_mxfp4 *)block)->qs, grid);
                d[r] = kr_e8m0_half(((const kr_block_mxfp4 *)block)->e);
            } else {
                q[r] = grid_nibbles(((const kr_block_iq4_nl *)block)->qs, grid);
                d[r] = f16_to_f32(((const kr_block_iq4_nl *)block)->d);
            }
            u[r] = _mm256_abs_epi8(q[r]);
        }
        const __m128 dw = _mm_loadu_ps(d);
        for (int t = 0; t < T; t++) {
            const kr_block_q8_sum *x = (const kr_block_q8_sum *)(a + (size_t)t * a_stride) + b;
            __m256i sums[4] = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256()};
            for (int r = 0; r < R; r++) sums[r] = block_sums(q[r], u[r], x->q);
            acc[t] = _mm_fmadd_ps(_mm_mul_ps(dw, _mm_set1_ps(x->d)), _mm_cvtepi32_ps(sum4_epi32(sums[0], sums[1], sums[2], sums[3])),
                                  acc[t]);
        }
    }
    store_rows(R, T, acc, out, out_stride);
}

static void tile(int32_t type, int R, int T, const char *w, size_t w_stride, const char *a, size_t a_stride,
                 int64_t n_blocks, float *out, int64_t out_stride, const char *next) {
    switch (type) {
    case KR_Q2_K: tile_super(KR_Q2_K, R, T, w, w_stride, a, a_stride, n_blocks, out, out_stride, next); break;
    case KR_Q3_K: tile_super(KR_Q3_K, R, T, w, w_stride, a, a_stride, n_blocks, out, out_stride, next); break;
    case KR_IQ4_XS: tile_super(KR_IQ4_XS, R, T, w, w_stride, a, a_stride, n_blocks, out, out_stride, next); break;
    case KR_IQ4_NL: tile_32(KR_IQ4_NL, R, T, w, w_stride, a, a_stride, n_blocks, out, out_stride, next); break;
    case KR_MXFP4: tile_32(KR_MXFP4, R, T, w, w_stride, a, a_stride, n_blocks, out, out_stride, next); break;
    default: break;
    }
}

void kr_matmul_lowbit_avx2(int32_t weight_type, const void *w, int64_t cols, const void *prepared, int64_t n_tokens,
                           float *out, int64_t out_stride, int64_t row_begin, int64_t row_end) {
    kr_matmul_row_tiles(weight_type, w, cols, prepared, n_tokens, out, out_stride, row_begin, row_end, 4, 4, tile);
}

#else
typedef int kr_lowbit_avx2_not_built;  // ISA=generic: this file is empty
#endif
