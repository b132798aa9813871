// attention.c: the attention kernels of attention.h (scores of float keys, the softmax of one
// query, the weighted sum of value rows for a block of queries) and their test entry points
// (krafla.h, "Attention kernel (tests)"). Owner: attn.
//
// The references are the definitions: scores in kr_dot's order, the softmax as the model code always
// did it, and for the values, per query, per row in ascending order, per value one fmaf. The AVX2
// versions do the same float operations. kr_attend_values_avx2 reads each value row once for a
// group of up to 4 queries: within a group, the rows every query sees are folded for all of them
// together, and the rows only some see (a later query's last rows, an earlier sliding window's
// first ones) before and after that, for each query alone, in row order. So each query gets the
// reference's bits whatever group it lands in.
#include "kernels/attention.h"
#include "runtime/internal.h"

#include <math.h>
#include <stdbool.h>

#if defined(KR_HAVE_AVX2)
#include <immintrin.h>
#define KR_ATTEND(name) name##_avx2
#else
#define KR_ATTEND(name) name##_ref
#endif

void kr_attend_values(int32_t type, const void *values, size_t row_stride, int64_t n, const float *weights,
                      size_t weights_stride, const int32_t *begin, const int32_t *end, int64_t n_queries,
                      float *const *out) {
    KR_ATTEND(kr_attend_values)(type, values, row_stride, n, weights, weights_stride, begin, end, n_queries, out);
}

void kr_attend_scores(int32_t type, const void *keys, size_t row_stride, int64_t n, const float *queries,
                      int64_t n_queries, const int32_t *end, float *out, size_t out_stride) {
    KR_ATTEND(kr_attend_scores)(type, keys, row_stride, n, queries, n_queries, end, out, out_stride);
}

void kr_attention_softmax(float *x, int64_t n, float scale, float softcap, float sink) {
    KR_ATTEND(kr_attention_softmax)(x, n, scale, softcap, sink);
}

// ---------------------------------------------------------------------------------------------
// Reference

void kr_attend_scores_ref(int32_t type, const void *keys, size_t row_stride, int64_t n, const float *queries,
                          int64_t n_queries, const int32_t *end, float *out, size_t out_stride) {
    for (int64_t i = 0; i < n_queries; i++)
        for (int32_t p = 0; p < end[i]; p++) {
            const void *key = (const char *)keys + (size_t)p * row_stride;
            const float *query = queries + (size_t)i * (size_t)n;
            out[(size_t)i * out_stride + (size_t)p] = type == KR_F16 ? kr_dot_f16_f32_ref(key, query, n)
                                                                      : kr_dot_f32_ref(key, query, n);
        }
}

// The sink's share of the denominator, exp(sink - max) (max raised to the sink first), or 0 when
// there is none: the same scalar code in every build.
static float sink_term(float sink, float *max) {
    if (sink == -INFINITY) return 0.0f;
    if (sink > *max) *max = sink;
    return kr_exp_one_ref(sink - *max);
}

void kr_attention_softmax_ref(float *x, int64_t n, float scale, float softcap, float sink) {
    float max = -INFINITY;
    for (int64_t i = 0; i < n; i++) {
        float value = x[i] * scale;
        if (softcap > 0) value = softcap * tanhf(value / softcap);
        x[i] = value;
        if (value > max) max = value;
    }
    const float sink_share = sink_term(sink, &max);
    const float inv_sum = 1.0f / (kr_exp_shift_sum_f32_ref(x, n, max) + sink_share);
    for (int64_t i = 0; i < n; i++) x[i] *= inv_sum;
}

void kr_attend_values_ref(int32_t type, const void *values, size_t row_stride, int64_t n, const float *weights,
                          size_t weights_stride, const int32_t *begin, const int32_t *end, int64_t n_queries,
                          float *const *out) {
    for (int64_t i = 0; i < n_queries; i++) {
        const float *weight = weights + (size_t)i * weights_stride;
        float *y = out[i];
        for (int64_t e = 0; e < n; e++) y[e] = 0.0f;
        for (int64_t p = begin[i]; p < end[i]; p++) {
            const char *row = (const char *)values + (size_t)p * row_stride;
            for (int64_t e = 0; e < n; e++) {
                if (type == KR_Q8_0) {
                    const kr_block_q8_0 *block = (const kr_block_q8_0 *)row + e / KR_QK;
                    y[e] = fmaf(weight[p] * kr_f16_to_f32_ref(block->d), (float)block->q[e % KR_QK], y[e]);
                } else if (type == KR_F16) {
                    y[e] = fmaf(weight[p], kr_f16_to_f32_ref(((const kr_f16 *)row)[e]), y[e]);
                } else {
                    y[e] = fmaf(weight[p], ((const float *)row)[e], y[e]);
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// AVX2

#if defined(KR_HAVE_AVX2)

#define KR_INLINE static inline __attribute__((always_inline))
#ifndef KR_ATTEND_GROUP
#define KR_ATTEND_GROUP 4  // queries folded together, 1 to 4 (registers: GROUP * WIDTH accumulators + WIDTH values)
#endif
#ifndef KR_ATTEND_WIDTH
#define KR_ATTEND_WIDTH 2  // vectors of 8 values per pass: 1, 2 or 4 (a q8_0 block is 4)
#endif
#define ATTEND_AHEAD 4   // rows fetched ahead when the rows are read in order
#define FETCH_AHEAD 24   // rows fetched ahead into L2 by the first column strip
#define ROWS_IN_ORDER_BYTES 512  // a few queries over rows this long: rows in order (rows_in_order)
#define GROUP KR_ATTEND_GROUP
#define WIDTH KR_ATTEND_WIDTH

// W vectors of row values e .. e + 8W - 1 (inside one q8_0 block), and the block's scale.
KR_INLINE void load_values(const int32_t type, const int W, const char *row, int64_t e, __m256 v[WIDTH], float *scale) {
    if (type == KR_Q8_0) {
        const kr_block_q8_0 *block = (const kr_block_q8_0 *)row + e / KR_QK;
        *scale = _cvtsh_ss(block->d);
#pragma GCC unroll 4
        for (int k = 0; k < W; k++)
            v[k] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(block->q + e % KR_QK + 8 * k))));
    } else if (type == KR_F16) {
#pragma GCC unroll 4
        for (int k = 0; k < W; k++) v[k] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const kr_f16 *)row + e + 8 * k)));
    } else {
#pragma GCC unroll 4
        for (int k = 0; k < W; k++) v[k] = _mm256_loadu_ps((const float *)row + e + 8 * k);
    }
}

