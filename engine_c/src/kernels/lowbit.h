// lowbit.h: ggml's low-bit weights q2_K, q3_K, iq4_xs (super-blocks of 256 against q8_K
// activations, as the k-quants) and iq4_nl, mxfp4 (blocks of 32 against kr_block_q8_sum
// activations, as q4_0). Internal to the library; docs/kernels.md, "Low-bit weights".
//
// Every kernel first decodes a block into kr_lowbit_block: the weights as small signed integers q,
// the integer scale of each 16 of them, q2_K's integer mins, and the block's float scales. Then, per
// output, block after block, exact integer sums and fixed float steps:
//   q2_K, q3_K, iq4_xs: isum = sum_j scale[j] * sum_{e in 16j..16j+15} q[e] * a[e]   (16 sub-blocks)
//                       acc = fmaf(d_w * d_a, (float)isum, acc)
//                       q2_K also: msum = sum_j min[j] * bsums[j]; acc = fmaf(-(dmin_w * d_a), (float)msum, acc)
//   iq4_nl, mxfp4:      acc = fmaf(d_w * d_a, (float)sum_e q[e] * a[e], acc)                (blocks of 32)
// with acc starting at 0. |isum| <= 256 * 127 * 127 * 32 < 2^31, so every integer is exact however a
// kernel adds it up, and the AVX2 and AVX-512 tiles give the reference's bits.
//
// The integer weights: q2_K q = 0..3 (2 bits), scale = 4-bit, min = 4-bit; q3_K q = 2 low bits - 4
// unless the hmask bit is set (-4..3), scale = 6-bit - 32; iq4_xs q = kvalues_iq4nl[nibble], scale
// = 6-bit - 32 per 32 weights; iq4_nl q = kvalues_iq4nl[nibble]; mxfp4 q = kvalues_mxfp4[nibble]
// (twice the e2m1 value) and d_w = 2^(e - 128), ggml's E8M0 scale halved.
#ifndef KRAFLA_KERNELS_LOWBIT_H
#define KRAFLA_KERNELS_LOWBIT_H

#include "kernels/kernels.h"
#include "krafla.h"

typedef struct {
    uint8_t scales[16];    // sub-block j of 16: scale in the low nibble, min in the high one
    uint8_t qs[64];        // byte 32h + l, bits 2s..2s+1: weight 128h + 32s + l
    kr_f16 d, dmin;
} kr_block_q2_K;           // weight e = d * scale[e/16] * q - dmin * min[e/16]

typedef struct {
    uint8_t hmask[32];     // bit k of byte l: weight 32k + l has no offset of -4
    uint8_t qs[64];        // as q2_K: the low 2 bits
    uint8_t scales[12];    // 16 six-bit scales: low nibbles in bytes 0..7, top 2 bits in bytes 8..11
    kr_f16 d;
} kr_block_q3_K;           // weight e = d * (scale[e/16] - 32) * q

typedef struct {
    kr_f16 d;
    uint16_t scales_h;     // bits 2j..2j+1: top 2 bits of sub-block j's scale (sub-blocks of 32)
    uint8_t scales_l[4];   // nibble j of the 8: low 4 bits of sub-block j's scale
    uint8_t qs[128];       // byte 16j + l: weight 32j + l (low nibble), 32j + 16 + l (high nibble)
} kr_block_iq4_xs;         // weight e = d * (scale[e/32] - 32) * kvalues_iq4nl[nibble]

typedef struct {
    kr_f16 d;
    uint8_t qs[16];        // byte l: weight l (low nibble), l + 16 (high nibble)
} kr_block_iq4_nl;         // weight = d * kvalues_iq4nl[nibble]

typedef struct {
    uint8_t e;             // E8M0 exponent
    uint8_t qs[16];        // as iq4_nl
} kr_block_mxfp4;          // weight = 2^(e - 128) * kvalues_mxfp4[nibble]

static_assert(sizeof(kr_block_q2_K) == 84, "q2_K block size");
static_assert(sizeof(kr_block_q3_K) == 110, "q3_K block size");
static_assert(sizeof(kr_block_iq4_xs) == 136, "iq4_xs block size");
static_assert(sizeof(kr_block_iq4_nl) == 18, "iq4_nl block size");
static_assert(sizeof(kr_block_mxfp4) == 17, "mxfp4 block size");

// ggml's non-linear 4-bit grids (kvalues_iq4nl, kvalues_mxfp4).
extern const int8_t kr_kvalues_iq4nl[16] __attribute__((visibility("hidden")));
extern const int8_t kr_kvalues_mxfp4[16] __attribute__((visibility("hidden")));

// One block decoded (the weights of a block of 32 are q[0..31], its scale d).
typedef struct {
    _Alignas(32) int8_t q[KR_QK_K];
    _Alignas(32) int16_t scale_lanes[8][16];  // [c][l]: scale[2c] for l < 8, scale[2c + 1] for l >= 8 (maddubs pairs)
    _Alignas(32) int16_t min[16];             // q2_K's mins, 0 for the others
    float d, dmin;                            // d_w (and q2_K's dmin_w), as floats
} kr_lowbit_block;

int kr_is_lowbit(int32_t weight_type);          // q2_K, q3_K, iq4_nl, iq4_xs, mxfp4
int kr_lowbit_is_super(int32_t weight_type);    // q2_K, q3_K, iq4_xs: super-blocks of 256
size_t kr_lowbit_block_bytes(int32_t weight_type);
// 2^(e - 128), as ggml_e8m0_to_fp32_half: subnormal for e < 2.
static inline float kr_e8m0_half(uint8_t e) { return kr_bits_float(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23); }

// The reference decoding of one block, and a row of n weights to floats exactly as gguf-py (and
// ggml) dequantize: (d * scale) * q - dmin * min for q2_K, (d * scale) * q for q3_K and iq4_xs,
// d * q for iq4_nl and mxfp4.
void kr_lowbit_decode_ref(int32_t weight_type, const void *block, kr_lowbit_block *out);
void kr_dequantize_row_lowbit(int32_t weight_type, const void *row, float *out, int64_t n);
// One output in the order above: a row of cols weights against one token's prepared activations
// (kr_block_q8_K for the super-block types, kr_block_q8_sum for iq4_nl and mxfp4).
float kr_dot_lowbit_ref(int32_t weight_type, const void *row, const void *activations, int64_t cols);
// One block of 32 of iq4_nl or mxfp4 in that order: acc after the block's fused multiply-add
// (the packed reference, legacy_ref.c, takes its blocks through it too).
float kr_lowbit_step_ref(int32_t weight_type, const void *block, const kr_block_q8_sum *a, float acc);
// The file-layout matmul (kernels.h's kr_matmul) with AVX2 tiles (the ISA=avx512 build: 512-bit
// sums for the decoded super-blocks of several tokens, 256-bit VNNI for the blocks of 32); lowbit_avx2.c.
// iq4_nl and mxfp4 are also packed: legacy.h's layout and tiles (the super-block types are not).
void kr_matmul_lowbit_avx2(int32_t weight_type, const void *w, int64_t cols, const void *prepared, int64_t n_tokens,
                           float *out, int64_t out_stride, int64_t row_begin, int64_t row_end);

#endif
