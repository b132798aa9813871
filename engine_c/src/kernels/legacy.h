// legacy.h: ggml's q4_1, q5_0 and q5_1 weights (blocks of 32). Internal to the library.
//
// The three types are computed natively against the q4_0 activations (kr_block_q8_sum: each
// token's q8_0 blocks with the scale as a float and the exact sum of the quants). Per output,
// block after block (docs/kernels.md, "q4_1, q5_0, q5_1"):
//
//   q5_0:        acc = fmaf(d_w * d_a, (float)(sum(q * a) - 16 * sum(a)), acc)
//   q4_1, q5_1:  acc = fmaf(d_w * d_a, (float)sum(q * a), acc)
//                acc = fmaf(m_w, d_a * (float)sum(a), acc)
//
// with acc starting at 0, q the unsigned 4- or 5-bit quants. Every integer is exact, and so are the
// products: two f16 values (11-bit significands) in float, and d_a * sum(a) (|sum| <= 32 * 127 <
// 2^12, so at most 23 significant bits: ggml's q8_1 `s`, kept exact in float where ggml rounds it
// to f16). So any kernel that keeps this sequence gives the same bits.
// legacy_ref.c holds the references (suffix _ref), legacy_avx2.c the AVX2 tiles (suffix _avx2,
// with 256-bit VNNI sums in an ISA=avx512 build), legacy_avx512.c the 512-bit tiles of that build.
//
// q4_0 (kernels.h) is the family's plain member: no minimum, no fifth bits, an offset of 8 as
// q5_0's 16, and its packed layout (kernels.h, "Packed weights") is the one below without those
// parts. So the AVX2 and AVX-512 tiles serve it too (kr_legacy_tiled); its reference stays
// quant_ref.c's.
//
// iq4_nl and mxfp4 (lowbit.h, "the grid types" here) are q4_0's nibbles looked up in a 16-entry
// grid of signed values, against the same activations, scaled by an f16 (iq4_nl) or one E8M0 byte
// (mxfp4, d_w = kr_e8m0_half(e)). Their packed layout is q4_0's, with mxfp4's 8 exponent bytes in
// place of the 8 f16 scales; the packed tiles serve them too, and their per-block step stays
// lowbit.h's: acc = fmaf(d_w * d_a, (float)sum(q * a), acc). The tiles form sum(q * a) as
// sum((q + 128) * a) - 128 * sum(a) with VNNI (unsigned x signed bytes, as q4_0's offset of 8),
// or as maddubs(|q|, a with q's sign) in plain AVX2; the file layout stays lowbit_avx2.c's.
#ifndef KRAFLA_KERNELS_LEGACY_H
#define KRAFLA_KERNELS_LEGACY_H

#include "kernels/kernels.h"
#include "kernels/lowbit.h"
#include "krafla.h"

typedef struct {
    kr_f16 d;              // scale
    kr_f16 m;              // minimum
    uint8_t q[KR_QK / 2];  // byte j: weight j (low nibble), weight j+16 (high nibble); w = d*n + m
} kr_block_q4_1;

typedef struct {
    kr_f16 d;              // scale
    uint8_t qh[4];         // bit j (little endian): the fifth bit of weight j
    uint8_t q[KR_QK / 2];  // the low 4 bits, as q4_0; w = d*(q - 16)
} kr_block_q5_0;

typedef struct {
    kr_f16 d;              // scale
    kr_f16 m;              // minimum
    uint8_t qh[4];         // bit j: the fifth bit of weight j
    uint8_t q[KR_QK / 2];  // the low 4 bits; w = d*q + m
} kr_block_q5_1;

static_assert(sizeof(kr_block_q4_1) == 2 + 2 + 16, "q4_1 block size");
static_assert(sizeof(kr_block_q5_0) == 2 + 4 + 16, "q5_0 block size");
static_assert(sizeof(kr_block_q5_1) == 2 + 2 + 4 + 16, "q5_1 block size");

// q4_1, q5_0 or q5_1.
static inline int kr_legacy_type(int32_t type) { return type == KR_Q4_1 || type == KR_Q5_0 || type == KR_Q5_1; }
// iq4_nl or mxfp4.
static inline int kr_legacy_grid_type(int32_t type) { return type == KR_IQ4_NL || type == KR_MXFP4; }
// The types whose packed layout legacy_ref.c writes and reads: the legacy types and the grid types.
static inline int kr_legacy_packs(int32_t type) { return kr_legacy_type(type) || kr_legacy_grid_type(type); }
// These and q4_0: the types the packed tiles of legacy_avx2.c and legacy_avx512.c multiply (the
// file-layout tiles of legacy_avx2.c take all but the grid types).
static inline int kr_legacy_tiled(int32_t type) { return type == KR_Q4_0 || kr_legacy_packs(type); }
// A grid type's 16 signed values (lowbit.h), NULL for the others.
static inline const int8_t *kr_legacy_grid(int32_t type) {
    return type == KR_IQ4_NL ? kr_kvalues_iq4nl : type == KR_MXFP4 ? kr_kvalues_mxfp4 : NULL;
}

