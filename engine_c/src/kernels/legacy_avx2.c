// legacy_avx2.c: the q4_0, q4_1, q5_0 and q5_1 matmuls with AVX2/FMA/F16C intrinsics (suffix _avx2),
// and the packed iq4_nl and mxfp4 ones (legacy.h, the grid types).
//
// Each output goes through legacy_ref.c's sequence of float operations (legacy.h; for q4_0
// quant_ref.c's, the same with no minimum and an offset of 8): per block, the exact integer sum of
// the 32 products, then one fused multiply-add with d_w * d_a, and for q4_1 and q5_1 a second one,
// m_w times d_a * sum(a) (exact in float). The integer sums are
// exact however they are formed, so the tiles below may put 4 or 8 rows side by side and give the
// same bits. The ISA=avx512 build compiles this file too, with VNNI for the integer sums, and takes
// the one-token packed tile from legacy_avx512.c.
#include "kernels/legacy.h"
#include "krafla.h"

#if defined(KR_HAVE_AVX2)
#include "kernels/indexed_load.h"
#include "kernels/tiles_avx2.h"

// ---------------------------------------------------------------------------------------------
// Integer sums of unsigned quants u (0..31) times signed activations s (-127..127), 4 products per
// int32 lane. VNNI (ISA=avx512) accumulates in int32 directly. AVX2 adds pairs into int16
// (maddubs): one pair is at most 2 * 31 * 127 = 7874, so 4 steps stay below 32767 (8 steps for
// nibbles, at most 2 * 15 * 127 each), and widen_add turns the int16 pairs into int32 lanes.
// With `saturate` (the tiles of several tokens) AVX2 adds the pairs with saturation, which within
// these bounds never saturates (the same bits): GCC reassociates wrapping int16 additions into
// trees that spill (64 tokens 1.02-1.14x); in the one-token tiles the wrapping ones are faster.
#if defined(KR_HAVE_AVX512)
KR_INLINE __m256i isum_add(__m256i acc, __m256i u, __m256i s, const int saturate) { return _mm256_dpbusd_epi32(acc, u, s); }
KR_INLINE __m256i widen_add(__m256i wide, __m256i acc) { return _mm256_add_epi32(wide, acc); }
#else
KR_INLINE __m256i isum_add(__m256i acc, __m256i u, __m256i s, const int saturate) {
    const __m256i pairs = _mm256_maddubs_epi16(u, s);
    return saturate ? _mm256_adds_epi16(acc, pairs) : _mm256_add_epi16(acc, pairs);
}
KR_INLINE __m256i widen_add(__m256i wide, __m256i acc) {
    return _mm256_add_epi32(wide, _mm256_madd_epi16(acc, _mm256_set1_epi16(1)));
}
#endif

// The grid types (legacy.h). VNNI takes their quants as unsigned bytes q + 128, the offset then
// subtracted as q4_0's 8: |sum((q + 128) * a)| <= 32 * 255 * 127, exact in int32. Plain AVX2's
// maddubs adds its pairs in int16, where (q + 128) * a overflows (2 * 255 * 127 > 32767); it takes
// |q| times a with q's sign instead, so the grid is looked up signed and the offset is 0. A pair is
// then at most 2 * 127 * 127 = 32258 for iq4_nl, which is widened to int32 after every step, and
// 2 * 12 * 127 = 3048 for mxfp4, whose 8 steps of a block (24384) stay in int16 as q4_0's nibbles.
#if defined(KR_HAVE_AVX512)
#define GRID_OFFSET 128
#else
#define GRID_OFFSET 0
#endif
KR_INLINE int32_t tile_offset(const int32_t type) { return kr_legacy_grid_type(type) ? GRID_OFFSET : kr_legacy_offset(type); }
// The grid as the tiles look it up: in both 128-bit lanes, as unsigned bytes q + 128 with VNNI.
KR_INLINE __m256i grid_lanes(const int32_t type) {
    const __m256i grid = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kr_legacy_grid(type)));
    return GRID_OFFSET ? _mm256_xor_si256(grid, _mm256_set1_epi8((char)0x80)) : grid;
}
// A step's sums are int32 lanes already (VNNI, and plain AVX2's iq4_nl), else int16 pairs.
KR_INLINE int sums_are_wide(const int32_t type) { return GRID_OFFSET || type == KR_IQ4_NL; }
// sums += the products of a chunk of quants q and 4 activation bytes s in each lane, in a tile of T
// tokens (mxfp4's pairs keep wrapping additions: saturating ones were 6-8% slower for it).
KR_INLINE __m256i step_add(const int32_t type, const int T, __m256i sums, __m256i q, __m256i s) {
    if (GRID_OFFSET || !kr_legacy_grid_type(type)) return isum_add(sums, q, s, T > 1);
    const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(q), _mm256_sign_epi8(s, q));
    return type == KR_IQ4_NL ? widen_add(sums, pairs) : _mm256_add_epi16(sums, pairs);
}

