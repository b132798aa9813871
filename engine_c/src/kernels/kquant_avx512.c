// kquant_avx512.c: the ISA=avx512 build's k-quant tiles (kernels.h, "k-quants"): kquant_tile.h
// with two groups of 8 rows in the lanes of one 512-bit vector, so each instruction does the work
// of two 256-bit ones (q4_K about 1.25x, q6_K about 1.4x over 256-bit VNNI tiles in prompts).
// In that build kr_matmul_kquant_avx2 and kr_matmul_packed_kquant_avx2 are these tiles (the _avx2
// names are the build's vector kernels, as kernels_avx2.c's with VNNI); every lane goes through
// kquant_ref.c's per-super-block sequence, so the bits are those of every other build.
#include "kernels/kernels.h"
#include "krafla.h"

#if defined(KR_HAVE_AVX512)
#include <immintrin.h>

#define KR_INLINE static inline __attribute__((always_inline))

// The vectors of a tile (kquant_tile.h): the first group's 8 rows in the low 256 bits, the
// second's in the high 256 (`stride` bytes after the first; 0 runs one group in both halves). VNNI
// accumulates the products of a sub-block in int32 and multiplies by the int32 scales, so a part
// can run longer between flushes than AVX2's int16 one.
#define ROWS 16
typedef __m512i vec;
typedef __m512 vecf;
#define V(name) _mm512_##name
#define V_SI(name) _mm512_##name##_si512
KR_INLINE vec v_load(const char *p, size_t stride) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)p)),
                              _mm256_loadu_si256((const __m256i *)(p + stride)), 1);
}
KR_INLINE vec v_and_load(const char *p, size_t stride, vec mask) { return _mm512_and_si512(v_load(p, stride), mask); }
KR_INLINE vec v_join(__m256i low, __m256i high) { return _mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1); }
KR_INLINE vecf vf_half(const char *p, size_t stride) {  // 8 f16 of each group
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)p)),
                                                   _mm_loadu_si128((const __m128i *)(p + stride)), 1));
}
KR_INLINE vec part_add(vec part, vec u, vec s) { return _mm512_dpbusd_epi32(part, u, s); }
KR_INLINE vec part_flush(vec isum, vec part, vec scale) { return _mm512_add_epi32(isum, _mm512_mullo_epi32(part, scale)); }
// The scales of one sub-block: 8 bytes at `low` (first group) and at `high` (second), as int32 lanes.
KR_INLINE vec scale_vector(const char *low, const char *high, const int is_signed) {
    const __m128i bytes = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)low), _mm_loadl_epi64((const __m128i *)high));
    return is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
}
#define Q5_FLUSH 8
#define KQ_WIDE_PARTS 1  // parts are int32: q4_K's high nibbles can be multiplied in place
// One token: kquant_vnni256.c's tiles of one group, which read a matrix as one stream
#define KQ_ONE_TOKEN(name) name##_vnni256
#define Q6_FLUSH 4
// Tokens per tile: AVX-512 gives 32 vector registers.
#ifndef KR_KQUANT_TOKENS
#define KR_KQUANT_TOKENS 4
#endif

#include "kernels/kquant_tile.h"

#else
typedef int kr_kquant_avx512_not_built;  // not an ISA=avx512 build: this file is empty
#endif
