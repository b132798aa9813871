// kquant_tile.h: the k-quant tiles (kernels.h, "k-quants"), written once for the vector width of
// the file that includes it: kquant_avx2.c (AVX2, 8 rows in 256 bits) and kquant_avx512.c (the
// ISA=avx512 build, 16 rows in 512 bits). Internal; not a header of its own: the including file
// defines first
//   KR_INLINE, ROWS (8 or 16), the types vec (integer lanes) and vecf (float lanes), V(name) and
//   V_SI(name) (the width's intrinsic: V(add_epi32) is _mm256_add_epi32 or _mm512_add_epi32,
//   V_SI(and) _mm256_and_si256 or _mm512_and_si512), the operations whose code differs by more
//   than the width (v_load, v_and_load, v_join, vf_half), part_add / part_flush / scale_vector
//   (the integer sums of one sub-block), Q5_FLUSH / Q6_FLUSH (steps between flushes) and
//   KR_KQUANT_TOKENS (tokens per tile), and KQ_INDEXED_LOADS where v_and_load is an indexed load
//   (kquant_width256.h), so that q6_K takes all its loads through it,
// and gets the matmuls kr_matmul_kquant_avx2 (file layout) and kr_matmul_packed_kquant_avx2
// (packed) of kernels.h: an ISA=avx2 build takes them from kquant_avx2.c, an ISA=avx512 build from
// kquant_avx512.c. A file may name them otherwise with KQ_NAME (kquant_vnni256.c's _vnni256), and
// hand one-token matmuls to other ones with KQ_ONE_TOKEN (the avx512 build's to the _vnni256).
//
// Each computes what kquant_ref.c computes, in its order of float operations: per output and
// super-block the exact integer sums isum (and msum), then the same fused multiply-adds. The
// matmul works on the packed layout (kquant_ref.c describes it): the lanes of a vector are the
// rows of GROUPS groups of 8 (the first group's 8 rows in the low half, the second's in the high
// half; `stride` is the distance between them, 0 to run one group in both halves), each step
// multiplies 32 bytes of quants per group (8 rows x 4 weights) by 4 activation bytes broadcast to
// every lane, and each super-block ends with one or two fused multiply-adds for all the rows.
// Every lane computes its row's integer sums and float steps whatever the width, so the bits are
// the same. The file layout is multiplied by packing a tile's rows into a buffer first, so both
// layouts run the same tile and give the same bits.
//
// Integer sums of one sub-block: `part` collects the products of unsigned weight bytes u and signed
// activation bytes s, `flush` multiplies it by the sub-block scales and adds it to isum.
#ifndef KRAFLA_KERNELS_KQUANT_TILE_H
#define KRAFLA_KERNELS_KQUANT_TILE_H

#include <immintrin.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/kernels.h"
#include "kernels/tile_loops.h"

#define GROUPS (ROWS / KR_PACK_ROWS)  // groups of 8 rows per tile
#ifndef KQ_NAME
#define KQ_NAME(name) name##_avx2
#endif
#ifndef KQ_WIDE_PARTS
#define KQ_WIDE_PARTS 0  // the including file's parts hold int32 sums (VNNI), not int16 (maddubs)
#endif
#ifndef KQ_Q4_K_ROLLED
#define KQ_Q4_K_ROLLED 0  // the including file's q4_K tiles go through their chunks in a loop, not unrolled
#endif

