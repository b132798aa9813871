// quant_ref.c: the plain-C reference for the kernels of kernels.h (suffix _ref; the f16
// conversions' are f16.c's, the k-quants' kquant_ref.c's, q4_1, q5_0 and q5_1's legacy_ref.c's).
//
// These are the definition of what each kernel computes, down to the order of the float
// operations: the AVX2 versions in kernels_avx2.c follow the same order, so the two agree bit for
// bit (tests/test_kernels.py checks that), and a generic build gives the same logits as an avx2 one.
//
// The reduction order over K of the float dot products (f32, f16, bf16 weights; see kr_lanes_sum):
//   - 8 lanes: lane l accumulates, with one fused multiply-add per step, the elements whose index
//     is l modulo 8;
//   - the lanes are added as ((l0+l4) + (l2+l6)) + ((l1+l5) + (l3+l7)), the order an AVX2
//     horizontal sum (high half + low half, then movehl, then the last pair) produces;
//   - a tail (n not a multiple of 8) is then added element by element with fmaf.
// The quantized dot products (q8_0, q4_0 weights against q8_0 activations) go block by block:
//   acc = fmaf(d_weight * d_activation, (float)integer_sum_of_the_block, acc), acc starting at 0.
// The integer sum is exact (|sum| <= 32 * 128 * 127 < 2^24, so also exact as a float) and the
// product of two f16 scales is exact in float, so a kernel may compute the sums in any way and
// any number of rows side by side, and still give these bits.
#include "kernels/kernels.h"
#include "kernels/legacy.h"
#include "kernels/lowbit.h"
#include "krafla.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// q8_0 quantization (ggml's quantize_row_q8_0_ref)

void kr_quantize_row_q8_0_ref(const float *x, kr_block_q8_0 *y, int64_t n) {
    int64_t n_blocks = n / KR_QK;
    for (int64_t b = 0; b < n_blocks; b++) {
        const float *xb = x + b * KR_QK;
        float amax = 0.0f;
        bool has_nan = false;
        for (int j = 0; j < KR_QK; j++) {
            const float v = fabsf(xb[j]);
            amax = v > amax ? v : amax;  // skips NaN
            has_nan |= isnan(v);
        }
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        // Beyond ggml, which defines finite, normal-sized input only: a NaN makes the block's scale
        // NaN so it propagates; x * id is clamped to [-127, 127] (it can only leave that range when
        // 1/d overflows for a subnormal amax) and a NaN x * id (NaN x, or 0 * inf) quantizes to 0.
        y[b].d = kr_f32_to_f16_ref(has_nan ? NAN : d);
        for (int j = 0; j < KR_QK; j++) {
            float scaled = xb[j] * id;
            scaled = scaled > 127.0f ? 127.0f : scaled < -127.0f ? -127.0f : scaled;
            y[b].q[j] = isnan(scaled) ? 0 : (int8_t)roundf(scaled);
        }
    }
}

// q8_0 blocks (kr_quantize_row_q8_0_ref's values) with the scale as a float and the sum of the quants.
void kr_quantize_row_q8_sum_ref(const float *x, kr_block_q8_sum *y, int64_t n) {
    for (int64_t b = 0; b < n / KR_QK; b++) {
        kr_block_q8_0 block;
        kr_quantize_row_q8_0_ref(x + b * KR_QK, &block, KR_QK);
        int32_t sum = 0;
        for (int j = 0; j < KR_QK; j++) sum += block.q[j];
        y[b].d = kr_f16_to_f32_ref(block.d);
        y[b].sum = sum;
        memcpy(y[b].q, block.q, KR_QK);
    }
}

// ---------------------------------------------------------------------------------------------
// Dot products in the shared reduction order

float kr_lanes_sum(const float lanes[8]) {
    const float s0 = lanes[0] + lanes[4], s1 = lanes[1] + lanes[5];
    const float s2 = lanes[2] + lanes[6], s3 = lanes[3] + lanes[7];
    return (s0 + s2) + (s1 + s3);
}