// acc[g][k] = fma(w_g[p], V[p][e + 8k ..], acc[g][k]) for rows p in [first, last), G queries at
// once (the caller passes acc + g and weight + g for one query alone).
// With `fetch`, whole rows FETCH_AHEAD ahead are fetched into L2 on the way, so that the later
// column strips find them there (a strip reads one cache line per row, a stride the hardware
// prefetchers follow poorly).
KR_INLINE void fold_rows(const int32_t type, const int W, const int G, const float *const *weight, const char *values,
                         size_t row_stride, int64_t e, int64_t first, int64_t last, __m256 (*acc)[WIDTH], bool fetch) {
    for (int64_t p = first; p < last; p++) {
        __m256 v[WIDTH];
        float scale = 1.0f;
        if (fetch)
            for (size_t line = 0; line < row_stride; line += 64)
                _mm_prefetch(values + (size_t)(p + FETCH_AHEAD) * row_stride + line, _MM_HINT_T1);
        load_values(type, W, values + (size_t)p * row_stride, e, v, &scale);
#pragma GCC unroll 4
        for (int g = 0; g < G; g++) {
            const __m256 w = _mm256_set1_ps(type == KR_Q8_0 ? weight[g][p] * scale : weight[g][p]);
#pragma GCC unroll 4
            for (int k = 0; k < W; k++) acc[g][k] = _mm256_fmadd_ps(w, v[k], acc[g][k]);
        }
    }
}

// Values e .. e + 8W - 1 of G queries: each query's rows before the shared range alone, the shared
// range together, the rows after it alone.
KR_INLINE void fold_group(const int32_t type, const int W, const int G, const float *const *weight, const int32_t *begin,
                          const int32_t *end, const char *values, size_t row_stride, int64_t e, float *const *out,
                          bool fetch) {
    __m256 acc[GROUP][WIDTH];
    int64_t shared_begin = begin[0], shared_end = end[0];
#pragma GCC unroll 4
    for (int g = 0; g < G; g++) {
#pragma GCC unroll 4
        for (int k = 0; k < W; k++) acc[g][k] = _mm256_setzero_ps();
        if (begin[g] > shared_begin) shared_begin = begin[g];
        if (end[g] < shared_end) shared_end = end[g];
    }
    const bool shared = shared_begin < shared_end;
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
        fold_rows(type, W, 1, weight + g, values, row_stride, e, begin[g], shared ? shared_begin : end[g], acc + g, fetch);
    if (shared) {
        fold_rows(type, W, G, weight, values, row_stride, e, shared_begin, shared_end, acc, fetch);
#pragma GCC unroll 4
        for (int g = 0; g < G; g++) fold_rows(type, W, 1, weight + g, values, row_stride, e, shared_end, end[g], acc + g, fetch);
    }
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
#pragma GCC unroll 4
        for (int k = 0; k < W; k++) _mm256_storeu_ps(out[g] + e + 8 * k, acc[g][k]);
}

// Scores, 4 positions x 2 queries at a time: 8 accumulators of 8 lanes over the values, then the
// 8 horizontal sums together. kr_lanes_sum's tree ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)) for
// all 8: halves added (l_j + l_j+4), then pairs (s0+s2, s1+s3), then the two, by transposing
// shuffles instead of one hsum per score; then the reference's scalar tail past the last 8.
KR_INLINE __m256 load_key8(const int32_t type, const char *row, int64_t k) {
    return type == KR_F16 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const kr_f16 *)row + k)))
                          : _mm256_loadu_ps((const float *)row + k);
}

KR_INLINE float load_key1(const int32_t type, const char *row, int64_t k) {
    return type == KR_F16 ? _cvtsh_ss(((const kr_f16 *)row)[k]) : ((const float *)row)[k];
}

// a[j]: lanes of output j -> its tree sum in lane j.
KR_INLINE __m256 lanes_sums8(const __m256 a[8]) {
    __m256 s[4];
#pragma GCC unroll 4
    for (int j = 0; j < 4; j++)  // [a_j lo + a_j hi | a_j+4 lo + a_j+4 hi]
        s[j] = _mm256_add_ps(_mm256_permute2f128_ps(a[j], a[j + 4], 0x20), _mm256_permute2f128_ps(a[j], a[j + 4], 0x31));
    // (s0 + s2, s1 + s3) of outputs j, j+1 in each 128-bit half
    const __m256d s01_lo = _mm256_unpacklo_pd(_mm256_castps_pd(s[0]), _mm256_castps_pd(s[1]));
    const __m256d s01_hi = _mm256_unpackhi_pd(_mm256_castps_pd(s[0]), _mm256_castps_pd(s[1]));
    const __m256d s23_lo = _mm256_unpacklo_pd(_mm256_castps_pd(s[2]), _mm256_castps_pd(s[3]));
    const __m256d s23_hi = _mm256_unpackhi_pd(_mm256_castps_pd(s[2]), _mm256_castps_pd(s[3]));
    const __m256 u = _mm256_add_ps(_mm256_castpd_ps(s01_lo), _mm256_castpd_ps(s01_hi));
    const __m256 v = _mm256_add_ps(_mm256_castpd_ps(s23_lo), _mm256_castpd_ps(s23_hi));
    return _mm256_add_ps(_mm256_shuffle_ps(u, v, _MM_SHUFFLE(2, 0, 2, 0)), _mm256_shuffle_ps(u, v, _MM_SHUFFLE(3, 1, 3, 1)));
}