// The operations that are one intrinsic at either width.
KR_INLINE vec v_and(vec a, vec b) { return V_SI(and)(a, b); }
KR_INLINE vec v_or(vec a, vec b) { return V_SI(or)(a, b); }
KR_INLINE vec v_zero(void) { return V_SI(setzero)(); }
KR_INLINE vec v_add(vec a, vec b) { return V(add_epi32)(a, b); }
KR_INLINE vec v_sub(vec a, vec b) { return V(sub_epi32)(a, b); }
KR_INLINE vec v_bytes(char b) { return V(set1_epi8)(b); }
KR_INLINE vec v_words(int32_t w) { return V(set1_epi32)(w); }
KR_INLINE vec v_srli16(vec v, const int n) { return V(srli_epi16)(v, n); }
KR_INLINE vec v_slli16(vec v, const int n) { return V(slli_epi16)(v, n); }
KR_INLINE vec v_slli32(vec v, const int n) { return V(slli_epi32)(v, n); }
KR_INLINE vec v_madd16(vec a, vec b) { return V(madd_epi16)(a, b); }
KR_INLINE vecf vf_zero(void) { return V(setzero_ps)(); }
KR_INLINE vecf vf_set1(float f) { return V(set1_ps)(f); }
KR_INLINE vecf vf_mul(vecf a, vecf b) { return V(mul_ps)(a, b); }
KR_INLINE vecf vf_fmadd(vecf a, vec b, vecf c) { return V(fmadd_ps)(a, V(cvtepi32_ps)(b), c); }
KR_INLINE vecf vf_fnmadd(vecf a, vec b, vecf c) { return V(fnmadd_ps)(a, V(cvtepi32_ps)(b), c); }
KR_INLINE void vf_store(float *p, vecf v) { V(storeu_ps)(p, v); }
KR_INLINE vecf vf_load(const float *p) { return V(loadu_ps)(p); }

// 4 activation bytes (elements at..at+3) in every int32 lane.
KR_INLINE vec broadcast4(const int8_t *q) {
    int32_t v;
    memcpy(&v, q, 4);
    return v_words(v);
}

// Bits of every byte moved left (shift > 0) or right; the caller masks the bits it wants.
KR_INLINE vec shift_bits(vec v, const int shift) { return shift >= 0 ? v_slli16(v, shift) : v_srli16(v, -shift); }

// Two int16 values per lane, one from each half of 16 bytes: lane r = (bytes[r], bytes[8 + r]),
// for the first group at `low` and the second at `high`.
KR_INLINE __m256i pairs8(const char *bytes, const int is_signed) {
    const __m128i h = _mm_loadu_si128((const __m128i *)bytes);
    const __m128i interleaved = _mm_unpacklo_epi8(h, _mm_srli_si128(h, 8));
    return is_signed ? _mm256_cvtepi8_epi16(interleaved) : _mm256_cvtepu8_epi16(interleaved);
}
KR_INLINE vec pairs(const char *low, const char *high, const int is_signed) {
    return v_join(pairs8(low, is_signed), pairs8(high, is_signed));
}

// The next tile's super-block, fetched into L2 (not L1: with long rows the next tile is a whole
// tile of rows ahead, 117 KiB for q6_K at 8960 columns, and fetched into L1 it evicts the lines the
// current tile is reading; one thread's generation on Qwen2.5-Coder-1.5B went from 9 to 21 tokens/s).
KR_INLINE void prefetch_group(const char *next, size_t stride, size_t bytes) {
    if (!next) return;
    for (size_t line = 0; line < bytes; line += 64) _mm_prefetch(next + line, _MM_HINT_T1);
    if (GROUPS == 2 && stride)
        for (size_t line = 0; line < bytes; line += 64) _mm_prefetch(next + stride + line, _MM_HINT_T1);
}

#define Q4_K_GROUP (KR_PACK_ROWS * sizeof(kr_block_q4_K))  // 1152 bytes
#define Q5_K_GROUP (KR_PACK_ROWS * sizeof(kr_block_q5_K))  // 1408
#define Q6_K_GROUP (KR_PACK_ROWS * sizeof(kr_block_q6_K))  // 1680

// A group super-block's 8 scales and 8 mins of 8 rows, 6 bits each (kquant_ref.c's packed
// layout), as bytes: scales[8j + r], mins[8j + r].
KR_INLINE void unpack_scales_mins(const char *group, char scales[64], char mins[64]) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), top2 = _mm256_set1_epi8(0x30), six = _mm256_set1_epi8(63);
    const __m256i sb0 = _mm256_loadu_si256((const __m256i *)(group + 32)), sb1 = _mm256_loadu_si256((const __m256i *)(group + 64));
    const __m256i nibbles = _mm256_loadu_si256((const __m256i *)(group + 96));
    _mm256_store_si256((__m256i *)scales, _mm256_and_si256(sb0, six));
    _mm256_store_si256((__m256i *)(scales + 32), _mm256_and_si256(sb1, six));
    _mm256_store_si256((__m256i *)mins, _mm256_or_si256(_mm256_and_si256(nibbles, low4), _mm256_and_si256(_mm256_srli_epi16(sb0, 2), top2)));
    _mm256_store_si256((__m256i *)(mins + 32), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(nibbles, 4), low4),
                                                                _mm256_and_si256(_mm256_srli_epi16(sb1, 2), top2)));
}