// The exact integer sum of one block pair's 32 products.
int32_t kr_block_sum_q8_0_ref(const kr_block_q8_0 *w, const kr_block_q8_0 *a) {
    int32_t sum = 0;
    for (int j = 0; j < KR_QK; j++) sum += (int32_t)w->q[j] * (int32_t)a->q[j];
    return sum;
}

int32_t kr_block_sum_q4_0_ref(const kr_block_q4_0 *w, const kr_block_q8_sum *a) {
    int32_t sum = 0;
    for (int j = 0; j < KR_QK / 2; j++) {
        sum += ((w->q[j] & 0x0f) - 8) * (int32_t)a->q[j];
        sum += ((w->q[j] >> 4) - 8) * (int32_t)a->q[j + KR_QK / 2];
    }
    return sum;
}

// acc plus the blocks' terms, in block order (kr_matmul starts acc at 0).
static float dot_q8_0_ref(const kr_block_q8_0 *w, const kr_block_q8_0 *a, int64_t n_blocks, float acc) {
    for (int64_t b = 0; b < n_blocks; b++)
        acc = fmaf(kr_f16_to_f32_ref(w[b].d) * kr_f16_to_f32_ref(a[b].d), (float)kr_block_sum_q8_0_ref(&w[b], &a[b]), acc);
    return acc;
}

static float dot_q4_0_ref(const kr_block_q4_0 *w, const kr_block_q8_sum *a, int64_t n_blocks, float acc) {
    for (int64_t b = 0; b < n_blocks; b++)
        acc = fmaf(kr_f16_to_f32_ref(w[b].d) * a[b].d, (float)kr_block_sum_q4_0_ref(&w[b], &a[b]), acc);
    return acc;
}

// Element k of a float row (f32, f16 or bf16) as a float.
static inline float float_weight(int32_t type, const void *row, int64_t k) {
    switch (type) {
    case KR_F16: return kr_f16_to_f32_ref(((const kr_f16 *)row)[k]);
    case KR_BF16: return kr_bf16_to_f32(((const uint16_t *)row)[k]);
    default: return ((const float *)row)[k];
    }
}

// The float dot product in the order above; `type` is a constant in each caller, so each gets a
// loop of its own.
static inline float dot_float_ref(int32_t type, const void *a, const float *b, int64_t n) {
    float lanes[8] = {0};
    const int64_t n8 = n - n % 8;
    for (int64_t k = 0; k < n8; k++) lanes[k % 8] = fmaf(float_weight(type, a, k), b[k], lanes[k % 8]);
    float sum = kr_lanes_sum(lanes);
    for (int64_t k = n8; k < n; k++) sum = fmaf(float_weight(type, a, k), b[k], sum);
    return sum;
}

float kr_dot_f32_ref(const float *a, const float *b, int64_t n) { return dot_float_ref(KR_F32, a, b, n); }
float kr_dot_f16_f32_ref(const kr_f16 *a, const float *b, int64_t n) { return dot_float_ref(KR_F16, a, b, n); }
static float dot_bf16_f32_ref(const uint16_t *a, const float *b, int64_t n) { return dot_float_ref(KR_BF16, a, b, n); }

void kr_axpy_f32_ref(float a, const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = fmaf(a, x[i], y[i]);
}

void kr_axpy_f16_f32_ref(float a, const kr_f16 *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = fmaf(a, kr_f16_to_f32_ref(x[i]), y[i]);
}

void kr_dot_rows_ref(int32_t type, const void *rows, size_t row_stride, int64_t n_rows, const float *x, int64_t n, float *out) {
    for (int64_t i = 0; i < n_rows; i++) {
        const void *row = (const char *)rows + (size_t)i * row_stride;
        out[i] = type == KR_F16 ? kr_dot_f16_f32_ref(row, x, n) : kr_dot_f32_ref(row, x, n);
    }
}

