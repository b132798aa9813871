// attention.h: the attention kernel model/layers.c runs over blocks of queries (owner: attn).
// Internal to the library, like kernels.h: a plain-C reference (suffix _ref), an AVX2 version
// (suffix _avx2, only in builds with KR_HAVE_AVX2) and the dispatch name without suffix.
#ifndef KRAFLA_ATTENTION_H
#define KRAFLA_ATTENTION_H

#include "kernels/kernels.h"

// Weighted sums of value rows for several queries at once, each over its own range of rows.
// Row p (n values of type KR_F32, KR_F16 or KR_Q8_0; q8_0: n a multiple of 32) is at byte
// values + p * row_stride. Query i reads weights[i * weights_stride + p] for p in
// [begin[i], end[i]) only, and writes n floats to out[i]:
//   out[i][e] = fold over p = begin[i], begin[i] + 1, ..., end[i] - 1 of acc = fmaf(w, V[p][e], acc),
//   acc starting at +0; w = weight[p] for f32/f16, weight[p] * d for q8_0 (d the f16 scale of
//   e's block, V[p][e] its integer quant), which is kr_axpy_rows's arithmetic row after row.
// So a query's result depends only on its own weights and rows, never on the other queries of
// the call (how queries are grouped, the batch or the thread split): rows outside a query's range
// are never read for it, so a non-finite value there cannot reach it as 0 * inf = NaN.
void kr_attend_values(int32_t type, const void *values, size_t row_stride, int64_t n, const float *weights,
                      size_t weights_stride, const int32_t *begin, const int32_t *end, int64_t n_queries,
                      float *const *out);
void kr_attend_values_ref(int32_t type, const void *values, size_t row_stride, int64_t n, const float *weights,
                          size_t weights_stride, const int32_t *begin, const int32_t *end, int64_t n_queries,
                          float *const *out);
void kr_attend_values_avx2(int32_t type, const void *values, size_t row_stride, int64_t n, const float *weights,
                           size_t weights_stride, const int32_t *begin, const int32_t *end, int64_t n_queries,
                           float *const *out);

// Scores of float keys: out[i * out_stride + p] = dot(K[p], q_i) over n values, in kr_dot_f32's
// order (kr_dot_f16_f32's for KR_F16 keys), which is kr_matmul's for these types: the same bits.
// Key row p (KR_F32 or KR_F16) at byte keys + p * row_stride, query i (f32) at queries + i * n.
// Query i needs positions [0, end[i]); a call may also write positions up to the largest end of
// the queries next to it (the caller's rows must have room up to the largest end overall).
void kr_attend_scores(int32_t type, const void *keys, size_t row_stride, int64_t n, const float *queries,
                      int64_t n_queries, const int32_t *end, float *out, size_t out_stride);
void kr_attend_scores_ref(int32_t type, const void *keys, size_t row_stride, int64_t n, const float *queries,
                          int64_t n_queries, const int32_t *end, float *out, size_t out_stride);
void kr_attend_scores_avx2(int32_t type, const void *keys, size_t row_stride, int64_t n, const float *queries,
                           int64_t n_queries, const int32_t *end, float *out, size_t out_stride);

// One query's weights in place: x[i] = scale * x[i] (then softcap * tanh(x[i] / softcap) when
// softcap > 0), x = exp(x - max x) / sum, the sum in kr_exp_shift_sum_f32's order. A finite `sink`
// (gpt-oss's learned logit per head) joins the softmax without a value: max takes it in and the sum
// gains exp(sink - max), so the weights add up to less than 1; -INFINITY: no sink, the same bits as
// without.
void kr_attention_softmax(float *x, int64_t n, float scale, float softcap, float sink);
void kr_attention_softmax_ref(float *x, int64_t n, float scale, float softcap, float sink);
void kr_attention_softmax_avx2(float *x, int64_t n, float scale, float softcap, float sink);

#endif
