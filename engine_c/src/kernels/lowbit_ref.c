// lowbit_ref.c: the plain-C reference of the low-bit weight kernels (lowbit.h): decoding a block,
// dequantizing a row as gguf-py does, and the dot product whose float steps the AVX2 and AVX-512
// tiles of lowbit_avx2.c reproduce.
#include "kernels/lowbit.h"

#include <math.h>
#include <string.h>

const int8_t kr_kvalues_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
const int8_t kr_kvalues_mxfp4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

int kr_is_lowbit(int32_t weight_type) {
    return weight_type == KR_Q2_K || weight_type == KR_Q3_K || weight_type == KR_IQ4_NL || weight_type == KR_IQ4_XS ||
           weight_type == KR_MXFP4;
}

int kr_lowbit_is_super(int32_t weight_type) {
    return weight_type == KR_Q2_K || weight_type == KR_Q3_K || weight_type == KR_IQ4_XS;
}

size_t kr_lowbit_block_bytes(int32_t weight_type) {
    switch (weight_type) {
    case KR_Q2_K: return sizeof(kr_block_q2_K);
    case KR_Q3_K: return sizeof(kr_block_q3_K);
    case KR_IQ4_XS: return sizeof(kr_block_iq4_xs);
    case KR_IQ4_NL: return sizeof(kr_block_iq4_nl);
    case KR_MXFP4: return sizeof(kr_block_mxfp4);
    default: return 0;
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding

// Sub-block j's 6-bit q3_K scale, as ggml packs 16 of them in 12 bytes.
static int q3_K_scale(const uint8_t packed[12], int j) {
    const int low = (j < 8 ? packed[j] : packed[j - 8] >> 4) & 15;
    const int high = (packed[8 + j % 4] >> (2 * (j / 4))) & 3;
    return low | high << 4;
}

static int iq4_xs_scale(const kr_block_iq4_xs *block, int j) {
    return ((block->scales_l[j / 2] >> (4 * (j % 2))) & 15) | ((block->scales_h >> (2 * j)) & 3) << 4;
}

static void set_scales(kr_lowbit_block *out, const int scale[16]) {
    for (int c = 0; c < 8; c++)
        for (int l = 0; l < 16; l++) out->scale_lanes[c][l] = (int16_t)scale[2 * c + l / 8];
}

// Weights 0..31 of a block of 32 (iq4_nl, mxfp4): nibble l and l + 16 of byte l.
static void decode_nibbles(const uint8_t qs[16], const int8_t grid[16], int8_t q[32]) {
    for (int l = 0; l < 16; l++) {
        q[l] = grid[qs[l] & 15];
        q[l + 16] = grid[qs[l] >> 4];
    }
}

void kr_lowbit_decode_ref(int32_t weight_type, const void *block, kr_lowbit_block *out) {
    int scale[16] = {0};
    memset(out->min, 0, sizeof out->min);
    out->dmin = 0.0f;
    switch (weight_type) {
    case KR_Q2_K: {
        const kr_block_q2_K *b = block;
        for (int e = 0; e < KR_QK_K; e++) out->q[e] = (int8_t)((b->qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3);
        for (int j = 0; j < 16; j++) scale[j] = b->scales[j] & 15, out->min[j] = (int16_t)(b->scales[j] >> 4);
        out->d = kr_f16_to_f32_ref(b->d);
        out->dmin = kr_f16_to_f32_ref(b->dmin);
        break;
    }
    case KR_Q3_K: {
        const kr_block_q3_K *b = block;
        for (int e = 0; e < KR_QK_K; e++) {
            const int low = (b->qs[32 * (e / 128) + e % 32] >> (2 * ((e % 128) / 32))) & 3;
            out->q[e] = (int8_t)(low - ((b->hmask[e % 32] >> (e / 32)) & 1 ? 0 : 4));
        }
        for (int j = 0; j < 16; j++) scale[j] = q3_K_scale(b->scales, j) - 32;
        out->d = kr_f16_to_f32_ref(b->d);
        break;
    }
    case KR_IQ4_XS: {
        const kr_block_iq4_xs *b = block;
        for (int j = 0; j < 8; j++) {
            decode_nibbles(b->qs + 16 * j, kr_kvalues_iq4nl, out->q + 32 * j);
            scale[2 * j] = scale[2 * j + 1] = iq4_xs_scale(b, j) - 32;
        }
        out->d = kr_f16_to_f32_ref(b->d);
        break;
    }
    case KR_IQ4_NL: {
        const kr_block_iq4_nl *b = block;
        decode_nibbles(b->qs, kr_kvalues_iq4nl, out->q);
        out->d = kr_f16_to_f32_ref(b->d);
        break;
    }
    case KR_MXFP4: {
        const kr_block_mxfp4 *b = block;
        decode_nibbles(b->qs, kr_kvalues_mxfp4, out->q);
        out->d = kr_e8m0_half(b->e);
        break;
    }
    default: break;
    }
    set_scales(out, scale);
}

void kr_dequantize_row_lowbit(int32_t weight_type, const void *row, float *out, int64_t n) {
    const size_t block_bytes = kr_lowbit_block_bytes(weight_type);
    const int block = kr_lowbit_is_super(weight_type) ? KR_QK_K : KR_QK;
    for (int64_t b = 0; b < n / block; b++) {
        kr_lowbit_block decoded;
        kr_lowbit_decode_ref(weight_type, (const char *)row + (size_t)b * block_bytes, &decoded);
        float *y = out + b * block;
        if (!kr_lowbit_is_super(weight_type)) {
            for (int e = 0; e < block; e++) y[e] = decoded.d * (float)decoded.q[e];
            continue;
        }
        for (int e = 0; e < block; e++) {
            const int j = e / 16;
            const float scale = decoded.d * (float)decoded.scale_lanes[j / 2][8 * (j % 2)];
            y[e] = scale * (float)decoded.q[e];
            if (weight_type == KR_Q2_K) y[e] -= decoded.dmin * (float)decoded.min[j];
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Dot products in the order of lowbit.h

float kr_lowbit_step_ref(int32_t weight_type, const void *block, const kr_block_q8_sum *a, float acc) {
    kr_lowbit_block w;
    kr_lowbit_decode_ref(weight_type, block, &w);
    int32_t sum = 0;
    for (int e = 0; e < KR_QK; e++) sum += (int32_t)w.q[e] * (int32_t)a->q[e];
    return fmaf(w.d * a->d, (float)sum, acc);
}

float kr_dot_lowbit_ref(int32_t weight_type, const void *row, const void *activations, int64_t cols) {
    const size_t block_bytes = kr_lowbit_block_bytes(weight_type);
    float acc = 0.0f;
    if (!kr_lowbit_is_super(weight_type)) {
        const kr_block_q8_sum *a = activations;
        for (int64_t b = 0; b < cols / KR_QK; b++) acc = kr_lowbit_step_ref(weight_type, (const char *)row + (size_t)b * block_bytes, a + b, acc);
        return acc;
    }
    const kr_block_q8_K *a = activations;
    for (int64_t b = 0; b < cols / KR_QK_K; b++) {
        kr_lowbit_block w;
        kr_lowbit_decode_ref(weight_type, (const char *)row + (size_t)b * block_bytes, &w);
        int32_t isum = 0, msum = 0;
        for (int j = 0; j < 16; j++) {
            int32_t sum = 0;
            for (int e = 16 * j; e < 16 * j + 16; e++) sum += (int32_t)w.q[e] * (int32_t)a[b].q[e];
            isum += (int32_t)w.scale_lanes[j / 2][8 * (j % 2)] * sum;
            msum += (int32_t)w.min[j] * (int32_t)a[b].bsums[j];
        }
        acc = fmaf(w.d * a[b].d, (float)isum, acc);
        if (weight_type == KR_Q2_K) acc = fmaf(-(w.dmin * a[b].d), (float)msum, acc);
    }
    return acc;
}