// ---------------------------------------------------------------------------------------------
// File layout: R <= 4 rows x T <= 4 tokens. Per block each row's 32 quants are unpacked into
// bytes in element order; each (row, token) pair's 32 products are summed, 4 rows' sums added up
// together, and each token takes its 4 rows' fused multiply-adds in the lanes of one 128-bit
// vector. Serves --no-pack and the rows past a packed matrix's last group of 8.

// The block's quants (0..15 or 0..31) as 32 bytes in element order.
KR_INLINE __m256i unpack_quants(const int32_t type, const char *block) {
    const size_t nibbles_at = kr_legacy_block_bytes(type) - KR_QK / 2;
    const __m256i both = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(block + nibbles_at)));
    const __m256i shifted = _mm256_srlv_epi32(both, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4));
    __m256i q = _mm256_and_si256(shifted, _mm256_set1_epi8(0x0f));
    if (kr_legacy_has_fifth(type)) {
        int32_t qh;
        __builtin_memcpy(&qh, block + nibbles_at - 4, 4);
        // byte j <- byte j / 8 of qh, then bit j % 8 of it as 0x10
        const __m256i spread = _mm256_shuffle_epi8(
            _mm256_set1_epi32(qh), _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2,
                                                    3, 3, 3, 3, 3, 3, 3, 3));
        const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
        const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
        q = _mm256_or_si256(q, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
    }
    return q;
}

KR_INLINE void tile_rows(const int32_t type, const int R, const int T, const char *w, size_t w_stride, const char *a,
                         size_t a_stride, int64_t n_blocks, float *out, int64_t out_stride, const char *next) {
    const size_t w_block = kr_legacy_block_bytes(type);
    __m128 acc[4];
#pragma GCC unroll 4
    for (int t = 0; t < T; t++) acc[t] = _mm_setzero_ps();
    for (int64_t b = 0; b < n_blocks; b++) {
        __m256i quants[4];
        float scales[4] = {0.0f, 0.0f, 0.0f, 0.0f}, mins[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma GCC unroll 4
        for (int r = 0; r < R; r++) {
            const char *block = w + r * w_stride + (size_t)b * w_block;
            if (next) _mm_prefetch(next + r * w_stride + (size_t)b * w_block, _MM_HINT_T0);
            quants[r] = unpack_quants(type, block);
            scales[r] = f16_to_f32(((const kr_f16 *)block)[0]);
            if (kr_legacy_has_min(type)) mins[r] = f16_to_f32(((const kr_f16 *)block)[1]);
        }
        const __m128 w_scale = _mm_loadu_ps(scales), w_min = _mm_loadu_ps(mins);
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const kr_block_q8_sum *ab = (const kr_block_q8_sum *)(a + t * a_stride) + b;
            const __m256i av = _mm256_loadu_si256((const __m256i *)ab->q);
            __m256i lanes[4];
#pragma GCC unroll 4
            for (int r = 0; r < 4; r++)
                lanes[r] = r < R ? widen_add(_mm256_setzero_si256(), isum_add(_mm256_setzero_si256(), quants[r], av, 0))
                                 : _mm256_setzero_si256();
            __m128i sums = sum4_epi32(lanes[0], lanes[1], lanes[2], lanes[3]);
            if (kr_legacy_offset(type)) sums = _mm_sub_epi32(sums, _mm_set1_epi32(kr_legacy_offset(type) * ab->sum));
            const __m128 a_scale = _mm_set1_ps(ab->d);
            acc[t] = _mm_fmadd_ps(_mm_mul_ps(w_scale, a_scale), _mm_cvtepi32_ps(sums), acc[t]);
            if (kr_legacy_has_min(type)) acc[t] = _mm_fmadd_ps(w_min, _mm_set1_ps(ab->d * (float)ab->sum), acc[t]);
        }
    }
    store_rows(R, T, acc, out, out_stride);
}