// A tile's 4 key rows against 2 queries. With `from_memory` (the first pass over the tile) the rows
// are read one after the other, each whole, so the hardware prefetchers see one ascending stream
// and fetch the next rows ahead; reading the 4 rows side by side instead (the 4 streams a cache
// line apart at each step) leaves them idle, and the keys then arrive at a third of the speed
// (bench/cold_attention.c: 6 queries over 2048 f32 rows from memory, 141-147 -> 58-61 us per KV head). The later
// passes find the rows in L1 and go across them, loading each query vector once for 4 rows.
KR_INLINE void scores_tile(const int32_t type, const char *keys, size_t row_stride, int64_t n, const float *q0,
                           const float *q1, float *out0, float *out1, bool from_memory) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    const int64_t n8 = n - n % 8;
    if (from_memory) {
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++)
            for (int64_t k = 0; k < n8; k += 8) {
                __m256 key = load_key8(type, keys + (size_t)r * row_stride, k);
                __asm__("" : "+x"(key));  // one load per key vector: GCC would otherwise fold it into both FMAs
                acc[r] = _mm256_fmadd_ps(key, _mm256_loadu_ps(q0 + k), acc[r]);
                acc[r + 4] = _mm256_fmadd_ps(key, _mm256_loadu_ps(q1 + k), acc[r + 4]);
            }
    } else {
        for (int64_t k = 0; k < n8; k += 8) {
            const __m256 x0 = _mm256_loadu_ps(q0 + k), x1 = _mm256_loadu_ps(q1 + k);
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++) {
                __m256 key = load_key8(type, keys + (size_t)r * row_stride, k);
                __asm__("" : "+x"(key));
                acc[r] = _mm256_fmadd_ps(key, x0, acc[r]);
                acc[r + 4] = _mm256_fmadd_ps(key, x1, acc[r + 4]);
            }
        }
    }
    const __m256 sums = lanes_sums8(acc);
    if (n8 == n) {
        _mm_storeu_ps(out0, _mm256_castps256_ps128(sums));
        _mm_storeu_ps(out1, _mm256_extractf128_ps(sums, 1));
        return;
    }
    float tail[8];
    _mm256_storeu_ps(tail, sums);
    for (int64_t k = n8; k < n; k++)
        for (int r = 0; r < 4; r++) {
            const float key = load_key1(type, keys + (size_t)r * row_stride, k);
            tail[r] = fmaf(key, q0[k], tail[r]);
            tail[r + 4] = fmaf(key, q1[k], tail[r + 4]);
        }
    for (int r = 0; r < 4; r++) out0[r] = tail[r], out1[r] = tail[r + 4];
}

// One query against 8 positions: the same 8 accumulators and sums (a lone query is not paired
// with itself, which would do its work twice), the rows in order when they come from memory.
KR_INLINE void scores_tile_single(const int32_t type, const char *keys, size_t row_stride, int64_t n, const float *q0,
                                  float *out0, bool from_memory) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int j = 0; j < 8; j++) acc[j] = _mm256_setzero_ps();
    const int64_t n8 = n - n % 8;
    if (from_memory) {
#pragma GCC unroll 8
        for (int r = 0; r < 8; r++)
            for (int64_t k = 0; k < n8; k += 8)
                acc[r] = _mm256_fmadd_ps(load_key8(type, keys + (size_t)r * row_stride, k), _mm256_loadu_ps(q0 + k), acc[r]);
    } else {
        for (int64_t k = 0; k < n8; k += 8) {
            const __m256 x0 = _mm256_loadu_ps(q0 + k);
#pragma GCC unroll 8
            for (int r = 0; r < 8; r++)
                acc[r] = _mm256_fmadd_ps(load_key8(type, keys + (size_t)r * row_stride, k), x0, acc[r]);
        }
    }
    _mm256_storeu_ps(out0, lanes_sums8(acc));
    for (int64_t k = n8; k < n; k++)
        for (int r = 0; r < 8; r++) out0[r] = fmaf(load_key1(type, keys + (size_t)r * row_stride, k), q0[k], out0[r]);
}

KR_INLINE float key_dot(const int32_t type, const char *key, const float *query, int64_t n) {
    return type == KR_F16 ? kr_dot_f16_f32_avx2((const kr_f16 *)key, query, n) : kr_dot_f32_avx2((const float *)key, query, n);
}

// Positions [p, stop) of one pass (a pair of queries, or q1 NULL: a lone query): whole tiles, then
// kr_dot's own sequence for the last positions.
KR_INLINE void scores_span(const int32_t type, const char *keys, size_t row_stride, int64_t n, const float *q0,
                           const float *q1, float *out0, float *out1, int32_t p, int32_t stop, bool from_memory) {
    if (!q1 && p + 8 <= stop) {
        scores_tile_single(type, keys + (size_t)p * row_stride, row_stride, n, q0, out0 + p, from_memory);
        return;
    }
    for (; q1 && p + 4 <= stop; p += 4)
        scores_tile(type, keys + (size_t)p * row_stride, row_stride, n, q0, q1, out0 + p, out1 + p, from_memory);
    for (; p < stop; p++) {
        const char *key = keys + (size_t)p * row_stride;
        out0[p] = key_dot(type, key, q0, n);
        if (q1) out1[p] = key_dot(type, key, q1, n);
    }
}