// Chunk c of a group super-block of q4_K (is_q5 0) or q5_K (1): sub-blocks 2c (the low nibbles)
// and 2c + 1 (the high ones) for T tokens, isum[t] += their integer sums times their scales.
KR_INLINE void chunk_q45_K(const int is_q5, const int T, const int c, const char *group, size_t stride,
                           const char scales[2][64], const kr_block_q8_K *const a[4], vec isum[4]) {
    const int second = GROUPS - 1;
    const vec low4 = v_bytes(0x0f), high4 = v_bytes((char)0xf0);
    // q4_K with int32 parts (KQ_WIDE_PARTS): the high nibbles multiplied where they are (16 times
    // their value) and the part shifted down once per flush, instead of every chunk shifted once per
    // step (hot q4_K generation tiles about 5% faster, bench/kernels.py)
    const int in_place = KQ_WIDE_PARTS && !is_q5;
    const vec scale_low = scale_vector(scales[0] + 16 * c, scales[second] + 16 * c, 0);
    const vec scale_high = scale_vector(scales[0] + 16 * c + 8, scales[second] + 16 * c + 8, 0);
    vec part_low[4], part_high[4];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) part_low[t] = part_high[t] = v_zero();
#pragma GCC unroll 8
    for (int i = 0; i < 8; i++) {
        const char *chunk = group + kr_q45_K_qs_at(is_q5, c, i);
        vec low = v_and_load(chunk, stride, low4);  // loaded once more below, from L1
        vec high = in_place ? v_and_load(chunk, stride, high4) : v_and(v_srli16(v_load(chunk, stride), 4), low4);
        if (is_q5) {  // bit 2c of qh is the fifth bit of the low nibble's weight, bit 2c + 1 the high one's
            const vec bits = v_load(group + kr_q5_K_qh_at(i), stride), five = v_bytes(0x10);
            low = v_or(low, v_and(shift_bits(bits, 4 - 2 * c), five));
            high = v_or(high, v_and(shift_bits(bits, 3 - 2 * c), five));
        }
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            part_low[t] = part_add(part_low[t], low, broadcast4(a[t]->q + 64 * c + 4 * i));
            part_high[t] = part_add(part_high[t], high, broadcast4(a[t]->q + 64 * c + 32 + 4 * i));
        }
        if (i % (is_q5 ? Q5_FLUSH : 8) == (is_q5 ? Q5_FLUSH : 8) - 1)
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                const vec high_sum = in_place ? V(srai_epi32)(part_high[t], 4) : part_high[t];  // a multiple of 16: exact
                isum[t] = part_flush(part_flush(isum[t], part_low[t], scale_low), high_sum, scale_high);
                part_low[t] = part_high[t] = v_zero();
            }
    }
}