// One instance of the file-layout tile per shape, for a type known at compile time.
KR_INLINE void type_tiles(const int32_t type, int R, int T, const char *w, size_t w_stride, const char *a, size_t a_stride,
                          int64_t n_blocks, float *out, int64_t out_stride, const char *next) {
#define CALL_ROWS(r, t) tile_rows(type, r, t, w, w_stride, a, a_stride, n_blocks, out, out_stride, next)
    KR_TILE_SHAPES(CALL_ROWS)
}

// A file-layout tile (tile_loops.h's kr_row_tile) of any of the four types.
static void tile(int32_t type, int R, int T, const char *w, size_t w_stride, const char *a, size_t a_stride, int64_t n_blocks,
                 float *out, int64_t out_stride, const char *next) {
    switch (type) {
    case KR_Q4_0: type_tiles(KR_Q4_0, R, T, w, w_stride, a, a_stride, n_blocks, out, out_stride, next); break;
    case KR_Q4_1: type_tiles(KR_Q4_1, R, T, w, w_stride, a, a_stride, n_blocks, out, out_stride, next); break;
    case KR_Q5_0: type_tiles(KR_Q5_0, R, T, w, w_stride, a, a_stride, n_blocks, out, out_stride, next); break;
    default: type_tiles(KR_Q5_1, R, T, w, w_stride, a, a_stride, n_blocks, out, out_stride, next); break;
    }
}

void kr_matmul_legacy_avx2(int32_t type, const void *w, int64_t cols, const void *prepared, int64_t n_tokens, float *out,
                           int64_t out_stride, int64_t row_begin, int64_t row_end) {
    kr_matmul_row_tiles(type, w, cols, prepared, n_tokens, out, out_stride, row_begin, row_end, 4, 4, tile);
}

// ---------------------------------------------------------------------------------------------
// Packed layout (legacy.h): G <= 2 groups of 8 rows x T <= 4 tokens, the lanes of a vector being a
// group's 8 rows, as kernels_avx2.c's q8_0 tiles. A step multiplies one 32-byte chunk (8 rows x 4
// quants) by 4 activation bytes broadcast to every lane. Chunk i's low nibbles are elements
// 4i..4i+3 and its high nibbles 16+4i..16+4i+3; their fifth bits are bit p = i (low) and p = 4 + i
// (high) of each byte of the group's 32 bytes of fifth bits, moved to bit 4 with one shift and one
// and. Each block ends with one fused multiply-add (two with a minimum) for 8 outputs.

// A group block fetched ahead: one token's KR_STREAM_AHEAD bytes ahead (tile_loops.h) and the grid
// types' into L2 (kquant_tile.h's prefetch_group says why), the other types' of the next tile into
// L1, as they were measured (the avx512 build's pair tiles fetch every type's into L2:
// tiles_avx512.h). Into L1, one token's q4_0, q4_1 and q5_0 rows of 8960 columns streamed at 22 GB/s
// cold, into L2 at 26-31.
KR_INLINE void prefetch_block(const int32_t type, const int T, const char *at, size_t bytes) {
    for (size_t line = 0; line < bytes; line += 64) {
        if (kr_legacy_grid_type(type) || T == 1)
            _mm_prefetch(at + line, _MM_HINT_T1);
        else
            _mm_prefetch(at + line, _MM_HINT_T0);
    }
}

