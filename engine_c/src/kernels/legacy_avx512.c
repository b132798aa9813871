// legacy_avx512.c: the ISA=avx512 build's 512-bit tile for q4_0, q4_1, q5_0, q5_1, iq4_nl and
// mxfp4 (legacy.h).
//
// 1 to 8 tokens over two packed groups of 8 rows at once: the first group's 32-byte chunk in the
// low half of a 512-bit vector, the second's in the high half, so the 16 lanes are 16 rows and
// each VNNI instruction does the work of two 256-bit ones; each chunk is unpacked once for all the
// tokens. Every lane goes through legacy_ref.c's per-block sequence (quant_ref.c's for q4_0,
// lowbit_ref.c's for the grid types: exact integer sums, then the fused multiply-adds), so the bits
// are those of every other build. The grid types' quants are their grid's values + 128, looked up
// by one byte shuffle, and 128 * sum(a) is subtracted as q4_0's 8 * sum(a).
// Measured for q4_0 at one thread: a step of 4 or 8 Qwen2.5-Coder sequences about 20% less CPU time
// than the 256-bit 2 x 4 tiles. One-token steps take the 256-bit tiles of one group instead
// (kernels.h, KR_ONE_TOKEN_GROUPS): on a cold matrix they stream from memory twice as fast.
#include "kernels/legacy.h"
#include "krafla.h"

#if defined(KR_HAVE_AVX512)
#include "kernels/tiles_avx512.h"

// T tokens (1 to 8) over the pair: each chunk of quants is unpacked once and serves every token.
static inline __attribute__((always_inline)) void pair_tile(const int32_t type, const int T, const char *w,
                                                             size_t group_stride, const char *a, size_t a_stride,
                                                             int64_t n_blocks, float *out, int64_t out_stride,
                                                             int keep_begin, int keep_end, const char *next) {
    const size_t group_block_bytes = kr_legacy_group_block_bytes(type);
    const int with_min = kr_legacy_has_min(type), with_fifth = kr_legacy_has_fifth(type), with_grid = kr_legacy_grid_type(type);
    const int32_t offset = with_grid ? 128 : kr_legacy_offset(type);
    const __m512i grid = with_grid ? _mm512_xor_si512(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)kr_legacy_grid(type))),
                                                      _mm512_set1_epi8((char)0x80))
                                   : _mm512_setzero_si512();
    const size_t fifth_at = kr_legacy_packed_fifth(type), nibbles_at = kr_legacy_packed_nibbles(type);
    const __m512i low4 = _mm512_set1_epi8(0x0f), bit4 = _mm512_set1_epi8(0x10);
    __m512 acc[8] = {0};  // T of them used
    for (int64_t b = 0; b < n_blocks; b++) {
        const char *first = w + (size_t)b * group_block_bytes, *second = first + group_stride;
        const kr_block_q8_sum *ab[8];
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) ab[t] = (const kr_block_q8_sum *)(a + t * a_stride) + b;
        if (next) kr_prefetch_pair(next, group_stride, group_block_bytes, b);
        const __m512i bits = with_fifth ? kr_load_pair(first + fifth_at, second + fifth_at) : _mm512_setzero_si512();
        // One token: low and high quants in two accumulators, two short dependency chains instead of
        // one long; several tokens are chains enough, and their registers are needed.
        const int chains = T == 1 ? 2 : 1;
        __m512i sums[8][2];
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) sums[t][0] = sums[t][chains - 1] = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const __m512i chunk = kr_load_pair(first + nibbles_at + 32 * i, second + nibbles_at + 32 * i);
            __m512i low, high;
            if (with_fifth) {
                // bit i of each byte of `bits` is the fifth bit of the low quants, bit 4 + i of the high
                // ones; (nibble & 0x0f) | fifth bit in one ternary-logic step
                const __m512i low_bit = _mm512_and_si512(_mm512_slli_epi16(bits, 4 - i), bit4);
                const __m512i high_bit = _mm512_and_si512(i == 0 ? bits : _mm512_srli_epi16(bits, i), bit4);
                low = _mm512_ternarylogic_epi32(chunk, low4, low_bit, 0xEA);
                high = _mm512_ternarylogic_epi32(_mm512_srli_epi16(chunk, 4), low4, high_bit, 0xEA);
            } else if (with_grid) {
                low = _mm512_shuffle_epi8(grid, _mm512_and_si512(chunk, low4));
                high = _mm512_shuffle_epi8(grid, _mm512_and_si512(_mm512_srli_epi16(chunk, 4), low4));
            } else {
                low = _mm512_and_si512(chunk, low4);
                high = _mm512_and_si512(_mm512_srli_epi16(chunk, 4), low4);
            }