// Positions outside, queries inside: a tile of 8 key rows stays in L1 while every pair of queries
// (and an odd last query alone) passes over it; the first pass brings it from memory in order.
KR_INLINE void scores_tiles(const int32_t type, const char *keys, size_t row_stride, int64_t n, const float *queries,
                            int64_t n_queries, const int32_t *end, float *out, size_t out_stride) {
    int32_t last = 0;
    for (int64_t i = 0; i < n_queries; i++) last = end[i] > last ? end[i] : last;
    for (int32_t p = 0; p < last; p += 8) {
        bool from_memory = true;
        for (int64_t i = 0; i < n_queries; i += 2) {
            const bool pair = i + 1 < n_queries;
            const int32_t positions = pair && end[i + 1] > end[i] ? end[i + 1] : end[i];
            if (p >= positions) continue;
            const int32_t stop = p + 8 < positions ? p + 8 : positions;
            const float *q0 = queries + (size_t)i * (size_t)n, *q1 = pair ? q0 + n : NULL;
            float *out0 = out + (size_t)i * out_stride, *out1 = pair ? out0 + out_stride : NULL;
            scores_span(type, keys, row_stride, n, q0, q1, out0, out1, p, stop, from_memory);
            from_memory = false;
        }
    }
}

void kr_attend_scores_avx2(int32_t type, const void *keys, size_t row_stride, int64_t n, const float *queries,
                           int64_t n_queries, const int32_t *end, float *out, size_t out_stride) {
    if (type == KR_F16) scores_tiles(KR_F16, keys, row_stride, n, queries, n_queries, end, out, out_stride);
    else scores_tiles(KR_F32, keys, row_stride, n, queries, n_queries, end, out, out_stride);
}

// The reference's operations; max_ps(value, max) keeps max when value is NaN, as `value > max`
// does (and between +0 and -0 either is the same shift: x - 0 is x).
void kr_attention_softmax_avx2(float *x, int64_t n, float scale, float softcap, float sink) {
    float max = -INFINITY;
    int64_t i = 0;
    if (softcap > 0) {
        for (; i < n; i++) {
            x[i] = softcap * tanhf(x[i] * scale / softcap);
            if (x[i] > max) max = x[i];
        }
    } else {
        const __m256 factor = _mm256_set1_ps(scale);
        __m256 maxes = _mm256_set1_ps(-INFINITY);
        for (; i + 8 <= n; i += 8) {
            const __m256 value = _mm256_mul_ps(_mm256_loadu_ps(x + i), factor);
            _mm256_storeu_ps(x + i, value);
            maxes = _mm256_max_ps(value, maxes);
        }
        float lanes[8];
        _mm256_storeu_ps(lanes, maxes);
        for (int l = 0; l < 8; l++)
            if (lanes[l] > max) max = lanes[l];
        for (; i < n; i++) {
            x[i] *= scale;
            if (x[i] > max) max = x[i];
        }
    }
    const float sink_share = sink_term(sink, &max);
    const float inv_sum = 1.0f / (kr_exp_shift_sum_f32_avx2(x, n, max) + sink_share);
    const __m256 factor = _mm256_set1_ps(inv_sum);
    for (i = 0; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(_mm256_loadu_ps(x + i), factor));
    for (; i < n; i++) x[i] *= inv_sum;
}

// One instance per (type, width, group size): the loops above need them as constants.
#define FOLD_GROUP_SIZES(TYPE, W)                                                                          \
    switch (G) {                                                                                           \
    case 1: fold_group(TYPE, W, 1, weight, begin, end, values, row_stride, e, out, fetch); break;          \
    case 2: fold_group(TYPE, W, 2, weight, begin, end, values, row_stride, e, out, fetch); break;          \
    case 3: fold_group(TYPE, W, 3, weight, begin, end, values, row_stride, e, out, fetch); break;          \
    default: fold_group(TYPE, W, 4, weight, begin, end, values, row_stride, e, out, fetch); break;         \
    }

static void fold_group_f32(int W, int G, const float *const *weight, const int32_t *begin, const int32_t *end,
                           const char *values, size_t row_stride, int64_t e, float *const *out, bool fetch) {
    if (W == WIDTH) FOLD_GROUP_SIZES(KR_F32, WIDTH) else FOLD_GROUP_SIZES(KR_F32, 1)
}

static void fold_group_f16(int W, int G, const float *const *weight, const int32_t *begin, const int32_t *end,
                           const char *values, size_t row_stride, int64_t e, float *const *out, bool fetch) {
    if (W == WIDTH) FOLD_GROUP_SIZES(KR_F16, WIDTH) else FOLD_GROUP_SIZES(KR_F16, 1)
}

static void fold_group_q8_0(int W, int G, const float *const *weight, const int32_t *begin, const int32_t *end,
                            const char *values, size_t row_stride, int64_t e, float *const *out, bool fetch) {
    FOLD_GROUP_SIZES(KR_Q8_0, WIDTH)  // q8_0 rows are whole blocks: 32 values, WIDTH divides them
}

// A few queries (generation): the rows one after another, each added to the sums of the queries
// that see it, kept in out. The rows then stream from memory in order, as the prefetchers like
// (the cache is cold after a token's weights have passed); the column strips above read a row's
// cache lines far apart, which costs more than the sums' loads and stores here.
KR_INLINE void rows_in_order(const int32_t type, const float *weights, size_t weights_stride, const int32_t *begin,
                             const int32_t *end, int64_t n_queries, const char *values, size_t row_stride, int64_t n8,
                             float *const *out) {
    int32_t first = begin[0], last = end[0];
    for (int64_t g = 1; g < n_queries; g++) {
        if (begin[g] < first) first = begin[g];
        if (end[g] > last) last = end[g];
    }
    for (int32_t p = first; p < last; p++) {
        const char *row = values + (size_t)p * row_stride;
        for (size_t line = 0; line < row_stride; line += 64)
            _mm_prefetch(row + ATTEND_AHEAD * row_stride + line, _MM_HINT_T0);
        float weight[GROUP];
        float *y[GROUP];
        int active = 0;
        for (int64_t g = 0; g < n_queries; g++)
            if (p >= begin[g] && p < end[g]) weight[active] = weights[(size_t)g * weights_stride + (size_t)p], y[active++] = out[g];
        for (int64_t e = 0; e < n8; e += 8) {
            __m256 v[WIDTH];
            float scale = 1.0f;
            load_values(type, 1, row, e, v, &scale);
            for (int g = 0; g < active; g++) {
                const __m256 w = _mm256_set1_ps(type == KR_Q8_0 ? weight[g] * scale : weight[g]);
                _mm256_storeu_ps(y[g] + e, _mm256_fmadd_ps(w, v[0], _mm256_loadu_ps(y[g] + e)));
            }
        }
    }
}