void kr_axpy_rows_ref(int32_t type, const float *weights, const void *rows, size_t row_stride, int64_t n_rows, float *y,
                      int64_t n) {
    for (int64_t i = 0; i < n_rows; i++) {
        const void *row = (const char *)rows + (size_t)i * row_stride;
        if (type == KR_Q8_0) {  // KV cache q8_0 (owner: speed): y += (weight * d) * q, per block
            const kr_block_q8_0 *blocks = row;
            for (int64_t e = 0; e < n; e++) {
                const float scale = weights[i] * kr_f16_to_f32_ref(blocks[e / KR_QK].d);
                y[e] = fmaf(scale, (float)blocks[e / KR_QK].q[e % KR_QK], y[e]);
            }
        } else if (type == KR_F16)
            kr_axpy_f16_f32_ref(weights[i], row, y, n);
        else
            kr_axpy_f32_ref(weights[i], row, y, n);
    }
}

// ---------------------------------------------------------------------------------------------
// exp and the functions built on it. x is clamped to [-104, 89] (exp is 0 below and inf above in
// float anyway), n = round(x / ln 2), r = x - n ln 2 in two fmaf steps (ln 2 split in a high part
// with few bits and a low part), exp(r) by a degree-7 Taylor polynomial in Horner form, then times
// 2^(n/2) and 2^(n - n/2): two exact powers, so only the last multiply rounds (into the
// subnormals or to inf when it must).

#define KR_EXP_LOW (-104.0f)
#define KR_EXP_HIGH 89.0f
#define KR_LOG2E 1.44269504f
#define KR_LN2_HIGH 0.693145752f
#define KR_LN2_LOW 1.42860677e-06f

static inline float power_of_two(int e) { return kr_bits_float((uint32_t)(e + 127) << 23); }  // e in [-126, 127]

float kr_exp_one_ref(float x) {
    if (isnan(x)) return x;
    const float c = x < KR_EXP_LOW ? KR_EXP_LOW : x > KR_EXP_HIGH ? KR_EXP_HIGH : x;
    const float n = rintf(c * KR_LOG2E);
    float r = fmaf(n, -KR_LN2_HIGH, c);
    r = fmaf(n, -KR_LN2_LOW, r);
    float p = 1.0f / 5040.0f;
    p = fmaf(p, r, 1.0f / 720.0f);
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    const int e = (int)n, e1 = e / 2;
    return p * power_of_two(e1) * power_of_two(e - e1);
}

void kr_exp_f32_ref(const float *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = kr_exp_one_ref(x[i]);
}

// Eight running maxima, lane j over the ids i with i % 8 == j (strict comparison: a lane keeps its
// lowest id among equals), then the lanes' best, ties to the lower id; the checks need no branch.
int64_t kr_argmax_f32_ref(const float *x, int64_t n) {
    if (n <= 0) return -1;
    float best[8];
    int64_t at[8];
    for (int j = 0; j < 8; j++) best[j] = x[0], at[j] = 0;
    bool bad = false;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) {
            bad |= !(x[i + j] < INFINITY);  // NaN or +inf
            if (x[i + j] > best[j]) best[j] = x[i + j], at[j] = i + j;
        }
    for (; i < n; i++) {
        bad |= !(x[i] < INFINITY);
        if (x[i] > best[i & 7]) best[i & 7] = x[i], at[i & 7] = i;
    }
    int64_t r = at[0];
    for (int j = 1; j < 8; j++)
        if (best[j] > x[r] || (best[j] == x[r] && at[j] < r)) r = at[j];
    return bad || x[r] == -INFINITY ? -1 : r;
}

float kr_exp_shift_sum_f32_ref(float *x, int64_t n, float shift) {
    float lanes[8] = {0};
    const int64_t n8 = n - n % 8;
    for (int64_t i = 0; i < n8; i++) {
        x[i] = kr_exp_one_ref(x[i] - shift);
        lanes[i % 8] += x[i];
    }
    float sum = kr_lanes_sum(lanes);
    for (int64_t i = n8; i < n; i++) {
        x[i] = kr_exp_one_ref(x[i] - shift);
        sum += x[i];
    }
    return sum;
}

