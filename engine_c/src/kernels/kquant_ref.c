// kquant_ref.c: the plain-C reference of the k-quant kernels (q4_K, q5_K, q6_K weights against q8_K
// activations; kernels.h, "k-quants"), their dequantization, and their packed layout.
//
// These define what the AVX2 and AVX-512 versions in kquant_avx2.c compute, down to the float
// operations: per output, super-block after super-block, the exact integer sums of kernels.h, then
// one fused multiply-add for the scales (and for q4_K/q5_K one more for the mins).
#include "kernels/kernels.h"
#include "krafla.h"

#include <math.h>
#include <stdbool.h>
#include <string.h>

int kr_is_kquant(int32_t weight_type) { return weight_type == KR_Q4_K || weight_type == KR_Q5_K || weight_type == KR_Q6_K; }

size_t kr_kquant_block_bytes(int32_t weight_type) {
    switch (weight_type) {
    case KR_Q4_K: return sizeof(kr_block_q4_K);
    case KR_Q5_K: return sizeof(kr_block_q5_K);
    case KR_Q6_K: return sizeof(kr_block_q6_K);
    default: return 0;
    }
}

// ---------------------------------------------------------------------------------------------
// q8_K quantization (ggml's quantize_row_q8_K_ref)

void kr_quantize_row_q8_K_ref(const float *x, kr_block_q8_K *y, int64_t n) {
    for (int64_t b = 0; b < n / KR_QK_K; b++) {
        const float *xb = x + b * KR_QK_K;
        float amax = 0.0f, max = 0.0f;
        bool has_nan = false;
        for (int j = 0; j < KR_QK_K; j++) {
            const float v = fabsf(xb[j]);
            if (v > amax) {  // skips NaN; the first element of the largest magnitude wins
                amax = v;
                max = xb[j];
            }
            has_nan |= isnan(v);
        }
        if (amax == 0.0f && !has_nan) {
            memset(&y[b], 0, sizeof y[b]);
            continue;
        }
        // Beyond ggml (finite input only): a NaN in the block makes d NaN so it propagates; x * iscale
        // is clamped to [-127, 127] (an infinite max gives iscale -0, a subnormal one an infinite iscale)
        // and a NaN x * iscale quantizes to 0. For finite input this is ggml's min(127, nearest_int(.)).
        const float iscale = amax == 0.0f ? 0.0f : -127.0f / max;
        for (int j = 0; j < KR_QK_K; j++) {
            float scaled = iscale * xb[j];
            scaled = scaled > 127.0f ? 127.0f : scaled < -127.0f ? -127.0f : scaled;
            y[b].q[j] = isnan(scaled) ? 0 : (int8_t)rintf(scaled);  // round half to even, as nearest_int
        }
        for (int j = 0; j < KR_QK_K / 16; j++) {
            int sum = 0;
            for (int i = 0; i < 16; i++) sum += y[b].q[16 * j + i];
            y[b].bsums[j] = (int16_t)sum;
        }
        y[b].d = has_nan ? NAN : 1.0f / iscale;
    }
}

// ---------------------------------------------------------------------------------------------
// The quants of one super-block, one weight at a time

// ggml's 6-bit packing of 8 scales and 8 mins into 12 bytes.
static void scales_mins(const uint8_t packed[12], uint8_t sc[8], uint8_t m[8]) {
    for (int j = 0; j < 4; j++) {
        sc[j] = packed[j] & 63;
        m[j] = packed[j + 4] & 63;
        sc[j + 4] = (uint8_t)((packed[j + 8] & 0x0f) | ((packed[j] >> 6) << 4));
        m[j + 4] = (uint8_t)((packed[j + 8] >> 4) | ((packed[j + 4] >> 6) << 4));
    }
}

static int q4_K_quant(const uint8_t qs[128], int e) {
    const uint8_t byte = qs[32 * (e / 64) + e % 32];
    return (e % 64) < 32 ? byte & 0x0f : byte >> 4;
}

// q4_K (qh NULL) or q5_K: 0..15 or 0..31.
static int q45_K_quant(const uint8_t qs[128], const uint8_t *qh, int e) {
    return q4_K_quant(qs, e) | (qh ? ((qh[e % 32] >> (e / 32)) & 1) << 4 : 0);
}