// The chunks of the whole-row and span paths: rows [*first, *last) (those any query reads) in runs
// of about CHUNK_BYTES, which every group of queries passes over in turn while the run is in L1.
// Returns the rows of a chunk. Both paths take up to CHUNKED_MAX_QUERIES queries.
#define CHUNK_BYTES 16384
#define CHUNKED_MAX_QUERIES 64  // speed hook: more queries (a prompt) go through the column strips
KR_INLINE int64_t chunk_rows(const int32_t *begin, const int32_t *end, int64_t n_queries, size_t row_stride,
                             int64_t *first, int64_t *last) {
    *first = begin[0], *last = end[0];
    for (int64_t i = 1; i < n_queries; i++) {
        if (begin[i] < *first) *first = begin[i];
        if (end[i] > *last) *last = end[i];
    }
    const size_t stride = row_stride ? row_stride : 1;  // 0 when there is one row
    return stride < CHUNK_BYTES ? (int64_t)(CHUNK_BYTES / stride) : 1;
}

// Spans (AVX2 builds; AVX-512 builds for rows wider than whole_values takes): a query's sums of 64
// values (8 vectors) sit in registers while the rows of a chunk (chunk_rows) pass, one after the
// other; then the next span and query over the same chunk, now in L1. The first pass reads the
// first 64 values of each row in order, an ascending stream with gaps the prefetchers follow.

// y[e .. e + 8V) += w[p] * V[p][e ..] over rows p in [first, last), in order.
KR_INLINE void span_rows(const int32_t type, const int V, const float *weight, const char *values, size_t row_stride,
                         int64_t e, int64_t first, int64_t last, float *y) {
    __m256 acc[8];
#pragma GCC unroll 8
    for (int k = 0; k < V; k++) acc[k] = _mm256_loadu_ps(y + e + 8 * k);
    for (int64_t p = first; p < last; p++) {
        const char *row = values + (size_t)p * row_stride;
        const __m256 w = _mm256_set1_ps(weight[p]);
#pragma GCC unroll 8
        for (int k = 0; k < V; k++) {
            __m256 v[WIDTH];
            float scale = 1.0f;
            load_values(type, 1, row, e + 8 * k, v, &scale);
            acc[k] = _mm256_fmadd_ps(type == KR_Q8_0 ? _mm256_set1_ps(weight[p] * scale) : w, v[0], acc[k]);
        }
    }
#pragma GCC unroll 8
    for (int k = 0; k < V; k++) _mm256_storeu_ps(y + e + 8 * k, acc[k]);
}

// Values [0, n8) of every query: chunk after chunk, span after span, query after query.
KR_INLINE void span_chunks(const int32_t type, int64_t n8, const float *weights, size_t weights_stride,
                           const int32_t *begin, const int32_t *end, int64_t n_queries, const char *values,
                           size_t row_stride, float *const *out) {
    int64_t rows_first, rows_last;
    const int64_t chunk = chunk_rows(begin, end, n_queries, row_stride, &rows_first, &rows_last);
    for (int64_t c0 = rows_first; c0 < rows_last; c0 += chunk) {
        const int64_t c1 = c0 + chunk < rows_last ? c0 + chunk : rows_last;
        for (int64_t e = 0; e < n8; e += e + 64 <= n8 ? 64 : 8)
            for (int64_t i = 0; i < n_queries; i++) {
                const int64_t first = begin[i] > c0 ? begin[i] : c0, last = end[i] < c1 ? end[i] : c1;
                const float *weight = weights + (size_t)i * weights_stride;
                if (e + 64 <= n8) span_rows(type, 8, weight, values, row_stride, e, first, last, out[i]);
                else span_rows(type, 1, weight, values, row_stride, e, first, last, out[i]);
            }
    }
}

// One instance per type.
static void span_values(int32_t type, int64_t n8, const float *weights, size_t weights_stride, const int32_t *begin,
                        const int32_t *end, int64_t n_queries, const char *values, size_t row_stride, float *const *out) {
    if (type == KR_Q8_0) span_chunks(KR_Q8_0, n8, weights, weights_stride, begin, end, n_queries, values, row_stride, out);
    else if (type == KR_F16) span_chunks(KR_F16, n8, weights, weights_stride, begin, end, n_queries, values, row_stride, out);
    else span_chunks(KR_F32, n8, weights, weights_stride, begin, end, n_queries, values, row_stride, out);
}

#if defined(KR_HAVE_AVX512)
// Whole rows (AVX-512 builds, rows of up to 256 values): G queries' sums of a whole row's width sit
// in G * V registers of 16 floats, so the rows are read one after the other, each whole, as the
// hardware prefetchers like, and each value vector serves G queries. The rows go in chunks
// (chunk_rows): the first group of queries brings a chunk from memory in order, the
// others find it in L1; the sums go to `out` between chunks. While the second group passes over a
// chunk it fetches the next one into L2, so the memory is not idle while the later groups compute
// (the first group then finds the chunk in L2). Per value the same fmaf in row order as the
// reference. (bench/cold_attention.c, 6 queries over 2048 f32 rows of 128 from memory: the values
// and softmax 194-201 -> 78-82 us per KV head; groups of 3 instead of 2 with the fetch, 77 -> 68,
// and f16 rows 64 -> 43.)
#define WHOLE_MAX_VECTORS 16  // 256 values
#define WHOLE_MAX_SUMS 24     // vectors of sums a group keeps in registers (of AVX-512's 32: values, weights)