// One group super-block (GROUPS groups, `stride` apart) of q4_K (is_q5 0) or q5_K (1) for T tokens:
// acc[t] += the rows' terms.
KR_INLINE void superblock_q45_K(const int is_q5, const int T, const char *group, size_t stride, const kr_block_q8_K *const a[4],
                                vecf acc[4], const char *next) {
    _Alignas(32) char scales[2][64], mins[2][64];
    unpack_scales_mins(group, scales[0], mins[0]);
    if (GROUPS == 2) unpack_scales_mins(group + stride, scales[1], mins[1]);
    const int second = GROUPS - 1;
    prefetch_group(next, stride, is_q5 ? Q5_K_GROUP : Q4_K_GROUP);
    vec isum[4];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) isum[t] = v_zero();
    if (KQ_Q4_K_ROLLED && !is_q5) {
#pragma GCC unroll 1
        for (int c = 0; c < 4; c++) chunk_q45_K(is_q5, T, c, group, stride, scales, a, isum);
    } else {  // q5_K's shifts of its fifth bits depend on c
#pragma GCC unroll 4
        for (int c = 0; c < 4; c++) chunk_q45_K(is_q5, T, c, group, stride, scales, a, isum);
    }
    const vecf d = vf_half(group, stride), dmin = vf_half(group + 16, stride);
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) {
        // msum: the mins times the activation sums of each sub-block of 32, two sub-blocks per madd
        const __m256i sums32 = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)a[t]->bsums), _mm256_set1_epi16(1));
        const __m128i sums16 = _mm_packs_epi32(_mm256_castsi256_si128(sums32), _mm256_extracti128_si256(sums32, 1));
        vec msum = v_madd16(pairs(mins[0], mins[second], 0), v_words(_mm_extract_epi32(sums16, 0)));
        msum = v_add(msum, v_madd16(pairs(mins[0] + 16, mins[second] + 16, 0), v_words(_mm_extract_epi32(sums16, 1))));
        msum = v_add(msum, v_madd16(pairs(mins[0] + 32, mins[second] + 32, 0), v_words(_mm_extract_epi32(sums16, 2))));
        msum = v_add(msum, v_madd16(pairs(mins[0] + 48, mins[second] + 48, 0), v_words(_mm_extract_epi32(sums16, 3))));
        const vecf da = vf_set1(a[t]->d);
        acc[t] = vf_fmadd(vf_mul(d, da), isum[t], acc[t]);
        acc[t] = vf_fnmadd(vf_mul(dmin, da), msum, acc[t]);
    }
}

// One group super-block of q6_K for T tokens.
KR_INLINE void superblock_q6_K(const int T, const char *group, size_t stride, const kr_block_q8_K *const a[4], vecf acc[4],
                               const char *next) {
    const char *scales = group + 16, *scales2 = group + (GROUPS == 2 ? stride : 0) + 16;
    prefetch_group(next, stride, Q6_K_GROUP);
    const vec low4 = v_bytes(0x0f);
    vec isum[4];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) {
        // the weights' offset of 32: isum starts at -32 * sum_j scales[j] * bsums[j], two sub-blocks per madd
        vec offset = v_zero();
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            int32_t sums;
            memcpy(&sums, a[t]->bsums + 2 * k, 4);
            offset = v_add(offset, v_madd16(pairs(scales + 16 * k, scales2 + 16 * k, 1), v_words(sums)));
        }
        isum[t] = v_sub(v_zero(), v_slli32(offset, 5));
    }
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++)
#pragma GCC unroll 2
        for (int q = 0; q < 2; q++)
