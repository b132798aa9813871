// deltanet_avx2.c: the delta rule of deltanet.h with AVX2/FMA, the reference's operations in its
// order: 8 lanes of fused multiply-adds, the kr_lanes_sum order, a fmaf tail.
#include "kernels/deltanet.h"

#if defined(KR_HAVE_AVX2)
#include <immintrin.h>
#include <math.h>

// ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)), as kr_lanes_sum.
static inline float lanes_sum(__m256 v) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

void kr_delta_rule_f32_avx2(float *S, int64_t dk, int64_t dv, const float *q, const float *k, const float *v,
                            float beta, float decay, float *out) {
    const int64_t n8 = dk - dk % 8;
    const __m256 decay8 = _mm256_set1_ps(decay);
    for (int64_t d = 0; d < dv; d++) {
        float *row = S + d * dk;
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < n8; i += 8) {
            const __m256 r = _mm256_mul_ps(_mm256_loadu_ps(row + i), decay8);
            _mm256_storeu_ps(row + i, r);
            acc = _mm256_fmadd_ps(r, _mm256_loadu_ps(k + i), acc);
        }
        float sum = lanes_sum(acc);
        for (int64_t i = n8; i < dk; i++) {
            row[i] *= decay;
            sum = fmaf(row[i], k[i], sum);
        }
        const float delta = (v[d] - sum) * beta;
        const __m256 delta8 = _mm256_set1_ps(delta);
        acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < n8; i += 8) {
            const __m256 r = _mm256_fmadd_ps(delta8, _mm256_loadu_ps(k + i), _mm256_loadu_ps(row + i));
            _mm256_storeu_ps(row + i, r);
            acc = _mm256_fmadd_ps(r, _mm256_loadu_ps(q + i), acc);
        }
        sum = lanes_sum(acc);
        for (int64_t i = n8; i < dk; i++) {
            row[i] = fmaf(delta, k[i], row[i]);
            sum = fmaf(row[i], q[i], sum);
        }
        out[d] = sum;
    }
}
#else
typedef int kr_deltanet_avx2_unused;  // ISA=generic: nothing here (ISO C forbids an empty file)
#endif