// Row vector k (values 16k .. 16k + 15, those of `mask`) and its q8_0 block's scale.
KR_INLINE __m512 whole_load(const int32_t type, const char *row, int k, __mmask16 mask, float *scale) {
    if (type == KR_Q8_0) {
        const kr_block_q8_0 *block = (const kr_block_q8_0 *)row + k / 2;
        *scale = mask ? _cvtsh_ss(block->d) : 0.0f;  // a masked-off vector may lie past the row's blocks
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, block->q + 16 * (k % 2))));
    }
    if (type == KR_F16) return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, (const kr_f16 *)row + 16 * k));
    return _mm512_maskz_loadu_ps(mask, (const float *)row + 16 * k);
}

// acc[g][k] += w_g[p] * V[p][16k ..] for rows p in [first, last), G queries at once (the caller
// passes acc + g and weight + g for one query alone); with `ahead` (bytes, 0 for none) each row's
// lines that far ahead are fetched into L2.
KR_INLINE void whole_rows(const int32_t type, const int V, const int G, const float *const *weight, const char *values,
                          size_t row_stride, int64_t first, int64_t last, const __mmask16 *mask,
                          __m512 (*acc)[WHOLE_MAX_VECTORS], size_t ahead) {
    for (int64_t p = first; p < last; p++) {
        const char *row = values + (size_t)p * row_stride;
        for (size_t line = 0; ahead && line < row_stride; line += 64) _mm_prefetch(row + ahead + line, _MM_HINT_T1);
        __m512 w[4];
#pragma GCC unroll 4
        for (int g = 0; g < G; g++) w[g] = _mm512_set1_ps(weight[g][p]);
#pragma GCC unroll 16
        for (int k = 0; k < V; k++) {
            float scale = 1.0f;
            const __m512 v = whole_load(type, row, k, mask[k], &scale);
#pragma GCC unroll 4
            for (int g = 0; g < G; g++)
                acc[g][k] = _mm512_fmadd_ps(type == KR_Q8_0 ? _mm512_set1_ps(weight[g][p] * scale) : w[g], v, acc[g][k]);
        }
    }
}

// One chunk [c0, c1) for G queries: their sums from out, each query's rows of the chunk before the
// rows all of them see, those together (fetching `ahead`: whole_rows), each query's rows after
// them; the sums back to out.
KR_INLINE void whole_group(const int32_t type, const int V, const int G, const float *const *weight,
                           const int32_t *begin, const int32_t *end, const char *values, size_t row_stride, int64_t c0,
                           int64_t c1, const __mmask16 *mask, float *const *out, size_t ahead) {
    __m512 acc[4][WHOLE_MAX_VECTORS];
    int64_t first[4], last[4], shared_first = c0, shared_last = c1;
#pragma GCC unroll 4
    for (int g = 0; g < G; g++) {
        first[g] = begin[g] > c0 ? begin[g] : c0;
        last[g] = end[g] < c1 ? end[g] : c1;
        if (first[g] > shared_first) shared_first = first[g];
        if (last[g] < shared_last) shared_last = last[g];
#pragma GCC unroll 16
        for (int k = 0; k < V; k++) acc[g][k] = _mm512_maskz_loadu_ps(mask[k], out[g] + 16 * k);
    }
    if (shared_first >= shared_last) shared_first = shared_last = c1;  // nothing shared: each alone
#pragma GCC unroll 4
    for (int g = 0; g < G; g++)
        whole_rows(type, V, 1, weight + g, values, row_stride, first[g], shared_first < last[g] ? shared_first : last[g],
                   mask, acc + g, 0);
    whole_rows(type, V, G, weight, values, row_stride, shared_first, shared_last, mask, acc, ahead);
#pragma GCC unroll 4
    for (int g = 0; g < G; g++) {
        whole_rows(type, V, 1, weight + g, values, row_stride, shared_last > first[g] ? shared_last : first[g], last[g],
                   mask, acc + g, 0);
#pragma GCC unroll 16
        for (int k = 0; k < V; k++) _mm512_mask_storeu_ps(out[g] + 16 * k, mask[k], acc[g][k]);
    }
}

// Every query, chunk after chunk: V vectors per row, groups of up to 24 / V queries (at most 4); the
// second group fetches the next chunk when it is whole.
KR_INLINE void whole_chunks(const int32_t type, const int V, const float *weights, size_t weights_stride,
                            const int32_t *begin, const int32_t *end, int64_t n_queries, const char *values,
                            size_t row_stride, const __mmask16 *mask, float *const *out) {
    const int group = WHOLE_MAX_SUMS / V < 4 ? WHOLE_MAX_SUMS / V : 4;
    int64_t rows_first, rows_last;
    const int64_t chunk = chunk_rows(begin, end, n_queries, row_stride, &rows_first, &rows_last);
    for (int64_t c0 = rows_first; c0 < rows_last; c0 += chunk) {
        const int64_t c1 = c0 + chunk < rows_last ? c0 + chunk : rows_last;
        for (int64_t i = 0; i < n_queries; i += group) {
            const int G = (int)(n_queries - i < group ? n_queries - i : group);
            const float *weight[4];
            for (int g = 0; g < G; g++) weight[g] = weights + (size_t)(i + g) * weights_stride;
            const size_t ahead = i == group && c1 + chunk <= rows_last ? (size_t)chunk * row_stride : 0;
#define WHOLE_GROUP(G) \
    whole_group(type, V, G, weight, begin + i, end + i, values, row_stride, c0, c1, mask, out + i, ahead)
            if (G == 1) WHOLE_GROUP(1);
            else if (G == 2 && V <= 8) WHOLE_GROUP(2);
            else if (G == 3 && V <= 8) WHOLE_GROUP(3);
            else if (G == 4 && V <= 4) WHOLE_GROUP(4);
#undef WHOLE_GROUP
        }
    }
}