void kr_silu_mul_f32_ref(float *gate, const float *up, int64_t n) {
    for (int64_t i = 0; i < n; i++) gate[i] = gate[i] / (1.0f + kr_exp_one_ref(-gate[i])) * up[i];
}

void kr_swiglu_oai_mul_f32_ref(float *gate, const float *up, int64_t n, float alpha, float limit) {
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i] > limit ? limit : gate[i];  // comparisons, not fminf: NaN stays NaN
        const float u = up[i] > limit ? limit : up[i] < -limit ? -limit : up[i];
        gate[i] = g / (1.0f + kr_exp_one_ref(-alpha * g)) * (u + 1.0f);
    }
}

#define KR_SQRT_2_OVER_PI 0.797884583f

void kr_gelu_tanh_mul_f32_ref(float *gate, const float *up, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        const float g = gate[i];
        const float z = KR_SQRT_2_OVER_PI * fmaf(0.044715f * g, g * g, g);
        const float t = 1.0f - 2.0f / (kr_exp_one_ref(2.0f * z) + 1.0f);
        gate[i] = 0.5f * g * (1.0f + t) * up[i];
    }
}

// ---------------------------------------------------------------------------------------------
// Matmul: one dot product per (token, row), in the order above

void kr_matmul_ref(int32_t weight_type, const void *w, int64_t cols, const void *prepared, int64_t n_tokens,
                   float *out, int64_t out_stride, int64_t row_begin, int64_t row_end) {
    const size_t w_row_bytes = kr_weight_row_bytes(weight_type, cols);
    const size_t a_row_bytes = kr_activation_row_bytes(weight_type, cols);
    for (int64_t t = 0; t < n_tokens; t++) {
        const void *a = (const char *)prepared + (size_t)t * a_row_bytes;
        for (int64_t r = row_begin; r < row_end; r++) {
            const void *wr = (const char *)w + (size_t)r * w_row_bytes;
            float value = 0.0f;
            switch (weight_type) {
            case KR_F32: value = kr_dot_f32_ref(wr, a, cols); break;
            case KR_F16: value = kr_dot_f16_f32_ref(wr, a, cols); break;
            case KR_BF16: value = dot_bf16_f32_ref(wr, a, cols); break;
            case KR_Q8_0: value = dot_q8_0_ref(wr, a, cols / KR_QK, 0.0f); break;
            case KR_Q4_0: value = dot_q4_0_ref(wr, a, cols / KR_QK, 0.0f); break;
            case KR_Q4_1:
            case KR_Q5_0:
            case KR_Q5_1: value = kr_dot_legacy_ref(weight_type, wr, a, cols / KR_QK); break;
            case KR_Q4_K:
            case KR_Q5_K:
            case KR_Q6_K: value = kr_dot_kquant_ref(weight_type, wr, a, cols); break;
            case KR_Q2_K:
            case KR_Q3_K:
            case KR_IQ4_NL:
            case KR_IQ4_XS:
            case KR_MXFP4: value = kr_dot_lowbit_ref(weight_type, wr, a, cols); break;
            default: break;  // kr_kernel_type_supported() is checked where a tensor's type enters
            }
            out[t * out_stride + r] = value;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Packed weights (kernels.h, "Packed weights"; owner: speed)

// Where row r (of a whole group) keeps quant byte j of block b in the packed layout, relative to the
// group's block: after the 8 scales, chunk j / 4, row r, byte j % 4.
static size_t packed_quant_at(int64_t r, int j) { return 2 * KR_PACK_ROWS + (size_t)(j / 4) * 4 * KR_PACK_ROWS + 4 * (size_t)r + (size_t)(j % 4); }

// Row r's q4_0 or q8_0 block into its group's block: the scale among the 8 scales, the quants in
// chunks of 4 bytes.
static void pack_block(int32_t weight_type, const char *block, int r, char *group_block) {
    const int quant_bytes = weight_type == KR_Q4_0 ? KR_QK / 2 : KR_QK;
    memcpy(group_block + 2 * r, block, 2);
    for (int j = 0; j < quant_bytes; j += 4) memcpy(group_block + packed_quant_at(r, j), block + 2 + j, 4);
}

void kr_pack_rows(int32_t weight_type, const void *src, void *dst, int64_t rows, int64_t cols) {
    if (kr_legacy_packs(weight_type)) {
        kr_pack_rows_legacy(weight_type, src, dst, rows, cols);
        return;
    }
    if (kr_is_kquant(weight_type)) {
        kr_pack_rows_kquant(weight_type, src, dst, rows, cols);
        return;
    }
    const size_t block_bytes = weight_type == KR_Q4_0 ? sizeof(kr_block_q4_0) : sizeof(kr_block_q8_0);
    kr_pack_groups(weight_type, src, dst, rows, cols, block_bytes, pack_block);
}

void kr_packed_block(int32_t weight_type, const void *w, int64_t rows, int64_t cols, int64_t r, int64_t b, void *out) {
    if (kr_legacy_packs(weight_type)) {
        kr_packed_block_legacy(weight_type, w, rows, cols, r, b, out);
        return;
    }
    if (kr_is_kquant(weight_type)) {
        kr_packed_block_kquant(weight_type, w, rows, cols, r, b, out);
        return;
    }
    char *block = out;
    const size_t row_bytes = kr_weight_row_bytes(weight_type, cols);
    const size_t block_bytes = weight_type == KR_Q4_0 ? sizeof(kr_block_q4_0) : sizeof(kr_block_q8_0);
    const int64_t grouped = rows - rows % KR_PACK_ROWS;
    if (r >= grouped) {
        memcpy(block, (const char *)w + (size_t)r * row_bytes + (size_t)b * block_bytes, block_bytes);
        return;
    }
    const int64_t offset = r % KR_PACK_ROWS;
    const char *group_block = kr_packed_group_block(weight_type, w, grouped, cols / KR_QK, block_bytes, r, b);
    memcpy(block, group_block + 2 * offset, 2);
    for (int j = 0; j < (int)block_bytes - 2; j++) block[2 + j] = group_block[packed_quant_at(offset, j)];
}

// Each row's blocks back in file form, then the reference dot's steps (dot_q4_0_ref / dot_q8_0_ref).
void kr_matmul_packed_ref(int32_t weight_type, const void *w, int64_t rows, int64_t cols, const void *prepared,
                          int64_t n_tokens, float *out, int64_t out_stride, int64_t row_begin, int64_t row_end) {
    if (!kr_packable(weight_type)) {
        kr_matmul_ref(weight_type, w, cols, prepared, n_tokens, out, out_stride, row_begin, row_end);
        return;
    }
    if (kr_legacy_packs(weight_type)) {
        kr_matmul_packed_legacy_ref(weight_type, w, rows, cols, prepared, n_tokens, out, out_stride, row_begin, row_end);
        return;
    }
    if (kr_is_kquant(weight_type)) {
        kr_matmul_packed_kquant_ref(weight_type, w, rows, cols, prepared, n_tokens, out, out_stride, row_begin, row_end);
        return;
    }
    const size_t a_row_bytes = kr_activation_row_bytes(weight_type, cols);
    for (int64_t r = row_begin; r < row_end; r++)
        for (int64_t t = 0; t < n_tokens; t++) {
            const char *a = (const char *)prepared + (size_t)t * a_row_bytes;
            float acc = 0.0f;
            for (int64_t b = 0; b < cols / KR_QK; b++) {
                union { kr_block_q4_0 q4; kr_block_q8_0 q8; } block;
                kr_packed_block(weight_type, w, rows, cols, r, b, &block);
                acc = weight_type == KR_Q4_0 ? dot_q4_0_ref(&block.q4, (const kr_block_q8_sum *)a + b, 1, acc)
                                             : dot_q8_0_ref(&block.q8, (const kr_block_q8_0 *)a + b, 1, acc);
            }
            out[t * out_stride + r] = acc;
        }
}