#pragma GCC unroll 2
            for (int half = 0; half < 2; half++) {
                const int sub_low = 8 * h + 2 * q + half, sub_high = sub_low + 4;
                const vec scale_low = scale_vector(scales + 8 * sub_low, scales2 + 8 * sub_low, 1);
                const vec scale_high = scale_vector(scales + 8 * sub_high, scales2 + 8 * sub_high, 1);
                vec part_low[4], part_high[4];
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) part_low[t] = part_high[t] = v_zero();
#pragma GCC unroll 4
                for (int step = 0; step < 4; step++) {
                    const int i = 4 * half + step;
                    const char *ql = group + kr_q6_K_ql_at(16 * h + 8 * q + i), *qh = group + kr_q6_K_qh_at(8 * h + i);
                    // bits 2q..2q+1 of qh are the top of the low nibble's weight, bits 4+2q..5+2q the high one's
#ifdef KQ_INDEXED_LOADS
                    // each loaded through v_and_load: masked where it lies, then shifted into bits 4..5 (the
                    // bits kept stay inside their byte, so the 16-bit shifts move nothing across bytes)
                    const vec low = v_or(v_and_load(ql, stride, low4),
                                         v_slli16(v_and_load(qh, stride, v_bytes((char)(3 << 2 * q))), 4 - 2 * q));
                    const vec high = v_or(v_srli16(v_and_load(ql, stride, v_bytes((char)0xf0)), 4),
                                          v_srli16(v_and_load(qh, stride, v_bytes((char)(0x30 << 2 * q))), 2 * q));
#else
                    const vec lows = v_load(ql, stride), highs = v_load(qh, stride), top2 = v_bytes(0x30);
                    const vec low = v_or(v_and(lows, low4), v_and(shift_bits(highs, 4 - 2 * q), top2));
                    const vec high = v_or(v_and(v_srli16(lows, 4), low4), v_and(shift_bits(highs, -2 * q), top2));
#endif
#pragma GCC unroll 4
                    for (int t = 0; t < T; t++) {
                        part_low[t] = part_add(part_low[t], low, broadcast4(a[t]->q + 128 * h + 32 * q + 4 * i));
                        part_high[t] = part_add(part_high[t], high, broadcast4(a[t]->q + 128 * h + 64 + 32 * q + 4 * i));
                    }
                    if (step % Q6_FLUSH == Q6_FLUSH - 1)
#pragma GCC unroll 4
                        for (int t = 0; t < T; t++) {
                            isum[t] = part_flush(part_flush(isum[t], part_low[t], scale_low), part_high[t], scale_high);
                            part_low[t] = part_high[t] = v_zero();
                        }
                }
            }
    const vecf d = vf_half(group, stride);
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) acc[t] = vf_fmadd(vf_mul(d, vf_set1(a[t]->d)), isum[t], acc[t]);
}

// One tile: GROUPS groups of 8 packed rows (`stride` apart; 0 runs one group twice), their
// super-blocks one after the other, for T tokens; stores the rows of [keep_begin, keep_end) of the
// tile. `next`: the tile after it (prefetched alongside), or NULL. `resume`: each row's sums start
// from `out` (a column slice after the first, tile_loops.h), not from zero.
KR_INLINE void group_tile(const int32_t weight_type, const int T, const char *group, size_t stride, int64_t n_blocks,
                          const char *a, size_t a_stride, float *out, int64_t out_stride, int keep_begin, int keep_end,
                          const char *next, int resume) {
    const size_t group_block = weight_type == KR_Q4_K ? Q4_K_GROUP : weight_type == KR_Q5_K ? Q5_K_GROUP : Q6_K_GROUP;
    vecf acc[4];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) {
        const float *row = out + t * out_stride;
        if (!resume) {
            acc[t] = vf_zero();
        } else if (keep_begin == 0 && keep_end == ROWS) {
            acc[t] = vf_load(row);
        } else {  // only the kept rows are this tile's to read
            float lanes[ROWS] = {0};
            for (int r = keep_begin; r < keep_end; r++) lanes[r] = row[r];
            acc[t] = vf_load(lanes);
        }
    }
    for (int64_t b = 0; b < n_blocks; b++) {
        const kr_block_q8_K *tokens[4];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) tokens[t] = (const kr_block_q8_K *)(a + (size_t)t * a_stride) + b;
        const char *block = group + (size_t)b * group_block, *fetch = next ? next + (size_t)b * group_block : NULL;
        if (weight_type == KR_Q4_K) superblock_q45_K(0, T, block, stride, tokens, acc, fetch);
        else if (weight_type == KR_Q5_K) superblock_q45_K(1, T, block, stride, tokens, acc, fetch);
        else superblock_q6_K(T, block, stride, tokens, acc, fetch);
    }
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) {
        float *row = out + t * out_stride;
        if (keep_begin == 0 && keep_end == ROWS) {
            vf_store(row, acc[t]);
        } else {
            float lanes[ROWS];
            vf_store(lanes, acc[t]);
            for (int r = keep_begin; r < keep_end; r++) row[r] = lanes[r];
        }
    }
}