// Chunk i's low (high = 0) or high (high = 1) quants of one group, 8 rows x 4 bytes.
KR_INLINE __m256i packed_quants(const int32_t type, const char *group_block, const int i, const int high) {
    const size_t fifth_at = kr_legacy_packed_fifth(type), nibbles_at = kr_legacy_packed_nibbles(type);
    const __m256i low4 = _mm256_set1_epi8(0x0f);
#if defined(KR_HAVE_AVX512)
    // the avx512 build's one-token tiles: the nibbles masked as they are loaded (indexed_load.h),
    // the high ones then shifted down (a 16-bit shift of bytes masked to their high nibble moves
    // nothing across bytes)
    const char *at = group_block + nibbles_at + 32 * i;
    const __m256i chunk = high ? _mm256_srli_epi16(kr_and_load_indexed(at, _mm256_set1_epi8((char)0xf0)), 4)
                               : kr_and_load_indexed(at, low4);
    if (kr_legacy_grid_type(type)) return _mm256_shuffle_epi8(grid_lanes(type), chunk);
    if (!kr_legacy_has_fifth(type)) return chunk;
#else
    __m256i chunk = _mm256_loadu_si256((const __m256i *)(group_block + nibbles_at + 32 * i));
    if (high) chunk = _mm256_srli_epi16(chunk, 4);
    if (kr_legacy_grid_type(type)) return _mm256_shuffle_epi8(grid_lanes(type), _mm256_and_si256(chunk, low4));
    if (!kr_legacy_has_fifth(type)) return _mm256_and_si256(chunk, low4);
#endif
    const __m256i bits = _mm256_loadu_si256((const __m256i *)(group_block + fifth_at));
    const int p = 4 * high + i;  // bit p of each byte -> bit 4
    const __m256i moved = p < 4 ? _mm256_slli_epi16(bits, 4 - p) : p > 4 ? _mm256_srli_epi16(bits, p - 4) : bits;
    const __m256i fifth = _mm256_and_si256(moved, _mm256_set1_epi8(0x10));
#if defined(KR_HAVE_AVX512)
    return _mm256_ternarylogic_epi32(chunk, low4, fifth, 0xEA);  // (chunk & low4) | fifth in one step
#else
    return _mm256_or_si256(_mm256_and_si256(chunk, low4), fifth);
#endif
}

// sums[g][t] += the half's 4 chunks: steps i = 0..3 of the low (high = 0) or high quants.
KR_INLINE void packed_half(const int32_t type, const int G, const int T, const char *group_block, size_t group_stride,
                           const kr_block_q8_sum *ab[4], const int high, __m256i sums[2][4]) {
#pragma GCC unroll 4
    for (int i = 0; i < 4; i++) {
        __m256i q[2];
#pragma GCC unroll 2
        for (int g = 0; g < G; g++) q[g] = packed_quants(type, group_block + g * group_stride, i, high);
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) {
            const __m256i av = broadcast4(ab[t]->q + 16 * high + 4 * i);
#pragma GCC unroll 2
            for (int g = 0; g < G; g++) sums[g][t] = step_add(type, T, sums[g][t], q[g], av);
        }
    }
}

KR_INLINE void group_tile(const int32_t type, const int G, const int T, const char *w, size_t group_stride, const char *a,
                          size_t a_stride, int64_t n_blocks, float *out, int64_t out_stride, int keep_begin, int keep_end,
                          const char *next) {
    const size_t group_block_bytes = kr_legacy_group_block_bytes(type);
    __m256 acc[2][4];
#pragma GCC unroll 2
    for (int g = 0; g < G; g++)
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) acc[g][t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < n_blocks; b++) {
        const char *group_block = w + (size_t)b * group_block_bytes;
        const kr_block_q8_sum *ab[4];
#pragma GCC unroll 4
        for (int t = 0; t < T; t++) ab[t] = (const kr_block_q8_sum *)(a + t * a_stride) + b;
        if (next) prefetch_block(type, T, next + (size_t)b * group_block_bytes, group_block_bytes);
        __m256i sums[2][4], wide[2][4];
#pragma GCC unroll 2
        for (int g = 0; g < G; g++)
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) sums[g][t] = _mm256_setzero_si256();
#if defined(KR_HAVE_AVX512)
        packed_half(type, G, T, group_block, group_stride, ab, 0, sums);
        packed_half(type, G, T, group_block, group_stride, ab, 1, sums);
        (void)wide;
