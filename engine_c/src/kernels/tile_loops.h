// tile_loops.h: the loops that walk a matmul's tiles, written once for every vector tile: a tile
// of rows in the file layout (kr_row_tile) or of packed groups (kr_group_tile), of any weight type
// and vector width. Only integer bookkeeping: which rows and tokens a tile gets, and which weights
// it fetches ahead. Each output's arithmetic is its tile's, whatever the tile shape, the batch or
// the row range. Internal to the kernels.
#ifndef KRAFLA_KERNELS_TILE_LOOPS_H
#define KRAFLA_KERNELS_TILE_LOOPS_H

#include "kernels/kernels.h"

// Tokens are taken in blocks whose prepared activations fit in L2 (about 256 KiB), so each tile
// finds them there; the weights are read once per block.
#define KR_ACTIVATION_BLOCK_BYTES (256 * 1024)

// A row's length in blocks of its type (columns for float weights), as the tiles take it.
static inline int64_t kr_row_blocks(int32_t type, int64_t cols) {
    const int64_t block = kr_kernel_type_block(type);
    return block ? cols / block : 0;
}

// Tokens per block: a whole number of tiles of max_tokens, at least one.
static inline int64_t kr_token_block(size_t a_stride, int64_t n_tokens, int max_tokens) {
    const int64_t block_tokens = a_stride ? (int64_t)(KR_ACTIVATION_BLOCK_BYTES / a_stride) : n_tokens;  // cols 0: no blocks
    return block_tokens < max_tokens ? max_tokens : block_tokens - block_tokens % max_tokens;
}

// A file-layout tile: R <= 4 rows x T <= 4 tokens of n_blocks blocks (kr_row_blocks), the rows at
// w (w_stride apart), the tokens' prepared rows at a (a_stride apart), out relative to the tile.
// `next`: the rows of the tile that follows (NULL if none), fetched ahead block by block alongside
// this tile's, so a cold matrix streams from memory ahead of the arithmetic.
typedef void kr_row_tile(int32_t type, int R, int T, const char *w, size_t w_stride, const char *a, size_t a_stride,
                         int64_t n_blocks, float *out, int64_t out_stride, const char *next);

// The file layout's matmul (kernels.h, kr_matmul) over tiles of up to max_rows x max_tokens.
// Within a block of tokens, rows outside and tokens inside: a tile's weight rows stay in L1 while
// the block's tokens pass over them, and the next row tile is fetched while the first token tile
// passes over this one.
static inline void kr_matmul_row_tiles(int32_t type, const void *w, int64_t cols, const void *prepared, int64_t n_tokens,
                                       float *out, int64_t out_stride, int64_t row_begin, int64_t row_end, int max_rows,
                                       int max_tokens, kr_row_tile *tile) {
    const size_t w_stride = kr_weight_row_bytes(type, cols), a_stride = kr_activation_row_bytes(type, cols);
    const int64_t n_blocks = kr_row_blocks(type, cols);
    const int64_t block_tokens = kr_token_block(a_stride, n_tokens, max_tokens);
    for (int64_t b0 = 0; b0 < n_tokens; b0 += block_tokens) {
        const int64_t b1 = n_tokens - b0 < block_tokens ? n_tokens : b0 + block_tokens;
        for (int64_t r0 = row_begin; r0 < row_end; r0 += max_rows) {
            const int R = (int)(row_end - r0 < max_rows ? row_end - r0 : max_rows);
            for (int64_t t0 = b0; t0 < b1; t0 += max_tokens) {
                const int T = (int)(b1 - t0 < max_tokens ? b1 - t0 : max_tokens);
                const char *next = t0 == b0 && r0 + R < row_end ? (const char *)w + (size_t)(r0 + R) * w_stride : NULL;
                tile(type, R, T, (const char *)w + (size_t)r0 * w_stride, w_stride, (const char *)prepared + (size_t)t0 * a_stride,
                     a_stride, n_blocks, out + t0 * out_stride + r0, out_stride, next);
            }
        }
    }
}

// A packed tile (kernels.h, "Packed weights"): G <= max_groups groups of 8 rows x T <= max_tokens
// tokens of n_blocks blocks, the groups at w and w + group_stride, the tokens' prepared rows at a (a_stride apart), out
// relative to the tile's first row; stores the rows [keep_begin, keep_end) of the tile (a row range
// may start or end inside a group). `next`: the group after the tile, prefetched (NULL if none).
// `resume`: the tile's rows are a column slice after the first (kernels.h, kr_slice_blocks), so each
// output continues from the sum in `out` instead of from zero. Only the types kr_slice_blocks cuts
// into slices (q4_K) are ever resumed, so only their tiles (kquant_tile.h) read it.
typedef void kr_group_tile(int32_t type, int G, int T, const char *w, size_t group_stride, const char *a, size_t a_stride,
                           int64_t n_blocks, float *out, int64_t out_stride, int keep_begin, int keep_end, const char *next,
                           int resume);
