// kquant_avx2.c: the k-quant kernels (kernels.h, "k-quants") with AVX2 intrinsics: the q8_K
// activation quantizer, and the tiles of kquant_tile.h with one group of 8 rows in 256 bits. The
// ISA=avx512 build compiles this file too (KR_HAVE_AVX512), keeps its quantizer and hands the
// matmuls to kquant_avx512.c's 16-row tiles.
#include "kernels/kernels.h"
#include "krafla.h"

#if defined(KR_HAVE_AVX2)
#include <immintrin.h>
#include <math.h>
#include <string.h>

#define KR_INLINE static inline __attribute__((always_inline))

// ---------------------------------------------------------------------------------------------
// q8_K quantization: kr_quantize_row_q8_K_ref's operations, 8 values at a time

void kr_quantize_row_q8_K_avx2(const float *x, kr_block_q8_K *y, int64_t n) {
    const __m256 sign_mask = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < n / KR_QK_K; b++) {
        const float *xb = x + b * KR_QK_K;
        // max_ps(a, b) returns b when a is NaN: with the running maximum as b, NaNs are skipped
        __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
        for (int i = 0; i < KR_QK_K; i += 8) {
            const __m256 v = _mm256_loadu_ps(xb + i);
            m = _mm256_max_ps(_mm256_andnot_ps(sign_mask, v), m);
            nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4);
        const int has_nan = _mm256_movemask_ps(nan) != 0;
        if (amax == 0.0f && !has_nan) {
            memset(&y[b], 0, sizeof y[b]);
            continue;
        }
        float max = 0.0f;  // the first element of the largest magnitude, with its sign
        for (int j = 0; j < KR_QK_K; j++)
            if (fabsf(xb[j]) == amax) {
                max = xb[j];
                break;
            }
        const float iscale = amax == 0.0f ? 0.0f : -127.0f / max;
        const __m256 scale = _mm256_set1_ps(iscale);
        for (int i = 0; i < KR_QK_K; i += 32) {
            __m256i q[4];
            for (int k = 0; k < 4; k++) {
                const __m256 v = _mm256_mul_ps(scale, _mm256_loadu_ps(xb + i + 8 * k));
                const __m256 ordered = _mm256_cmp_ps(v, v, _CMP_ORD_Q);  // NaN -> 0, as the reference
                const __m256 clamped = _mm256_min_ps(_mm256_max_ps(v, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
                const __m256 rounded = _mm256_round_ps(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                q[k] = _mm256_cvtps_epi32(_mm256_and_ps(ordered, rounded));
            }
            // packs work within 128-bit halves; the permute puts the 4-byte groups back in order
            const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(y[b].q + i), _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
        }
        // bsums: byte pairs, then 4s, then 8s, then 16s within each 128-bit half (one sub-block of 16)
        for (int i = 0; i < KR_QK_K; i += 32) {
            const __m256i qv = _mm256_loadu_si256((const __m256i *)(y[b].q + i));
            __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), qv), _mm256_set1_epi16(1));
            s = _mm256_hadd_epi32(s, s);
            s = _mm256_hadd_epi32(s, s);
            y[b].bsums[i / 16] = (int16_t)_mm256_extract_epi32(s, 0);
            y[b].bsums[i / 16 + 1] = (int16_t)_mm256_extract_epi32(s, 4);
        }
        y[b].d = has_nan ? NAN : 1.0f / iscale;
    }
}

// ---------------------------------------------------------------------------------------------
// The matmuls

#if !defined(KR_HAVE_AVX512)  // the avx512 build's matmuls are kquant_avx512.c's
// The vectors of a tile (kquant_tile.h): one group of 8 rows in 256 bits. AVX2 adds the maddubs
// pairs of a sub-block in int16 and multiplies by the scales with madd (each 32-bit lane holds the
// scale twice), so a part holds at most 32767: 2 * 15 * 128 = 3840 a step for q4_K (8 steps),
// 2 * 31 * 128 = 7936 for q5_K (4 steps), 2 * 63 * 128 = 16128 for q6_K (2 steps) before a flush.
// The additions saturate (vpaddsw), which within these bounds gives the wrapping sum's bits: GCC
// reassociates wrapping int16 additions, and did here, into trees of all of a chunk's products
// whose registers spilled to the stack; saturating ones it keeps in order (64-token q4_K tiles 1.25x).
#include "kernels/kquant_width256.h"
KR_INLINE vec part_add(vec part, vec u, vec s) { return _mm256_adds_epi16(part, _mm256_maddubs_epi16(u, s)); }
KR_INLINE vec part_flush(vec isum, vec part, vec scale) { return _mm256_add_epi32(isum, _mm256_madd_epi16(part, scale)); }
KR_INLINE vec scale_vector(const char *low, const char *high, const int is_signed) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)low);
    const __m256i scale = is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    return _mm256_or_si256(_mm256_and_si256(scale, _mm256_set1_epi32(0xffff)), _mm256_slli_epi32(scale, 16));
}
#define Q5_FLUSH 4
#define Q6_FLUSH 2
// Tokens per tile: 4, the parts of 4 tokens take 8 of the 16 vector registers (1.1-1.25x 2 at 64 tokens).
#ifndef KR_KQUANT_TOKENS
#define KR_KQUANT_TOKENS 4
#endif
// q4_K's four chunks of sub-blocks one at a time: unrolled, GCC keeps all their scale vectors
// live and spills (64 tokens 1.03x, one token 1.05x; q5_K's unrolled loop is the faster one).
#define KQ_Q4_K_ROLLED 1

#include "kernels/kquant_tile.h"
#endif

#else
typedef int kr_kquant_avx2_not_built;  // ISA=generic: this file is empty
#endif
