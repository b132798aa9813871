// legacy_ref.c: the plain-C reference of the q4_1, q5_0 and q5_1 kernels (legacy.h; suffix _ref),
// and the packed layout of these and of iq4_nl and mxfp4.
//
// These define what the kernels compute, down to the order of the float operations: the AVX2 and
// AVX-512 tiles in legacy_avx2.c and legacy_avx512.c follow the same per-block sequence, so all of
// them agree bit for bit (tests/test_legacy_kernels.py).
#include "kernels/legacy.h"
#include "krafla.h"

#include <math.h>
#include <string.h>

// ---------------------------------------------------------------------------------------------
// One block's pieces

static uint32_t fifth_bits(const uint8_t qh[4]) {
    return (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
}

// Where a block keeps its nibbles, its fifth bits (NULL for q4_1), d and m (NULL for q5_0).
typedef struct {
    const uint8_t *nibbles, *qh;
    kr_f16 d, m;
    int has_min;
} block_parts;

static block_parts parts_of(int32_t type, const void *block) {
    block_parts p = {0};
    switch (type) {
    case KR_Q4_1: {
        const kr_block_q4_1 *b = block;
        p = (block_parts){b->q, NULL, b->d, b->m, 1};
        break;
    }
    case KR_Q5_0: {
        const kr_block_q5_0 *b = block;
        p = (block_parts){b->q, b->qh, b->d, 0, 0};
        break;
    }
    default: {
        const kr_block_q5_1 *b = block;
        p = (block_parts){b->q, b->qh, b->d, b->m, 1};
        break;
    }
    }
    return p;
}

void kr_legacy_quants_ref(int32_t type, const void *block, uint8_t q[KR_QK]) {
    const block_parts p = parts_of(type, block);
    const uint32_t high = p.qh ? fifth_bits(p.qh) : 0;
    for (int j = 0; j < KR_QK / 2; j++) {
        q[j] = (uint8_t)((p.nibbles[j] & 0x0f) | ((high >> j) & 1) << 4);
        q[j + KR_QK / 2] = (uint8_t)((p.nibbles[j] >> 4) | ((high >> (j + KR_QK / 2)) & 1) << 4);
    }
}

void kr_dequantize_legacy_row(int32_t type, const void *row, float *out, int64_t n) {
    const size_t block_bytes = kr_legacy_block_bytes(type);
    for (int64_t b = 0; b < n / KR_QK; b++) {
        const void *block = (const char *)row + (size_t)b * block_bytes;
        const block_parts p = parts_of(type, block);
        uint8_t q[KR_QK];
        kr_legacy_quants_ref(type, block, q);
        const float d = kr_f16_to_f32_ref(p.d), m = kr_f16_to_f32_ref(p.m);
        for (int j = 0; j < KR_QK; j++) {
            // two roundings, as ggml's dequantize_row_q4_1 (this file is compiled without
            // contraction: -std=c11 turns -ffp-contract off)
            const float scaled = p.has_min ? d * (float)q[j] : d * (float)(q[j] - 16);
            out[b * KR_QK + j] = p.has_min ? scaled + m : scaled;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The dot product, block by block (legacy.h)

static float block_step(int32_t type, const void *block, const kr_block_q8_sum *a, float acc) {
    const block_parts p = parts_of(type, block);
    uint8_t q[KR_QK];
    kr_legacy_quants_ref(type, block, q);
    int32_t sum = 0;
    for (int j = 0; j < KR_QK; j++) sum += (int32_t)q[j] * (int32_t)a->q[j];
    const float d = kr_f16_to_f32_ref(p.d);
    if (!p.has_min) return fmaf(d * a->d, (float)(sum - 16 * a->sum), acc);
    acc = fmaf(d * a->d, (float)sum, acc);
    return fmaf(kr_f16_to_f32_ref(p.m), a->d * (float)a->sum, acc);  // d_a * sum(a) is exact (legacy.h)
}

float kr_dot_legacy_ref(int32_t type, const void *w_row, const kr_block_q8_sum *a, int64_t n_blocks) {
    const size_t block_bytes = kr_legacy_block_bytes(type);
    float acc = 0.0f;
    for (int64_t b = 0; b < n_blocks; b++) acc = block_step(type, (const char *)w_row + (size_t)b * block_bytes, a + b, acc);
    return acc;
}

// ---------------------------------------------------------------------------------------------
// Packed layout (legacy.h)

// Row r's block `block` (file form) into its place in the group's block (legacy.h's offsets).
static void pack_block(int32_t type, const char *block, int r, char *group_block) {
    const size_t fifth_at = kr_legacy_packed_fifth(type), nibbles_at = kr_legacy_packed_nibbles(type);
    if (kr_legacy_grid_type(type)) {  // iq4_nl, mxfp4: the scale's 2 or 1 bytes, then q4_0's nibbles
        const size_t scale_bytes = kr_legacy_scale_bytes(type);
        memcpy(group_block + scale_bytes * (size_t)r, block, scale_bytes);
        for (int i = 0; i < 4; i++) memcpy(group_block + nibbles_at + 32 * i + 4 * r, block + scale_bytes + 4 * i, 4);
        return;
    }
    const block_parts p = parts_of(type, block);
    memcpy(group_block + 2 * r, &p.d, 2);
    if (p.has_min) memcpy(group_block + KR_LEGACY_PACKED_MINS + 2 * r, &p.m, 2);
    if (p.qh) {
        const uint32_t high = fifth_bits(p.qh);
        for (int k = 0; k < 4; k++) {
            uint8_t byte = 0;
            for (int bit = 0; bit < 8; bit++) byte |= (uint8_t)(((high >> (4 * bit + k)) & 1) << bit);
            group_block[fifth_at + 4 * r + k] = (char)byte;
        }
    }
    for (int i = 0; i < 4; i++) memcpy(group_block + nibbles_at + 32 * i + 4 * r, p.nibbles + 4 * i, 4);
}

// The inverse: row r's block back in file form.
static void unpack_block(int32_t type, const char *group_block, int r, void *block) {
    const size_t fifth_at = kr_legacy_packed_fifth(type), nibbles_at = kr_legacy_packed_nibbles(type);
    if (kr_legacy_grid_type(type)) {
        const size_t scale_bytes = kr_legacy_scale_bytes(type);
        memcpy(block, group_block + scale_bytes * (size_t)r, scale_bytes);
        for (int i = 0; i < 4; i++) memcpy((char *)block + scale_bytes + 4 * i, group_block + nibbles_at + 32 * i + 4 * r, 4);
        return;
    }
    kr_f16 d, m = 0;
    uint8_t nibbles[KR_QK / 2], qh[4] = {0};
    memcpy(&d, group_block + 2 * r, 2);
    if (kr_legacy_has_min(type)) memcpy(&m, group_block + KR_LEGACY_PACKED_MINS + 2 * r, 2);
    if (kr_legacy_has_fifth(type)) {
        uint32_t high = 0;
        for (int k = 0; k < 4; k++)
            for (int bit = 0; bit < 8; bit++)
                high |= (uint32_t)(((uint8_t)group_block[fifth_at + 4 * r + k] >> bit) & 1) << (4 * bit + k);
        for (int k = 0; k < 4; k++) qh[k] = (uint8_t)(high >> (8 * k));
    }
    for (int i = 0; i < 4; i++) memcpy(nibbles + 4 * i, group_block + nibbles_at + 32 * i + 4 * r, 4);
    switch (type) {
    case KR_Q4_1: {
        kr_block_q4_1 *b = block;
        b->d = d, b->m = m;
        memcpy(b->q, nibbles, sizeof nibbles);
        break;
    }
    case KR_Q5_0: {
        kr_block_q5_0 *b = block;
        b->d = d;
        memcpy(b->qh, qh, 4);
        memcpy(b->q, nibbles, sizeof nibbles);
        break;
    }
    default: {
        kr_block_q5_1 *b = block;
        b->d = d, b->m = m;
        memcpy(b->qh, qh, 4);
        memcpy(b->q, nibbles, sizeof nibbles);
        break;
    }
    }
}

void kr_pack_rows_legacy(int32_t type, const void *src, void *dst, int64_t rows, int64_t cols) {
    kr_pack_groups(type, src, dst, rows, cols, kr_legacy_block_bytes(type), pack_block);
}

void kr_packed_block_legacy(int32_t type, const void *w, int64_t rows, int64_t cols, int64_t r, int64_t b, void *block) {
    const size_t row_bytes = kr_weight_row_bytes(type, cols), block_bytes = kr_legacy_block_bytes(type);
    if (r >= rows - rows % KR_PACK_ROWS) {
        memcpy(block, (const char *)w + (size_t)r * row_bytes + (size_t)b * block_bytes, block_bytes);
        return;
    }
    const char *group = kr_packed_group_block(type, w, rows - rows % KR_PACK_ROWS, cols / KR_QK, block_bytes, r, b);
    unpack_block(type, group, (int)(r % KR_PACK_ROWS), block);
}

// Each row's blocks back in file form, then the reference's block steps (lowbit_ref.c's for the grid types).
void kr_matmul_packed_legacy_ref(int32_t type, const void *w, int64_t rows, int64_t cols, const void *prepared,
                                 int64_t n_tokens, float *out, int64_t out_stride, int64_t row_begin, int64_t row_end) {
    const size_t a_row_bytes = kr_activation_row_bytes(type, cols);
    for (int64_t r = row_begin; r < row_end; r++)
        for (int64_t t = 0; t < n_tokens; t++) {
            const kr_block_q8_sum *a = (const kr_block_q8_sum *)((const char *)prepared + (size_t)t * a_row_bytes);
            float acc = 0.0f;
            for (int64_t b = 0; b < cols / KR_QK; b++) {
                union { kr_block_q4_1 q4_1; kr_block_q5_0 q5_0; kr_block_q5_1 q5_1; kr_block_iq4_nl iq4_nl; kr_block_mxfp4 mxfp4; } block;
                kr_packed_block_legacy(type, w, rows, cols, r, b, &block);
                acc = kr_legacy_grid_type(type) ? kr_lowbit_step_ref(type, &block, a + b, acc) : block_step(type, &block, a + b, acc);
            }
            out[t * out_stride + r] = acc;
        }
}