// A packed tile (tile_loops.h's kr_group_tile); G is GROUPS but where one group is left, which
// runs in both halves of the vector.
static void tile(int32_t weight_type, int G, int T, const char *group, size_t group_stride, const char *a, size_t a_stride,
                 int64_t n_blocks, float *out, int64_t out_stride, int keep_begin, int keep_end, const char *next, int resume) {
    const size_t stride = G == 2 ? group_stride : 0;
#define KQ_TILE(type, t) \
    group_tile(type, t, group, stride, n_blocks, a, a_stride, out, out_stride, keep_begin, keep_end, next, resume)
#define KQ_TOKENS(type) \
    switch (T) { \
    case 1: KQ_TILE(type, 1); break; \
    case 2: KQ_TILE(type, 2); break; \
    case 3: KQ_TILE(type, 3); break; \
    default: KQ_TILE(type, 4); break; \
    }
    switch (weight_type) {
    case KR_Q4_K: KQ_TOKENS(KR_Q4_K) break;
    case KR_Q5_K: KQ_TOKENS(KR_Q5_K) break;
    default: KQ_TOKENS(KR_Q6_K) break;
    }
}

// Tokens per tile: KR_KQUANT_TOKENS of the including file (one for generation).
static int tile_tokens(int64_t n_tokens) { return n_tokens == 1 ? 1 : KR_KQUANT_TOKENS; }

// File layout: ROWS rows at a time packed into a buffer (rows past the matrix's end as zero blocks,
// whose outputs are not stored), then the packed tile.
void KQ_NAME(kr_matmul_kquant)(int32_t weight_type, const void *w, int64_t cols, const void *prepared, int64_t n_tokens,
                               float *out, int64_t out_stride, int64_t row_begin, int64_t row_end) {
#ifdef KQ_ONE_TOKEN
    if (n_tokens == 1) {
        KQ_ONE_TOKEN(kr_matmul_kquant)(weight_type, w, cols, prepared, n_tokens, out, out_stride, row_begin, row_end);
        return;
    }
#endif
    const size_t row_bytes = kr_weight_row_bytes(weight_type, cols), group_bytes = ROWS * row_bytes;
    char *rows = malloc(group_bytes ? 2 * group_bytes : 1);
    if (!rows) {  // no memory for a buffer: the reference computes the same bits
        const size_t a_stride = kr_activation_row_bytes(weight_type, cols);
        for (int64_t t = 0; t < n_tokens; t++)
            for (int64_t r = row_begin; r < row_end; r++) {
                const kr_block_q8_K *a = (const kr_block_q8_K *)((const char *)prepared + (size_t)t * a_stride);
                out[t * out_stride + r] = kr_dot_kquant_ref(weight_type, (const char *)w + (size_t)r * row_bytes, a, cols);
            }
        return;
    }
    char *packed = rows + group_bytes;
    for (int64_t first = row_begin; first < row_end; first += ROWS) {
        const int64_t count = row_end - first < ROWS ? row_end - first : ROWS;
        memcpy(rows, (const char *)w + (size_t)first * row_bytes, (size_t)count * row_bytes);
        memset(rows + (size_t)count * row_bytes, 0, (size_t)(ROWS - count) * row_bytes);
        kr_pack_rows_kquant(weight_type, rows, packed, ROWS, cols);
        kr_matmul_group_tiles(weight_type, packed, ROWS, cols, prepared, n_tokens, out + first, out_stride, 0, count, GROUPS,
                              tile_tokens(n_tokens), tile, KQ_NAME(kr_matmul_kquant));
    }
    free(rows);
}

void KQ_NAME(kr_matmul_packed_kquant)(int32_t weight_type, const void *w, int64_t rows, int64_t cols, const void *prepared,
                                      int64_t n_tokens, float *out, int64_t out_stride, int64_t row_begin, int64_t row_end) {
#ifdef KQ_ONE_TOKEN
    if (n_tokens == 1) {
        KQ_ONE_TOKEN(kr_matmul_packed_kquant)(weight_type, w, rows, cols, prepared, n_tokens, out, out_stride, row_begin,
                                              row_end);
        return;
    }
#endif
    kr_matmul_group_tiles(weight_type, w, rows, cols, prepared, n_tokens, out, out_stride, row_begin, row_end, GROUPS,
                          tile_tokens(n_tokens), tile, KQ_NAME(kr_matmul_kquant));
}

#endif