#pragma GCC unroll 8
            for (int t = 0; t < T; t++) {
                int32_t a_low, a_high;
                __builtin_memcpy(&a_low, ab[t]->q + 4 * i, 4);
                __builtin_memcpy(&a_high, ab[t]->q + 16 + 4 * i, 4);
                sums[t][0] = _mm512_dpbusd_epi32(sums[t][0], low, _mm512_set1_epi32(a_low));
                sums[t][chains - 1] = _mm512_dpbusd_epi32(sums[t][chains - 1], high, _mm512_set1_epi32(a_high));
            }
        }
        const __m512 w_scale = type == KR_MXFP4 ? kr_e8m0_pair(first, second) : kr_scales_pair(first, second);
        const __m512 w_min = with_min ? kr_scales_pair(first + KR_LEGACY_PACKED_MINS, second + KR_LEGACY_PACKED_MINS) : w_scale;
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            __m512i total = chains == 2 ? _mm512_add_epi32(sums[t][0], sums[t][1]) : sums[t][0];
            if (offset) total = _mm512_sub_epi32(total, _mm512_set1_epi32(offset * ab[t]->sum));
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(w_scale, _mm512_set1_ps(ab[t]->d)), _mm512_cvtepi32_ps(total), acc[t]);
            if (with_min) acc[t] = _mm512_fmadd_ps(w_min, _mm512_set1_ps(ab[t]->d * (float)ab[t]->sum), acc[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < T; t++) kr_store_pair(out + t * out_stride, acc[t], keep_begin, keep_end);
}

// One instance per (type, token count): the loops need both as constants.
#define PAIR_TILE_TOKENS(TYPE) \
    switch (T) { \
    case 1: pair_tile(TYPE, 1, w, group_stride, a, a_stride, n_blocks, out, out_stride, keep_begin, keep_end, next); break; \
    case 2: pair_tile(TYPE, 2, w, group_stride, a, a_stride, n_blocks, out, out_stride, keep_begin, keep_end, next); break; \
    case 3: pair_tile(TYPE, 3, w, group_stride, a, a_stride, n_blocks, out, out_stride, keep_begin, keep_end, next); break; \
    case 4: pair_tile(TYPE, 4, w, group_stride, a, a_stride, n_blocks, out, out_stride, keep_begin, keep_end, next); break; \
    case 5: pair_tile(TYPE, 5, w, group_stride, a, a_stride, n_blocks, out, out_stride, keep_begin, keep_end, next); break; \
    case 6: pair_tile(TYPE, 6, w, group_stride, a, a_stride, n_blocks, out, out_stride, keep_begin, keep_end, next); break; \
    case 7: pair_tile(TYPE, 7, w, group_stride, a, a_stride, n_blocks, out, out_stride, keep_begin, keep_end, next); break; \
    default: pair_tile(TYPE, 8, w, group_stride, a, a_stride, n_blocks, out, out_stride, keep_begin, keep_end, next); break; \
    }

void kr_legacy_pair_tile_avx512(int32_t type, int T, const char *w, size_t group_stride, const char *a, size_t a_stride,
                                int64_t n_blocks, float *out, int64_t out_stride, int keep_begin, int keep_end,
                                const char *next) {
    switch (type) {
    case KR_Q4_0: PAIR_TILE_TOKENS(KR_Q4_0) break;
    case KR_Q4_1: PAIR_TILE_TOKENS(KR_Q4_1) break;
    case KR_Q5_0: PAIR_TILE_TOKENS(KR_Q5_0) break;
    case KR_Q5_1: PAIR_TILE_TOKENS(KR_Q5_1) break;
    case KR_IQ4_NL: PAIR_TILE_TOKENS(KR_IQ4_NL) break;
    default: PAIR_TILE_TOKENS(KR_MXFP4) break;
    }
}

#else
typedef int kr_legacy_avx512_not_built;  // ISA=generic and ISA=avx2: this file is empty
#endif