// The fields of a q4_K or q5_K super-block (both start with d, dmin and the scales).
typedef struct {
    const kr_block_q4_K *head;
    const uint8_t *qs, *qh;
} q45_K_fields;

static q45_K_fields q45_K(int32_t weight_type, const void *block) {
    q45_K_fields f = {block, ((const kr_block_q4_K *)block)->qs, NULL};
    if (weight_type == KR_Q5_K) f.qs = ((const kr_block_q5_K *)block)->qs, f.qh = ((const kr_block_q5_K *)block)->qh;
    return f;
}

static int q6_K_quant(const kr_block_q6_K *block, int e) {
    const int h = e / 128, part = (e % 128) / 32, l = e % 32;
    const uint8_t low = block->ql[64 * h + 32 * (part & 1) + l];
    const int nibble = part < 2 ? low & 0x0f : low >> 4;
    return nibble | (((block->qh[32 * h + l] >> (2 * part)) & 3) << 4);
}

// ---------------------------------------------------------------------------------------------
// Dequantization (ggml's dequantize_row_q*_K: the scale and min products first, in float)

void kr_dequantize_row_kquant(int32_t weight_type, const void *row, float *out, int64_t n) {
    for (int64_t b = 0; b < n / KR_QK_K; b++) {
        float *y = out + b * KR_QK_K;
        if (weight_type == KR_Q6_K) {
            const kr_block_q6_K *block = (const kr_block_q6_K *)row + b;
            const float d = kr_f16_to_f32(block->d);
            for (int e = 0; e < KR_QK_K; e++) y[e] = d * (float)block->scales[e / 16] * (float)(q6_K_quant(block, e) - 32);
            continue;
        }
        const q45_K_fields f = q45_K(weight_type, (const char *)row + (size_t)b * kr_kquant_block_bytes(weight_type));
        uint8_t sc[8], m[8];
        scales_mins(f.head->scales, sc, m);
        const float d = kr_f16_to_f32(f.head->d), dmin = kr_f16_to_f32(f.head->dmin);
        for (int e = 0; e < KR_QK_K; e++) {
            const float scale = d * (float)sc[e / 32], min = dmin * (float)m[e / 32];
            y[e] = scale * (float)q45_K_quant(f.qs, f.qh, e) - min;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Dot products in the order of kernels.h

static float dot_superblock(int32_t weight_type, const void *block, const kr_block_q8_K *a, float acc) {
    if (weight_type == KR_Q6_K) {
        const kr_block_q6_K *w = block;
        int32_t isum = 0;
        for (int j = 0; j < 16; j++) {
            int32_t sum = 0;
            for (int e = 16 * j; e < 16 * j + 16; e++) sum += (q6_K_quant(w, e) - 32) * (int32_t)a->q[e];
            isum += (int32_t)w->scales[j] * sum;
        }
        return fmaf(kr_f16_to_f32_ref(w->d) * a->d, (float)isum, acc);
    }
    const q45_K_fields f = q45_K(weight_type, block);
    uint8_t sc[8], m[8];
    scales_mins(f.head->scales, sc, m);
    int32_t isum = 0, msum = 0;
    for (int j = 0; j < 8; j++) {
        int32_t sum = 0;
        for (int e = 32 * j; e < 32 * j + 32; e++) sum += q45_K_quant(f.qs, f.qh, e) * (int32_t)a->q[e];
        isum += (int32_t)sc[j] * sum;
        msum += (int32_t)m[j] * ((int32_t)a->bsums[2 * j] + (int32_t)a->bsums[2 * j + 1]);
    }
    const float d = kr_f16_to_f32_ref(f.head->d), dmin = kr_f16_to_f32_ref(f.head->dmin);
    acc = fmaf(d * a->d, (float)isum, acc);
    return fmaf(-(dmin * a->d), (float)msum, acc);
}

float kr_dot_kquant_ref(int32_t weight_type, const void *row, const kr_block_q8_K *a, int64_t cols) {
    const size_t block_bytes = kr_kquant_block_bytes(weight_type);
    float acc = 0.0f;
    for (int64_t b = 0; b < cols / KR_QK_K; b++) acc = dot_superblock(weight_type, (const char *)row + (size_t)b * block_bytes, a + b, acc);
    return acc;
}

// ---------------------------------------------------------------------------------------------
// Packed layout (docs/kernels.md, "Packed k-quants"): a group of 8 rows, super-block after
// super-block, each group super-block the size of 8 file super-blocks:
//
//   q4_K (1152 bytes): 0 the 8 rows' d (f16), 16 their dmin, 32 scale bytes (byte 8j + r: sc[j] of
//     row r in bits 0..5, bits 4..5 of m[j] in bits 6..7), 96 min nibbles (byte 8k + r: m[k] & 15 low,
//     m[k+4] & 15 high), 128 quants: chunk (c, i) at 128 + 256c + 32i holds bytes 32c+4i..32c+4i+3 of
//     each row's qs, row after row (low nibbles: weights 64c+4i.., high nibbles: 64c+32+4i..).
//   q5_K (1408 bytes): q4_K's first 128 bytes, then chunk i of qh (bytes 4i..4i+3 of each row's
//     qh) at 128 + 64i, each followed by the quants' chunk (0, i), then the quants' chunk (c, i) of
//     c >= 1 at 384 + 256c + 32i (kr_q45_K_qs_at, kr_q5_K_qh_at in kernels.h).
//   q6_K (1680 bytes): 0 the 8 rows' d, 16 scales (byte 8j + r: scales[j] of row r), then chunk i
//     of ql (bytes 4i..4i+3 of each row) at kr_q6_K_ql_at(i) and chunk i of qh at kr_q6_K_qh_at(i)
//     (kernels.h): per half h of the weights, qh's chunks each followed by one of ql's, then the rest
//     of ql's, the order in which the tiles read them.
// A q4_K matrix of rows longer than 20 super-blocks is stored in column slices of at most 16, each
// of them this layout of its super-blocks (kernels.h, kr_slice_blocks).

#define GROUP_ROWS KR_PACK_ROWS

// Row r's super-block in file form <-> its place in a group super-block.
static void pack_superblock(int32_t weight_type, const char *block, int r, char *group) {
    if (weight_type == KR_Q6_K) {
        const kr_block_q6_K *w = (const kr_block_q6_K *)block;
        memcpy(group + 2 * r, &w->d, 2);
        for (int j = 0; j < 16; j++) group[16 + 8 * j + r] = (char)w->scales[j];
        for (int i = 0; i < 32; i++) memcpy(group + kr_q6_K_ql_at(i) + 4 * r, w->ql + 4 * i, 4);
        for (int i = 0; i < 16; i++) memcpy(group + kr_q6_K_qh_at(i) + 4 * r, w->qh + 4 * i, 4);
        return;
    }
    const kr_block_q4_K *w = (const kr_block_q4_K *)block;  // q5_K starts the same way
    uint8_t sc[8], m[8];
    scales_mins(w->scales, sc, m);
    memcpy(group + 2 * r, &w->d, 2);
    memcpy(group + 16 + 2 * r, &w->dmin, 2);
    for (int j = 0; j < 8; j++) group[32 + 8 * j + r] = (char)(sc[j] | ((m[j] >> 4) << 6));
    for (int k = 0; k < 4; k++) group[96 + 8 * k + r] = (char)((m[k] & 15) | ((m[k + 4] & 15) << 4));
    const uint8_t *qs = weight_type == KR_Q4_K ? w->qs : ((const kr_block_q5_K *)block)->qs;
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 8; i++) memcpy(group + kr_q45_K_qs_at(weight_type == KR_Q5_K, c, i) + 4 * r, qs + 32 * c + 4 * i, 4);
    if (weight_type == KR_Q5_K)
        for (int i = 0; i < 8; i++) memcpy(group + kr_q5_K_qh_at(i) + 4 * r, ((const kr_block_q5_K *)block)->qh + 4 * i, 4);
}

// The inverse: row r's super-block in file form. Scales and mins are re-packed into ggml's 12 bytes
// (the packing is a bijection of the 6-bit values, so these are the file's bytes).
static void unpack_superblock(int32_t weight_type, const char *group, int r, char *block) {
    if (weight_type == KR_Q6_K) {
        kr_block_q6_K *w = (kr_block_q6_K *)block;
        memcpy(&w->d, group + 2 * r, 2);
        for (int j = 0; j < 16; j++) w->scales[j] = (int8_t)group[16 + 8 * j + r];
        for (int i = 0; i < 32; i++) memcpy(w->ql + 4 * i, group + kr_q6_K_ql_at(i) + 4 * r, 4);
        for (int i = 0; i < 16; i++) memcpy(w->qh + 4 * i, group + kr_q6_K_qh_at(i) + 4 * r, 4);
        return;
    }
    kr_block_q4_K *w = (kr_block_q4_K *)block;
    uint8_t sc[8], m[8];
    for (int j = 0; j < 8; j++) {
        const uint8_t byte = (uint8_t)group[32 + 8 * j + r], nibbles = (uint8_t)group[96 + 8 * (j % 4) + r];
        sc[j] = byte & 63;
        m[j] = (uint8_t)(((j < 4 ? nibbles : nibbles >> 4) & 15) | ((byte >> 6) << 4));
    }
    memcpy(&w->d, group + 2 * r, 2);
    memcpy(&w->dmin, group + 16 + 2 * r, 2);
    for (int j = 0; j < 4; j++) {
        w->scales[j] = (uint8_t)(sc[j] | ((sc[j + 4] >> 4) << 6));
        w->scales[j + 4] = (uint8_t)(m[j] | ((m[j + 4] >> 4) << 6));
        w->scales[j + 8] = (uint8_t)((sc[j + 4] & 15) | ((m[j + 4] & 15) << 4));
    }
    uint8_t *qs = weight_type == KR_Q4_K ? w->qs : ((kr_block_q5_K *)block)->qs;
    for (int c = 0; c < 4; c++)
        for (int i = 0; i < 8; i++) memcpy(qs + 32 * c + 4 * i, group + kr_q45_K_qs_at(weight_type == KR_Q5_K, c, i) + 4 * r, 4);
    if (weight_type == KR_Q5_K)
        for (int i = 0; i < 8; i++) memcpy(((kr_block_q5_K *)block)->qh + 4 * i, group + kr_q5_K_qh_at(i) + 4 * r, 4);
}

void kr_pack_rows_kquant(int32_t weight_type, const void *src, void *dst, int64_t rows, int64_t cols) {
    kr_pack_groups(weight_type, src, dst, rows, cols, kr_kquant_block_bytes(weight_type), pack_superblock);
}

void kr_packed_block_kquant(int32_t weight_type, const void *w, int64_t rows, int64_t cols, int64_t r, int64_t b,
                            void *block) {
    const size_t block_bytes = kr_kquant_block_bytes(weight_type), row_bytes = (size_t)(cols / KR_QK_K) * block_bytes;
    if (r >= rows - rows % GROUP_ROWS) {
        memcpy(block, (const char *)w + (size_t)r * row_bytes + (size_t)b * block_bytes, block_bytes);
        return;
    }
    const char *group = kr_packed_group_block(weight_type, w, rows - rows % GROUP_ROWS, cols / KR_QK_K, block_bytes, r, b);
    unpack_superblock(weight_type, group, (int)(r % GROUP_ROWS), block);
}

// Each row's super-blocks back in file form, then the reference's steps.
void kr_matmul_packed_kquant_ref(int32_t weight_type, const void *w, int64_t rows, int64_t cols, const void *prepared,
                                 int64_t n_tokens, float *out, int64_t out_stride, int64_t row_begin, int64_t row_end) {
    const int64_t n_blocks = cols / KR_QK_K;
    for (int64_t r = row_begin; r < row_end; r++)
        for (int64_t t = 0; t < n_tokens; t++) {
            const kr_block_q8_K *a = (const kr_block_q8_K *)prepared + t * n_blocks;
            float acc = 0.0f;
            for (int64_t b = 0; b < n_blocks; b++) {
                union { kr_block_q4_K q4; kr_block_q5_K q5; kr_block_q6_K q6; } block;
                kr_packed_block_kquant(weight_type, w, rows, cols, r, b, &block);
                acc = dot_superblock(weight_type, &block, a + b, acc);
            }
            out[t * out_stride + r] = acc;
        }
}