#else
        if (sums_are_wide(type)) {
            packed_half(type, G, T, group_block, group_stride, ab, 0, sums);
            packed_half(type, G, T, group_block, group_stride, ab, 1, sums);
            (void)wide;
        } else if (!kr_legacy_has_fifth(type)) {  // 8 steps of nibbles (mxfp4: of its grid) fit int16
            packed_half(type, G, T, group_block, group_stride, ab, 0, sums);
            packed_half(type, G, T, group_block, group_stride, ab, 1, sums);
#pragma GCC unroll 2
            for (int g = 0; g < G; g++)
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) sums[g][t] = widen_add(_mm256_setzero_si256(), sums[g][t]);
        } else {  // 5-bit quants: widen after each half of 4 steps
            packed_half(type, G, T, group_block, group_stride, ab, 0, sums);
#pragma GCC unroll 2
            for (int g = 0; g < G; g++)
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) {
                    wide[g][t] = widen_add(_mm256_setzero_si256(), sums[g][t]);
                    sums[g][t] = _mm256_setzero_si256();
                }
            packed_half(type, G, T, group_block, group_stride, ab, 1, sums);
#pragma GCC unroll 2
            for (int g = 0; g < G; g++)
#pragma GCC unroll 4
                for (int t = 0; t < T; t++) sums[g][t] = widen_add(wide[g][t], sums[g][t]);
        }
#endif
#pragma GCC unroll 2
        for (int g = 0; g < G; g++) {
            const char *gb = group_block + g * group_stride;
            const __m256 w_scale = type == KR_MXFP4 ? e8m0_half_8(gb) : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)gb));
            const __m256 w_min =
                kr_legacy_has_min(type) ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(gb + KR_LEGACY_PACKED_MINS))) : w_scale;
#pragma GCC unroll 4
            for (int t = 0; t < T; t++) {
                const __m256 a_scale = _mm256_set1_ps(ab[t]->d);
                __m256i s = sums[g][t];
                if (tile_offset(type)) s = _mm256_sub_epi32(s, _mm256_set1_epi32(tile_offset(type) * ab[t]->sum));
                acc[g][t] = _mm256_fmadd_ps(_mm256_mul_ps(w_scale, a_scale), _mm256_cvtepi32_ps(s), acc[g][t]);
                if (kr_legacy_has_min(type))
                    acc[g][t] = _mm256_fmadd_ps(w_min, _mm256_set1_ps(ab[t]->d * (float)ab[t]->sum), acc[g][t]);
            }
        }
    }
    store_groups(G, T, acc, out, out_stride, keep_begin, keep_end);
}

// Tile shape, groups x tokens, for several tokens (the build can override them to measure others;
// the bits are the same whatever the tile): q4_0 and q4_1, 2 x 2 in AVX2; the 5-bit types 1 x 4 in
// AVX2 (their sums take twice the int16 registers, and unpacking the fifth bits is shared by more
// tokens: 1.3x 2 x 2 at 512 tokens); every type 2 x 8 in the avx512 build (legacy_avx512.c's
// 512-bit tiles; a lone group, 1 x 4 at a time). One token: KR_ONE_TOKEN_GROUPS x 1 (kernels.h).
#ifndef KR_LEGACY_Q4_GROUPS
#define KR_LEGACY_Q4_GROUPS 2
#endif
#ifndef KR_LEGACY_Q4_TOKENS
#if defined(KR_HAVE_AVX512)
#define KR_LEGACY_Q4_TOKENS 8
#else
#define KR_LEGACY_Q4_TOKENS 2
#endif
#endif
#ifndef KR_LEGACY_Q5_GROUPS
#if defined(KR_HAVE_AVX512)
#define KR_LEGACY_Q5_GROUPS 2
#else
#define KR_LEGACY_Q5_GROUPS 1
#endif
#endif
#ifndef KR_LEGACY_Q5_TOKENS
#if defined(KR_HAVE_AVX512)
#define KR_LEGACY_Q5_TOKENS 8
#else
#define KR_LEGACY_Q5_TOKENS 4
#endif
#endif