// One instance per type and V in 4, 8, 16 (narrower rows take the next, their extra vectors masked off).
static void whole_values(int32_t type, int64_t n, const float *weights, size_t weights_stride, const int32_t *begin,
                         const int32_t *end, int64_t n_queries, const char *values, size_t row_stride, float *const *out) {
    __mmask16 mask[WHOLE_MAX_VECTORS];
    for (int k = 0; k < WHOLE_MAX_VECTORS; k++) {
        const int64_t lanes = n - 16 * k;
        mask[k] = lanes >= 16 ? 0xFFFF : lanes > 0 ? (__mmask16)((1u << lanes) - 1) : 0;
    }
    for (int64_t i = 0; i < n_queries; i++)
        for (int64_t e = 0; e < n; e++) out[i][e] = 0.0f;
    const int V = n <= 64 ? 4 : n <= 128 ? 8 : 16;
#define WHOLE_CHUNKS(TYPE, V) whole_chunks(TYPE, V, weights, weights_stride, begin, end, n_queries, values, row_stride, mask, out)
#define WHOLE_TYPE(TYPE) V == 4 ? WHOLE_CHUNKS(TYPE, 4) : V == 8 ? WHOLE_CHUNKS(TYPE, 8) : WHOLE_CHUNKS(TYPE, 16)
    if (type == KR_Q8_0) WHOLE_TYPE(KR_Q8_0);
    else if (type == KR_F16) WHOLE_TYPE(KR_F16);
    else WHOLE_TYPE(KR_F32);
#undef WHOLE_TYPE
#undef WHOLE_CHUNKS
}
#endif

void kr_attend_values_avx2(int32_t type, const void *values, size_t row_stride, int64_t n, const float *weights,
                           size_t weights_stride, const int32_t *begin, const int32_t *end, int64_t n_queries,
                           float *const *out) {
    if (n_queries < 1) return;
#if defined(KR_HAVE_AVX512)
    if (n <= 16 * WHOLE_MAX_VECTORS && n_queries <= CHUNKED_MAX_QUERIES) {
        whole_values(type, n, weights, weights_stride, begin, end, n_queries, values, row_stride, out);
        return;
    }
#endif
    const int64_t n_wide = n - n % (8 * WIDTH), n8 = n - n % 8;
    // A few queries over long rows: rows_in_order; up to CHUNKED_MAX_QUERIES: spans; more: column strips.
    const bool in_order = n_queries <= GROUP && row_stride >= ROWS_IN_ORDER_BYTES;
    const bool spans = !in_order && n_queries <= CHUNKED_MAX_QUERIES;
    if (in_order || spans) {
        for (int64_t i = 0; i < n_queries; i++)
            for (int64_t e = 0; e < n8; e++) out[i][e] = 0.0f;
    }
    if (in_order) {
        if (type == KR_Q8_0) rows_in_order(KR_Q8_0, weights, weights_stride, begin, end, n_queries, values, row_stride, n8, out);
        else if (type == KR_F16) rows_in_order(KR_F16, weights, weights_stride, begin, end, n_queries, values, row_stride, n8, out);
        else rows_in_order(KR_F32, weights, weights_stride, begin, end, n_queries, values, row_stride, n8, out);
    } else if (spans) {
        span_values(type, n8, weights, weights_stride, begin, end, n_queries, values, row_stride, out);
    }
    for (int64_t i = 0; i < n_queries; i += GROUP) {
        const int G = (int)(n_queries - i < GROUP ? n_queries - i : GROUP);
        const float *weight[GROUP];
        for (int g = 0; g < G; g++) weight[g] = weights + (size_t)(i + g) * weights_stride;
        const char *rows = values;
        for (int64_t e = 0; !in_order && !spans && e < n8; e += e < n_wide ? 8 * WIDTH : 8) {
            const int W = e < n_wide ? WIDTH : 1;
            const bool fetch = i == 0 && e == 0;  // the first strip of the first group: the rest find the rows in L2
            if (type == KR_Q8_0) fold_group_q8_0(W, G, weight, begin + i, end + i, rows, row_stride, e, out + i, fetch);
            else if (type == KR_F16) fold_group_f16(W, G, weight, begin + i, end + i, rows, row_stride, e, out + i, fetch);
            else fold_group_f32(W, G, weight, begin + i, end + i, rows, row_stride, e, out + i, fetch);
        }
        // values past the last 8 (f32/f16 only): the reference's scalar fold
        for (int g = 0; g < G; g++)
            for (int64_t e = n8; e < n; e++) {
                float y = 0.0f;
                for (int64_t p = begin[i + g]; p < end[i + g]; p++) {
                    const char *row = rows + (size_t)p * row_stride;
                    const float v = type == KR_F16 ? _cvtsh_ss(((const kr_f16 *)row)[e]) : ((const float *)row)[e];
                    y = fmaf(weight[g][p], v, y);
                }
                out[i + g][e] = y;
            }
    }
}

#endif

// ---------------------------------------------------------------------------------------------
// Test entry points (krafla.h): arguments checked, then one call of the chosen implementation.

static int check_impl(int impl, kr_error *err) {
    if (impl == KR_KERNEL_AVX2) {
#if !defined(KR_HAVE_AVX2)
        return kr_fail(err, KR_ERR_UNSUPPORTED, "this library was built with ISA=%s: it has no AVX2 kernels", kr_isa());
#endif
    } else if (impl != KR_KERNEL_DISPATCH && impl != KR_KERNEL_REFERENCE) {
        return kr_fail(err, KR_ERR_ARGUMENT, "kernel implementation %d is not one of 0 (dispatch), 1 (reference), 2 (avx2)",
                       impl);
    }
    return KR_OK;
}

