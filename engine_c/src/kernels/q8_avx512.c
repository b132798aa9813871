// q8_avx512.c: the ISA=avx512 build's 512-bit packed tile for q8_0 weights (kernels_avx2.c hands it
// every tile of two groups of 8 rows).
//
// 1 to 8 tokens over two packed groups at once, the first group's 32-byte chunk in the low half of
// a 512-bit vector and the second's in the high half (tiles_avx512.h), each chunk loaded once for
// all the tokens. VNNI multiplies unsigned by signed bytes, and AVX-512 has no byte sign-flip for
// the 256-bit tiles' trick (|w| times a with w's sign), so the activations go in unsigned, shifted
// by 128 (a + 128 in 1..255, one scalar xor per broadcast), and each block takes 128 times its
// weights' sum back out: sum((a + 128) w) - 128 sum(w) = sum(a w), exact in int32 (at most
// 32 * 255 * 128 in size). After that every lane runs quant_ref.c's per-block sequence, one fused
// multiply-add with d_w * d_a, so the bits are those of every other build.
#include "kernels/kernels.h"
#include "krafla.h"

#if defined(KR_HAVE_AVX512)
#include "kernels/tiles_avx512.h"

#define GROUP_BLOCK (KR_PACK_ROWS * sizeof(kr_block_q8_0))  // 16 bytes of scales, then 8 chunks of 32

// Token t's prepared block b.
static inline const kr_block_q8_0 *activation(const char *a, size_t a_stride, int t, int64_t b) {
    return (const kr_block_q8_0 *)(a + t * a_stride) + b;
}

static inline __attribute__((always_inline)) void pair_tile(const int T, const char *w, size_t group_stride,
                                                             const char *a, size_t a_stride, int64_t n_blocks,
                                                             float *out, int64_t out_stride, int keep_begin,
                                                             int keep_end, const char *next) {
    const __m512i ones = _mm512_set1_epi8(1);
    __m512 acc[8] = {0};  // T of them used
    for (int64_t b = 0; b < n_blocks; b++) {
        const char *first = w + (size_t)b * GROUP_BLOCK, *second = first + group_stride;
        if (next) kr_prefetch_pair(next, group_stride, GROUP_BLOCK, b);
        __m512i weight_sums = _mm512_setzero_si512(), sums[8];
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) sums[t] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            const __m512i chunk = kr_load_pair(first + 16 + 32 * i, second + 16 + 32 * i);
            weight_sums = _mm512_dpbusd_epi32(weight_sums, ones, chunk);
#pragma GCC unroll 8
            for (int t = 0; t < T; t++) {
                uint32_t a4;
                __builtin_memcpy(&a4, activation(a, a_stride, t, b)->q + 4 * i, 4);
                sums[t] = _mm512_dpbusd_epi32(sums[t], _mm512_set1_epi32((int32_t)(a4 ^ 0x80808080u)), chunk);
            }
        }
        const __m512 w_scale = kr_scales_pair(first, second);
        const __m512i shift_back = _mm512_slli_epi32(weight_sums, 7);
#pragma GCC unroll 8
        for (int t = 0; t < T; t++) {
            const __m512 a_scale = _mm512_set1_ps(_cvtsh_ss(activation(a, a_stride, t, b)->d));
            const __m512i total = _mm512_sub_epi32(sums[t], shift_back);
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(w_scale, a_scale), _mm512_cvtepi32_ps(total), acc[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < T; t++) kr_store_pair(out + t * out_stride, acc[t], keep_begin, keep_end);
}

void kr_q8_0_pair_tile_avx512(int T, const char *w, size_t group_stride, const char *a, size_t a_stride,
                              int64_t n_blocks, float *out, int64_t out_stride, int keep_begin, int keep_end,
                              const char *next) {
    switch (T) {
#define CASE(t) case t: pair_tile(t, w, group_stride, a, a_stride, n_blocks, out, out_stride, keep_begin, keep_end, next); break;
    CASE(1) CASE(2) CASE(3) CASE(4) CASE(5) CASE(6) CASE(7)
    default: pair_tile(8, w, group_stride, a, a_stride, n_blocks, out, out_stride, keep_begin, keep_end, next); break;
#undef CASE
    }
}

#else
typedef int kr_q8_avx512_not_built;  // ISA=generic and ISA=avx2: this file is empty
#endif