// The avx512 build takes every tile of two groups from legacy_avx512.c (0 measures the 256-bit ones).
#ifndef KR_LEGACY_PAIR_TILE
#define KR_LEGACY_PAIR_TILE 1
#endif

// One instance of the packed tile per shape, for a type known at compile time.
KR_INLINE void type_group_tiles(const int32_t type, int G, int T, const char *w, size_t group_stride, const char *a,
                                size_t a_stride, int64_t n_blocks, float *out, int64_t out_stride, int keep_begin, int keep_end,
                                const char *next) {
#define CALL_GROUPS(g, t) group_tile(type, g, t, w, group_stride, a, a_stride, n_blocks, out, out_stride, keep_begin, keep_end, next)
    KR_GROUP_SHAPES(CALL_GROUPS)
}

// A packed tile (tile_loops.h's kr_group_tile) of any of the four types.
static void packed_tile(int32_t type, int G, int T, const char *w, size_t group_stride, const char *a, size_t a_stride,
                        int64_t n_blocks, float *out, int64_t out_stride, int keep_begin, int keep_end, const char *next,
                        int resume) {
    (void)resume;  // never resumed: kr_slice_blocks cuts no type of these tiles into slices
#if defined(KR_HAVE_AVX512)
    if (G == 2 && KR_LEGACY_PAIR_TILE) {
        kr_legacy_pair_tile_avx512(type, T, w, group_stride, a, a_stride, n_blocks, out, out_stride, keep_begin, keep_end,
                                   next);
        return;
    }
    if (T > 4) {
        kr_group_tile_by_fours(packed_tile, type, G, T, w, group_stride, a, a_stride, n_blocks, out, out_stride,
                               keep_begin, keep_end, next, resume);
        return;
    }
#endif
#define TYPE_GROUP_TILES(type) \
    type_group_tiles(type, G, T, w, group_stride, a, a_stride, n_blocks, out, out_stride, keep_begin, keep_end, next)
    switch (type) {
    case KR_Q4_0: TYPE_GROUP_TILES(KR_Q4_0); break;
    case KR_Q4_1: TYPE_GROUP_TILES(KR_Q4_1); break;
    case KR_Q5_0: TYPE_GROUP_TILES(KR_Q5_0); break;
    case KR_Q5_1: TYPE_GROUP_TILES(KR_Q5_1); break;
    case KR_IQ4_NL: TYPE_GROUP_TILES(KR_IQ4_NL); break;
    default: TYPE_GROUP_TILES(KR_MXFP4); break;
    }
}

void kr_matmul_packed_legacy_avx2(int32_t type, const void *w, int64_t rows, int64_t cols, const void *prepared,
                                  int64_t n_tokens, float *out, int64_t out_stride, int64_t row_begin, int64_t row_end) {
    const int q5 = kr_legacy_has_fifth(type);
    const int max_groups = n_tokens == 1 ? KR_ONE_TOKEN_GROUPS : q5 ? KR_LEGACY_Q5_GROUPS : KR_LEGACY_Q4_GROUPS;
    const int max_tokens = n_tokens == 1 ? 1 : q5 ? KR_LEGACY_Q5_TOKENS : KR_LEGACY_Q4_TOKENS;
    kr_matmul_group_tiles(type, w, rows, cols, prepared, n_tokens, out, out_stride, row_begin, row_end, max_groups, max_tokens,
                          packed_tile, kr_legacy_grid_type(type) ? kr_matmul_lowbit_avx2 : kr_matmul_legacy_avx2);
}

#else
typedef int kr_legacy_avx2_not_built;  // ISA=generic: this file is empty
#endif