int kr_test_attention_softmax(int impl, float *x, int64_t n, float scale, float softcap, kr_error *err) {
    int status = check_impl(impl, err);
    if (status) return status;
    if (n < 1 || !x) return kr_fail(err, KR_ERR_ARGUMENT, "softmax of %lld values: need at least one, and a buffer", (long long)n);
    if (!isfinite(scale) || !(softcap >= 0) || !isfinite(softcap))
        return kr_fail(err, KR_ERR_ARGUMENT, "scale %g must be finite and softcap %g finite and >= 0", scale, softcap);
    void (*kernel)(float *, int64_t, float, float, float) = impl == KR_KERNEL_REFERENCE ? kr_attention_softmax_ref : kr_attention_softmax;
#if defined(KR_HAVE_AVX2)
    if (impl == KR_KERNEL_AVX2) kernel = kr_attention_softmax_avx2;
#endif
    kernel(x, n, scale, softcap, -INFINITY);
    kr_ok(err);
    return KR_OK;
}

int kr_test_attend_scores(int impl, int32_t type, const void *keys, int64_t row_stride, int64_t n_rows, int64_t n,
                          const float *queries, int64_t n_queries, const int32_t *end, float *out, kr_error *err) {
    int status = check_impl(impl, err);
    if (status) return status;
    if (type != KR_F32 && type != KR_F16)
        return kr_fail(err, KR_ERR_ARGUMENT, "key rows of type %d: expected f32 (0) or f16 (1)", type);
    if (n < 1 || n_rows < 0 || n_queries < 0)
        return kr_fail(err, KR_ERR_ARGUMENT, "n %lld must be >= 1, n_rows %lld and n_queries %lld >= 0", (long long)n,
                       (long long)n_rows, (long long)n_queries);
    if (n_rows > 0 && row_stride < n * (type == KR_F32 ? 4 : 2))
        return kr_fail(err, KR_ERR_ARGUMENT, "row stride %lld bytes is shorter than a row of %lld values",
                       (long long)row_stride, (long long)n);
    if (!keys || !queries || !end || !out) return kr_fail(err, KR_ERR_ARGUMENT, "a buffer is NULL");
    for (int64_t i = 0; i < n_queries; i++)
        if (end[i] < 0 || end[i] > n_rows)
            return kr_fail(err, KR_ERR_ARGUMENT, "query %lld: positions [0, %d) are not inside [0, %lld)", (long long)i,
                           end[i], (long long)n_rows);
    void (*kernel)(int32_t, const void *, size_t, int64_t, const float *, int64_t, const int32_t *, float *, size_t) =
        impl == KR_KERNEL_REFERENCE ? kr_attend_scores_ref : kr_attend_scores;
#if defined(KR_HAVE_AVX2)
    if (impl == KR_KERNEL_AVX2) kernel = kr_attend_scores_avx2;
#endif
    kernel(type, keys, (size_t)row_stride, n, queries, n_queries, end, out, (size_t)n_rows);
    kr_ok(err);
    return KR_OK;
}

int kr_test_attend_values(int impl, int32_t type, const void *values, int64_t row_stride, int64_t n_rows, int64_t n,
                          const float *weights, int64_t n_queries, const int32_t *begin, const int32_t *end, float *out,
                          kr_error *err) {
    int status = check_impl(impl, err);
    if (status) return status;
    if (type != KR_F32 && type != KR_F16 && type != KR_Q8_0)
        return kr_fail(err, KR_ERR_ARGUMENT, "value rows of type %d: expected f32 (0), f16 (1) or q8_0 (3)", type);
    if (n < 1 || n_rows < 0 || n_queries < 0 || n_queries > 4096)
        return kr_fail(err, KR_ERR_ARGUMENT, "n %lld must be >= 1, n_rows %lld >= 0, n_queries %lld in [0, 4096]",
                       (long long)n, (long long)n_rows, (long long)n_queries);
    if (type == KR_Q8_0 && n % KR_QK)
        return kr_fail(err, KR_ERR_ARGUMENT, "q8_0 rows hold whole blocks of %d values, not %lld", KR_QK, (long long)n);
    int64_t row_bytes = type == KR_Q8_0 ? n / KR_QK * (int64_t)sizeof(kr_block_q8_0) : n * (type == KR_F32 ? 4 : 2);
    if (n_rows > 0 && row_stride < row_bytes)
        return kr_fail(err, KR_ERR_ARGUMENT, "row stride %lld bytes is shorter than a row of %lld values",
                       (long long)row_stride, (long long)n);
    if (!values || !weights || !begin || !end || !out) return kr_fail(err, KR_ERR_ARGUMENT, "a buffer is NULL");
    for (int64_t i = 0; i < n_queries; i++)
        if (begin[i] < 0 || begin[i] > end[i] || end[i] > n_rows)
            return kr_fail(err, KR_ERR_ARGUMENT, "query %lld: rows [%d, %d) are not inside [0, %lld)", (long long)i,
                           begin[i], end[i], (long long)n_rows);
    float *rows_out[4096];
    for (int64_t i = 0; i < n_queries; i++) rows_out[i] = out + i * n;
    void (*kernel)(int32_t, const void *, size_t, int64_t, const float *, size_t, const int32_t *, const int32_t *,
                   int64_t, float *const *) = impl == KR_KERNEL_REFERENCE ? kr_attend_values_ref : kr_attend_values;
#if defined(KR_HAVE_AVX2)
    if (impl == KR_KERNEL_AVX2) kernel = kr_attend_values_avx2;
#endif
    kernel(type, values, (size_t)row_stride, n, weights, (size_t)n_rows, begin, end, n_queries, rows_out);
    kr_ok(err);
    return KR_OK;
}
