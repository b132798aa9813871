// kquant_avx512.c: the ISA=avx512 build's k-quant tiles (kernels.h, "k-quants"): kquant_tile.h
// with two groups of 8 rows in the lanes of one 512-bit vector, so each instruction does the work
// of two 256-bit ones (q4_K about 1.25x, q6_K about 1.4x over 256-bit VNNI tiles in prompts).
// kquant_avx2.c's kr_matmul_kquant_avx2 / kr_matmul_packed_kquant_avx2 hand the matmuls over in
// that build; every lane goes through kquant_ref.c's per-super-block sequence, so the bits are
// those of every other build.
#include "kernels/kernels.h"
#include "krafla.h"

#if defined(KR_HAVE_AVX512)
#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#define KR_INLINE static inline __attribute__((always_inline))

// The vectors of a tile (kquant_tile.h): the first group's 8 rows in the low 256 bits, the
// second's in the high 256 (`stride` bytes after the first; 0 runs one group in both halves). VNNI
// accumulates the products of a sub-block in int32 and multiplies by the int32 scales, so a part
// can run longer between flushes than AVX2's int16 one.
#define ROWS 16
typedef __m512i vec;
typedef __m512 vecf;
KR_INLINE vec v_load(const char *p, size_t stride) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                              _mm256_loadu_si256((const __m256i *)(p + stride)), 1);
}
KR_INLINE vec v_join(__m256i low, __m256i high) { return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1); }
KR_INLINE vec v_and(vec a, vec b) { return _mm512_and_si512(a, b); }
KR_INLINE vec v_or(vec a, vec b) { return _mm512_or_si512(a, b); }
KR_INLINE vec v_add(vec a, vec b) { return _mm512_add_epi32(a, b); }
KR_INLINE vec v_sub(vec a, vec b) { return _mm512_sub_epi32(a, b); }
KR_INLINE vec v_bytes(char b) { return _mm512_set1_epi8(b); }
KR_INLINE vec v_words(int32_t w) { return _mm512_set1_epi32(w); }
KR_INLINE vec v_zero(void) { return _mm512_setzero_si512(); }
KR_INLINE vec v_srli16(vec v, const int n) { return _mm512_srli_epi16(v, n); }
KR_INLINE vec v_slli16(vec v, const int n) { return _mm512_slli_epi16(v, n); }
KR_INLINE vec v_slli32(vec v, const int n) { return _mm512_slli_epi32(v, n); }
KR_INLINE vec v_madd16(vec a, vec b) { return _mm512_madd_epi16(a, b); }
KR_INLINE vec part_add(vec part, vec u, vec s) { return _mm512_dpbusd_epi32(part, u, s); }
KR_INLINE vec part_flush(vec isum, vec part, vec scale) { return _mm512_add_epi32(isum, _mm512_mullo_epi32(part, scale)); }
// The scales of one sub-block: 8 bytes at `low` (first group) and at `high` (second), as int32 lanes.
KR_INLINE vec scale_vector(const char *low, const char *high, const int is_signed) {
    const __m128i bytes = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)low), _mm_loadl_epi64((const __m128i *)high));
    return is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
}
KR_INLINE vecf vf_half(const char *p, size_t stride) {  // 8 f16 of each group
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                                   _mm_loadu_si128((const __m128i *)(p + stride)), 1));
}
KR_INLINE vecf vf_zero(void) { return _mm512_setzero_ps(); }
KR_INLINE vecf vf_set1(float f) { return _mm512_set1_ps(f); }
KR_INLINE vecf vf_mul(vecf a, vecf b) { return _mm512_mul_ps(a, b); }
KR_INLINE vecf vf_fmadd(vecf a, vec b, vecf c) { return _mm512_fmadd_ps(a, _mm512_cvtepi32_ps(b), c); }
KR_INLINE vecf vf_fnmadd(vecf a, vec b, vecf c) { return _mm512_fnmadd_ps(a, _mm512_cvtepi32_ps(b), c); }
KR_INLINE void vf_store(float *p, vecf v) { _mm512_storeu_ps(p, v); }
#define Q5_FLUSH 8
#define Q6_FLUSH 4
// Tokens per tile: AVX-512 gives 32 vector registers.
#ifndef KR_KQUANT_TOKENS
#define KR_KQUANT_TOKENS 4
#endif

#include "kernels/kquant_tile.h"

void kr_matmul_kquant_avx512(int32_t weight_type, const void *w, int64_t cols, const void *prepared, int64_t n_tokens,
                             float *out, int64_t out_stride, int64_t row_begin, int64_t row_end) {
    kquant_matmul(weight_type, w, cols, prepared, n_tokens, out, out_stride, row_begin, row_end);
}

void kr_matmul_packed_kquant_avx512(int32_t weight_type, const void *w, int64_t rows, int64_t cols, const void *prepared,
                                    int64_t n_tokens, float *out, int64_t out_stride, int64_t row_begin, int64_t row_end) {
    kquant_matmul_packed(weight_type, w, rows, cols, prepared, n_tokens, out, out_stride, row_begin, row_end);
}

#else
typedef int kr_kquant_avx512_not_built;  // not an ISA=avx512 build: this file is empty
#endif
