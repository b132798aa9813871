// deltanet.h: the kernels of Qwen3.5's gated DeltaNet layers (model/arch_qwen35.c). Internal.
//
// As kernels.h: a plain-C reference (suffix _ref, deltanet_ref.c), an AVX2 version where the loop
// is worth one (suffix _avx2, deltanet_avx2.c) and the dispatch name without suffix. The AVX2
// versions do the reference's float operations in the reference's order (8 lanes of fused
// multiply-adds, kr_lanes_sum, a fmaf tail), so every build gives the same bits. The kernels
// without an AVX2 version run the reference in every build (plain C compiled without
// contraction: -std=c11 keeps a * b + c two roundings, so the same bits too).
#ifndef KRAFLA_DELTANET_H
#define KRAFLA_DELTANET_H

#include "kernels/kernels.h"

// One token of the gated delta rule for one value head. S holds S^T: dv rows of dk values.
// For each row d, in order:
//   r = S[d] * decay                         (element-wise)
//   delta = (v[d] - dot(r, k)) * beta        (dot in kr_dot_f32's order)
//   S[d] = fmaf(delta, k, r)                 (element-wise)
//   out[d] = dot(S[d], q)                    (kr_dot_f32's order)
void kr_delta_rule_f32(float *S, int64_t dk, int64_t dv, const float *q, const float *k, const float *v, float beta,
                       float decay, float *out);
void kr_delta_rule_f32_ref(float *S, int64_t dk, int64_t dv, const float *q, const float *k, const float *v,
                           float beta, float decay, float *out);
void kr_delta_rule_f32_avx2(float *S, int64_t dk, int64_t dv, const float *q, const float *k, const float *v,
                            float beta, float decay, float *out);

// Causal depthwise conv1d + silu for one token over `channels` channels. w: (channels, K) taps,
// state: (channels, K - 1) previous inputs, oldest first, shifted by one to take `in`:
//   out[c] = silu(fold over i of acc = fmaf(w[c][i], window[c][i], acc)), window = state[c] | in[c]
// silu(x) = x / (1 + kr_exp_one_ref(-x)).
void kr_conv_silu_f32(const float *w, int32_t K, float *state, const float *in, float *out, int64_t channels);
void kr_conv_silu_f32_ref(const float *w, int32_t K, float *state, const float *in, float *out, int64_t channels);

// x *= scale / sqrt(dot(x, x) + eps)  (the factor 1 / sqrtf(...) rounded, then times scale).
void kr_l2_normalize_f32(float *x, int64_t n, float eps, float scale);
void kr_l2_normalize_f32_ref(float *x, int64_t n, float eps, float scale);

// Gated RMSNorm: o[i] = o[i] * inv * weight[i] * silu(z[i]), inv = 1 / sqrtf(dot(o, o) / n + eps).
void kr_gated_rms_norm_f32(float *o, const float *z, const float *weight, int64_t n, float eps);
void kr_gated_rms_norm_f32_ref(float *o, const float *z, const float *weight, int64_t n, float eps);

// out[i] *= sigmoid(gate[i]) = 1 / (1 + kr_exp_one_ref(-gate[i])).
void kr_sigmoid_mul_f32(float *out, const float *gate, int64_t n);
void kr_sigmoid_mul_f32_ref(float *out, const float *gate, int64_t n);

#endif