// The shape of a block of the family (q4_0 and the grid types included): a minimum (q4_1, q5_1),
// fifth bits (q5_0, q5_1), the offset subtracted from the unsigned quants (q4_0 8, q5_0 16, the
// others 0), a scale of 2 bytes (f16) or 1 (mxfp4's E8M0), and the bytes: d, [m], [qh], then 16
// bytes of nibbles (q4_0 and iq4_nl 18, q4_1 20, q5_0 22, q5_1 24, mxfp4 17).
static inline int kr_legacy_has_min(int32_t type) { return type == KR_Q4_1 || type == KR_Q5_1; }
static inline int kr_legacy_has_fifth(int32_t type) { return type == KR_Q5_0 || type == KR_Q5_1; }
static inline int32_t kr_legacy_offset(int32_t type) { return type == KR_Q4_0 ? 8 : type == KR_Q5_0 ? 16 : 0; }
static inline size_t kr_legacy_scale_bytes(int32_t type) { return type == KR_MXFP4 ? 1 : sizeof(kr_f16); }
static inline size_t kr_legacy_block_bytes(int32_t type) {
    return kr_legacy_scale_bytes(type) * (size_t)(1 + kr_legacy_has_min(type)) + 4 * (size_t)kr_legacy_has_fifth(type) + KR_QK / 2;
}

// One row of n weights to floats: d * q + m (two roundings, as ggml and gguf-py), d * (q - 16).
void kr_dequantize_legacy_row(int32_t type, const void *row, float *out, int64_t n);

// The per-block pieces: the unsigned quants of one block (0..15 or 0..31) in element order.
void kr_legacy_quants_ref(int32_t type, const void *block, uint8_t q[KR_QK]);
// One output: the blocks of a weight row against a token's prepared activations, in the order above.
float kr_dot_legacy_ref(int32_t type, const void *w_row, const kr_block_q8_sum *a, int64_t n_blocks);

// Packed layout (kernels.h "Packed weights", docs/kernels.md): groups of 8 rows where their rows are
// in the file, rows past the last whole group as they are. Per group and block: the 8 rows' f16
// scales (16 bytes; mxfp4: their 8 exponent bytes), [q4_1, q5_1: their 8 f16 minimums (16 bytes)],
// [q5_0, q5_1: their fifth bits (32 bytes: int32 lane r is row r, byte k of it holds in bit p the
// fifth bit of element 4p + k)], then the 4 chunks of nibbles exactly as q4_0's (chunk i: bytes
// 4i..4i+3 of each row).
// Where a group block keeps its parts, from its start: the scales at 0, the minimums at 16, then
// the fifth bits and the nibbles (q4_0 and iq4_nl: nibbles at 16, mxfp4 at 8). A group block is 8
// blocks' bytes.
static inline size_t kr_legacy_group_block_bytes(int32_t type) { return KR_PACK_ROWS * kr_legacy_block_bytes(type); }
#define KR_LEGACY_PACKED_MINS (2 * KR_PACK_ROWS)
static inline size_t kr_legacy_packed_fifth(int32_t type) {
    return KR_PACK_ROWS * kr_legacy_scale_bytes(type) * (size_t)(1 + kr_legacy_has_min(type));
}
static inline size_t kr_legacy_packed_nibbles(int32_t type) {
    return kr_legacy_packed_fifth(type) + 4 * KR_PACK_ROWS * (size_t)kr_legacy_has_fifth(type);
}
void kr_pack_rows_legacy(int32_t type, const void *src, void *dst, int64_t rows, int64_t cols);
// Row r's block b of a packed matrix in file form (kr_packed_block's share).
void kr_packed_block_legacy(int32_t type, const void *w, int64_t rows, int64_t cols, int64_t r, int64_t b, void *block);
void kr_matmul_packed_legacy_ref(int32_t type, const void *w, int64_t rows, int64_t cols, const void *prepared,
                                 int64_t n_tokens, float *out, int64_t out_stride, int64_t row_begin, int64_t row_end);

// AVX2 (and the avx512 build's VNNI): file layout (all but the grid types) and packed (the
// kr_legacy_tiled types). kr_matmul_avx2 / kr_matmul_packed_avx2 hand these types over.
void kr_matmul_legacy_avx2(int32_t type, const void *w, int64_t cols, const void *prepared, int64_t n_tokens, float *out,
                           int64_t out_stride, int64_t row_begin, int64_t row_end);
void kr_matmul_packed_legacy_avx2(int32_t type, const void *w, int64_t rows, int64_t cols, const void *prepared,
                                  int64_t n_tokens, float *out, int64_t out_stride, int64_t row_begin, int64_t row_end);

// ISA=avx512: T <= 4 tokens over two packed groups (16 rows) in the lanes of one 512-bit vector,
// with kr_packed_tile_avx2's arguments (tiles_avx2.h); stores the rows of [keep_begin, keep_end)
// of the 16. `next`: the tile after this one, fetched ahead.
void kr_legacy_pair_tile_avx512(int32_t type, int T, const char *w, size_t group_stride, const char *a, size_t a_stride,
                                int64_t n_blocks, float *out, int64_t out_stride, int keep_begin, int keep_end,
                                const char *next);

#endif
