// kernels_avx512.c: the AVX-512 kernels of the ISA=avx512 build (kernels_avx512.h); the rest of
// that build's kernels are kernels_avx2.c's, compiled with VNNI block sums.
#include "kernels/kernels.h"

#if defined(KR_HAVE_AVX512)
#include "kernels/kernels_avx512.h"

#define Q4_GROUP_BLOCK (KR_PACK_ROWS * sizeof(kr_block_q4_0))  // 144 bytes: 16 of scales, 4 chunks

// ISA=avx512, one token (generation): two groups of q4_0 rows in the 16 lanes of one 512-bit
// vector (the first group's chunk in the low half, the second's in the high half), so each
// instruction does the work of two 256-bit ones: the same integer sums and the same fused
// multiply-add per lane, so the same bits. Stores the 16 rows of [keep_begin, keep_end).
// Measured with krafla bench at one thread on SmolLM2: tg32 +15 to 25% over the 256-bit
// tiles; for the prompt (T = 4 to 8) 3 to 7% slower than the 256-bit 2 x 4 tile, which is used there.
void kr_pair_tile_q4_0_avx512(const char *w, size_t group_stride, const char *a, int64_t n_blocks, float *out,
                              int keep_begin, int keep_end, const char *next) {
    const __m512i low4 = _mm512_set1_epi8(0x0f);
    __m512 acc = _mm512_setzero_ps();
    for (int64_t b = 0; b < n_blocks; b++) {
        const char *first = w + (size_t)b * Q4_GROUP_BLOCK, *second = first + group_stride;
        const kr_block_q8_sum *ab = (const kr_block_q8_sum *)a + b;
        if (next)
            for (int line = 0; line < 2 * (int)Q4_GROUP_BLOCK; line += 64)
                _mm_prefetch(next + (line < (int)Q4_GROUP_BLOCK ? 0 : group_stride - Q4_GROUP_BLOCK) + (size_t)b * Q4_GROUP_BLOCK + line,
                             _MM_HINT_T0);
        // low and high nibbles in two accumulators: two short dependency chains instead of one long
        __m512i low_sums = _mm512_setzero_si512(), high_sums = _mm512_setzero_si512();
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const __m512i chunk = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(first + 16 + 32 * i))),
                _mm256_loadu_si256((const __m256i *)(second + 16 + 32 * i)), 1);
            int32_t a_low, a_high;
            __builtin_memcpy(&a_low, ab->q + 4 * i, 4);
            __builtin_memcpy(&a_high, ab->q + 16 + 4 * i, 4);
            low_sums = _mm512_dpbusd_epi32(low_sums, _mm512_and_si512(chunk, low4), _mm512_set1_epi32(a_low));
            high_sums = _mm512_dpbusd_epi32(high_sums, _mm512_and_si512(_mm512_srli_epi16(chunk, 4), low4),
                                            _mm512_set1_epi32(a_high));
        }
        const __m512 w_scale = _mm512_cvtph_ps(_mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)first)), _mm_loadu_si128((const __m128i *)second), 1));
        const __m512i sums = _mm512_sub_epi32(_mm512_add_epi32(low_sums, high_sums), _mm512_set1_epi32(8 * ab->sum));
        acc = _mm512_fmadd_ps(_mm512_mul_ps(w_scale, _mm512_set1_ps(ab->d)), _mm512_cvtepi32_ps(sums), acc);
    }
    if (keep_begin == 0 && keep_end == 2 * KR_PACK_ROWS) {
        _mm512_storeu_ps(out, acc);
    } else {
        float lanes[2 * KR_PACK_ROWS];
        _mm512_storeu_ps(lanes, acc);
        for (int r = keep_begin; r < keep_end; r++) out[r] = lanes[r];
    }
}
#else
typedef int kr_kernels_avx512_not_built;  // ISA=generic or avx2: this file is empty
#endif