// A tile of T > 4 tokens as tiles of 4 and the rest, for the 256-bit group tiles, which take at most
// 4 (the avx512 build's group loop asks for 8, which its 512-bit pair tiles take whole).
static inline void kr_group_tile_by_fours(kr_group_tile *tile, int32_t type, int G, int T, const char *w,
                                          size_t group_stride, const char *a, size_t a_stride, int64_t n_blocks,
                                          float *out, int64_t out_stride, int keep_begin, int keep_end,
                                          const char *next, int resume) {
    for (int t0 = 0; t0 < T; t0 += 4)
        tile(type, G, T - t0 < 4 ? T - t0 : 4, w, group_stride, a + t0 * a_stride, a_stride, n_blocks,
             out + t0 * out_stride, out_stride, keep_begin, keep_end, t0 ? NULL : next, resume);
}

// A one-token tile at `tile_w` of rows that end at `end`: where to fetch ahead (NULL: nothing left).
static inline const char *kr_stream_next(const char *tile_w, const char *end) {
    return end - tile_w > KR_STREAM_AHEAD ? tile_w + KR_STREAM_AHEAD : NULL;
}

// The file layout's matmul of the same type, for the rows past the last whole group of 8.
typedef void kr_file_rows(int32_t type, const void *w, int64_t cols, const void *prepared, int64_t n_tokens, float *out,
                          int64_t out_stride, int64_t row_begin, int64_t row_end);

// The packed matmul (kernels.h, kr_matmul_packed) over tiles of up to max_groups x max_tokens.
// Within a block of tokens, column slices outside (one unless the rows are long: kr_slice_blocks),
// then groups, then tokens, as the file layout's rows.
static inline void kr_matmul_group_tiles(int32_t type, const void *w, int64_t rows, int64_t cols, const void *prepared,
                                         int64_t n_tokens, float *out, int64_t out_stride, int64_t row_begin, int64_t row_end,
                                         int max_groups, int max_tokens, kr_group_tile *tile, kr_file_rows *file_rows) {
    const int64_t grouped = rows - rows % KR_PACK_ROWS;
    if (row_end > grouped) {  // the rows past the last group are in file layout
        file_rows(type, w, cols, prepared, n_tokens, out, out_stride, row_begin > grouped ? row_begin : grouped, row_end);
        row_end = grouped;
    }
    if (row_begin >= row_end) return;
    const size_t a_stride = kr_activation_row_bytes(type, cols);
    const int64_t n_blocks = kr_row_blocks(type, cols), block_tokens = kr_token_block(a_stride, n_tokens, max_tokens);
    const int64_t per_slice = kr_slice_blocks(type, n_blocks), block_cols = n_blocks ? cols / n_blocks : 0;
    const int64_t n_slices = n_blocks ? (n_blocks + per_slice - 1) / per_slice : 1;  // cols 0: one slice of no blocks
    const int64_t group_begin = row_begin / KR_PACK_ROWS, group_end = (row_end + KR_PACK_ROWS - 1) / KR_PACK_ROWS;
    const bool fetches = kr_stream_fetches(type);  // one token: past the call's first KR_STREAM_AHEAD bytes
    for (int64_t b0 = 0; b0 < n_tokens; b0 += block_tokens) {
        const int64_t b1 = n_tokens - b0 < block_tokens ? n_tokens : b0 + block_tokens;
        for (int64_t s = 0; s < n_slices; s++) {
            const int64_t slice = s * per_slice, length = kr_slice_length(n_blocks, per_slice, slice);
            const char *slice_w = (const char *)w + (size_t)grouped * kr_weight_row_bytes(type, slice * block_cols);
            const char *slice_a = (const char *)prepared + kr_activation_row_bytes(type, slice * block_cols);
            const size_t group_stride = KR_PACK_ROWS * kr_weight_row_bytes(type, length * block_cols);
            const char *rows_end = slice_w + (size_t)group_end * group_stride;
            if (n_tokens == 1) kr_stream_call(slice_w + (size_t)group_begin * group_stride, rows_end);
            for (int64_t g0 = group_begin; g0 < group_end; g0 += max_groups) {
                const int G = (int)(group_end - g0 < max_groups ? group_end - g0 : max_groups);
                const int64_t first = g0 * KR_PACK_ROWS;
                const int keep_begin = (int)(row_begin > first ? row_begin - first : 0);
                const int keep_end = (int)(row_end - first < G * KR_PACK_ROWS ? row_end - first : G * KR_PACK_ROWS);
                const char *tile_w = slice_w + (size_t)g0 * group_stride;
                const char *next = n_tokens == 1      ? (fetches ? kr_stream_next(tile_w, rows_end) : NULL)
                                   : g0 + G < group_end ? tile_w + (size_t)G * group_stride
                                                        : NULL;
                for (int64_t t0 = b0; t0 < b1; t0 += max_tokens) {
                    const int T = (int)(b1 - t0 < max_tokens ? b1 - t0 : max_tokens);
                    tile(type, G, T, tile_w, group_stride, slice_a + (size_t)t0 * a_stride, a_stride, length,
                         out + t0 * out_stride + first, out_stride, keep_begin, keep_end, t0 == b0 ? next : NULL, slice > 0);
                }
            }
        }
    }
}

#endif
