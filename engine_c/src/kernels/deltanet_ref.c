// deltanet_ref.c: the reference kernels of deltanet.h, and the dispatch of those that have no
// vector version (they run this code in every build).
#include "kernels/deltanet.h"

#include <math.h>

// dot(x, y) in kr_dot_f32's order after x = transform(x) element by element: the delta rule's
// two fused passes over a row of the state.
void kr_delta_rule_f32_ref(float *S, int64_t dk, int64_t dv, const float *q, const float *k, const float *v,
                           float beta, float decay, float *out) {
    const int64_t n8 = dk - dk % 8;
    for (int64_t d = 0; d < dv; d++) {
        float *row = S + d * dk;
        float lanes[8] = {0};
        for (int64_t i = 0; i < n8; i++) {
            row[i] *= decay;
            lanes[i % 8] = fmaf(row[i], k[i], lanes[i % 8]);
        }
        float sum = kr_lanes_sum(lanes);
        for (int64_t i = n8; i < dk; i++) {
            row[i] *= decay;
            sum = fmaf(row[i], k[i], sum);
        }
        const float delta = (v[d] - sum) * beta;
        float lanes2[8] = {0};
        for (int64_t i = 0; i < n8; i++) {
            row[i] = fmaf(delta, k[i], row[i]);
            lanes2[i % 8] = fmaf(row[i], q[i], lanes2[i % 8]);
        }
        sum = kr_lanes_sum(lanes2);
        for (int64_t i = n8; i < dk; i++) {
            row[i] = fmaf(delta, k[i], row[i]);
            sum = fmaf(row[i], q[i], sum);
        }
        out[d] = sum;
    }
}

static float silu(float x) { return x / (1.0f + kr_exp_one_ref(-x)); }

void kr_conv_silu_f32_ref(const float *w, int32_t K, float *state, const float *in, float *out, int64_t channels) {
    for (int64_t c = 0; c < channels; c++) {
        float *past = state + c * (K - 1);
        const float *taps = w + c * K;
        float acc = 0;
        for (int32_t i = 0; i < K - 1; i++) acc = fmaf(taps[i], past[i], acc);
        acc = fmaf(taps[K - 1], in[c], acc);
        out[c] = silu(acc);
        for (int32_t i = 0; i + 1 < K - 1; i++) past[i] = past[i + 1];
        if (K > 1) past[K - 2] = in[c];
    }
}

void kr_l2_normalize_f32_ref(float *x, int64_t n, float eps, float scale) {
    const float inv = 1.0f / sqrtf(kr_dot_f32_ref(x, x, n) + eps) * scale;
    for (int64_t i = 0; i < n; i++) x[i] *= inv;
}

void kr_gated_rms_norm_f32_ref(float *o, const float *z, const float *weight, int64_t n, float eps) {
    const float inv = 1.0f / sqrtf(kr_dot_f32_ref(o, o, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) o[i] = o[i] * inv * weight[i] * silu(z[i]);
}

void kr_sigmoid_mul_f32_ref(float *out, const float *gate, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] *= 1.0f / (1.0f + kr_exp_one_ref(-gate[i]));
}

// Dispatch. The delta rule has an AVX2 version; the others are the reference in every build.
void kr_delta_rule_f32(float *S, int64_t dk, int64_t dv, const float *q, const float *k, const float *v, float beta,
                       float decay, float *out) {
#if defined(KR_HAVE_AVX2)
    kr_delta_rule_f32_avx2(S, dk, dv, q, k, v, beta, decay, out);
#else
    kr_delta_rule_f32_ref(S, dk, dv, q, k, v, beta, decay, out);
#endif
}
void kr_conv_silu_f32(const float *w, int32_t K, float *state, const float *in, float *out, int64_t channels) {
    kr_conv_silu_f32_ref(w, K, state, in, out, channels);
}
void kr_l2_normalize_f32(float *x, int64_t n, float eps, float scale) { kr_l2_normalize_f32_ref(x, n, eps, scale); }
void kr_gated_rms_norm_f32(float *o, const float *z, const float *weight, int64_t n, float eps) {
    kr_gated_rms_norm_f32_ref(o, z, weight, n, eps);
}
void kr_sigmoid_mul_f32(float *out, const float *gate, int64_t n) { kr_sigmoid_mul_f32_ref(out, gate, n); }
