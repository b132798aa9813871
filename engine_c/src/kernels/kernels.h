// kernels.h: the numeric kernels the model code (engine_c/src/model/) calls. Internal to the library.
//
// Each kernel has a plain-C reference twin in quant_ref.c (suffix _ref; f16.c for the f16
// conversions) and an AVX2 version in kernels_avx2.c (suffix _avx2). The unsuffixed name is the
// dispatch (kernels.c): the AVX2 version in an ISA=avx2 build, the reference in ISA=generic. The
// weight types themselves (block sizes, which kernels take them) are types/types.h's.
//
// Reproducibility contract: the value computed for one (token, output row) pair depends only on
// that token's activations and that row's weights, never on how many tokens are in the batch,
// which rows a thread was given, or how the loops are tiled. So the reduction order over the
// columns (K) is fixed per kernel, and the same in every ISA:
//   - float weights (f32, f16, bf16): 8 lanes over K, then a fixed horizontal sum and a scalar
//     tail (quant_ref.c, kr_lanes_sum);
//   - quantized weights (q8_0, q4_0): per block of 32, the exact integer sum of the 32 products,
//     then one fused multiply-add per block in block order:
//         acc = fmaf(d_weight * d_activation, (float)block_sum, acc),   acc starting at 0.
//     The integer sums are exact however they are computed (|sum| < 2^24), and the scale product
//     of two f16 values is exact in float, so every kernel that keeps the block order gives the
//     same bits: one row at a time, 8 rows in the lanes of a vector, AVX2 or VNNI.
#ifndef KRAFLA_KERNELS_H
#define KRAFLA_KERNELS_H

#include "types/types.h"

#include <assert.h>
#include <stdint.h>
#include <stddef.h>

#define KR_QK 32  // weights per q8_0 / q4_0 block

typedef uint16_t kr_f16;

typedef struct {
    kr_f16 d;              // scale
    int8_t q[KR_QK];       // weight = d * q
} kr_block_q8_0;

typedef struct {
    kr_f16 d;              // scale
    uint8_t q[KR_QK / 2];  // byte j: weight j (low nibble), weight j+16 (high nibble); w = d*(n-8)
} kr_block_q4_0;

// Activations prepared for q4_0 weights: q8_0 blocks (kr_quantize_row_q8_0's values) with the scale
// as a float and the sum of the quants, so a kernel subtracts 8 * sum once per block instead of 8
// from every weight.
typedef struct {
    float d;               // the q8_0 block's f16 scale, as a float
    int32_t sum;           // sum of q
    int8_t q[KR_QK];
} kr_block_q8_sum;

static_assert(sizeof(kr_block_q8_0) == 2 + 32, "q8_0 block size");
static_assert(sizeof(kr_block_q8_sum) == 8 + 32, "q8_0 activation block with sum");
static_assert(sizeof(kr_block_q4_0) == 2 + 16, "q4_0 block size");

// f16 <-> f32, IEEE round-to-nearest-even (bit-exact with F16C and numpy; NaNs come out quiet,
// payload kept, as F16C does): f16.c.
float kr_f16_to_f32(kr_f16 h);
kr_f16 kr_f32_to_f16(float f);
float kr_f16_to_f32_ref(kr_f16 h);
kr_f16 kr_f32_to_f16_ref(float f);
float kr_bf16_to_f32(uint16_t h);
// Whole rows (KV cache f16 writes and reads). A row kernel's signature is a type, declared once for
// its dispatch name, its reference and its AVX2 version.
typedef void kr_f16_to_f32_row_kernel(const kr_f16 *x, float *y, int64_t n);
typedef void kr_f32_to_f16_row_kernel(const float *x, kr_f16 *y, int64_t n);
kr_f16_to_f32_row_kernel kr_f16_to_f32_row, kr_f16_to_f32_row_ref, kr_f16_to_f32_row_avx2;
kr_f32_to_f16_row_kernel kr_f32_to_f16_row, kr_f32_to_f16_row_ref, kr_f32_to_f16_row_avx2;
// A float's bits and back.
static inline uint32_t kr_float_bits(float f) {
    uint32_t u;
    __builtin_memcpy(&u, &f, sizeof u);
    return u;
}
static inline float kr_bits_float(uint32_t u) {
    float f;
    __builtin_memcpy(&f, &u, sizeof f);
    return f;
}

// The weight types kr_matmul and kr_dequantize_row take: types.h's kr_kernel_type_supported,
// checked where a tensor's type enters; the kernels themselves do not check.

// Quantize n floats (n a multiple of 32) to q8_0 exactly as ggml's quantize_row_q8_0_ref:
// d = amax/127, q = round(x/d).
typedef void kr_quantize_q8_0_kernel(const float *x, kr_block_q8_0 *y, int64_t n);
kr_quantize_q8_0_kernel kr_quantize_row_q8_0, kr_quantize_row_q8_0_ref, kr_quantize_row_q8_0_avx2;
// The same values as kr_block_q8_sum blocks (prepared activations for q4_0 weights).
typedef void kr_quantize_q8_sum_kernel(const float *x, kr_block_q8_sum *y, int64_t n);
kr_quantize_q8_sum_kernel kr_quantize_row_q8_sum, kr_quantize_row_q8_sum_ref, kr_quantize_row_q8_sum_avx2;

// One row of any weight type to floats (embedding lookup, tests; kernels.c).
void kr_dequantize_row(int32_t type, const void *row, float *out, int64_t n);

// Prepared activations (activations.c; kernels.c's kr_prepare_activations passes the dispatch
// quantizers): what a matmul against weights of `weight_type` reads. For q8_0 weights each token's
// row is quantized to q8_0 blocks, for q4_0 weights to kr_block_q8_sum blocks (the same
// quantization); for f32, f16 and bf16 weights the f32 rows are used as they are.
// kr_activation_bytes gives the buffer size for n_tokens rows of `cols`.
size_t kr_activation_bytes(int32_t weight_type, int64_t n_tokens, int64_t cols);
size_t kr_activation_row_bytes(int32_t weight_type, int64_t cols);  // one token's share
// Columns per prepared block: 32 or 256 for quantized activations, 1 for f32 rows. A token's row is
// its blocks one after another, so a run of whole blocks prepares on its own (kr_prepare_columns).
int64_t kr_activation_block(int32_t weight_type);
// Prepares rows [token_begin, token_end) of x (n_tokens x cols, row stride cols) into `prepared`.
void kr_prepare_activations(int32_t weight_type, const float *x, int64_t cols, void *prepared,
                            int64_t token_begin, int64_t token_end);
// Prepares columns [col_begin, col_end) of one token's row x into its prepared row: col_begin a
// multiple of kr_activation_block, col_end too or the row's end. The bits of the whole row's.
void kr_prepare_columns(int32_t weight_type, const float *x, int64_t col_begin, int64_t col_end, void *prepared);
// The same with chosen quantizers (tests run the reference and the AVX2 ones separately).
struct kr_block_q8_K;
typedef void kr_quantize_q8_K_kernel(const float *x, struct kr_block_q8_K *y, int64_t n);
typedef struct {
    kr_quantize_q8_0_kernel *q8_0;
    kr_quantize_q8_sum_kernel *q8_sum;
    kr_quantize_q8_K_kernel *q8_K;  // k-quant weights (kr_block_q8_K below)
} kr_quantizers;
void kr_prepare_activations_with(int32_t weight_type, const float *x, int64_t cols, void *prepared,
                                 int64_t token_begin, int64_t token_end, const kr_quantizers *quantize);

// out[t * out_stride + r] = sum_k W[r, k] * x[t, k] for t in [0, n_tokens), r in [row_begin, row_end).
// W is (rows x cols) of weight_type in file layout; `prepared` comes from kr_prepare_activations.
void kr_matmul_ref(int32_t weight_type, const void *w, int64_t cols, const void *prepared, int64_t n_tokens,
                   float *out, int64_t out_stride, int64_t row_begin, int64_t row_end);
void kr_matmul_avx2(int32_t weight_type, const void *w, int64_t cols, const void *prepared, int64_t n_tokens,
                    float *out, int64_t out_stride, int64_t row_begin, int64_t row_end);
void kr_matmul(int32_t weight_type, const void *w, int64_t cols, const void *prepared, int64_t n_tokens,
               float *out, int64_t out_stride, int64_t row_begin, int64_t row_end);

// Small vector kernels for attention and norms (fixed reduction order as above).
float kr_dot_f32_ref(const float *a, const float *b, int64_t n);
float kr_dot_f32_avx2(const float *a, const float *b, int64_t n);
float kr_dot_f32(const float *a, const float *b, int64_t n);
float kr_dot_f16_f32_ref(const kr_f16 *a, const float *b, int64_t n);
float kr_dot_f16_f32_avx2(const kr_f16 *a, const float *b, int64_t n);
float kr_dot_f16_f32(const kr_f16 *a, const float *b, int64_t n);
// y += a * x, one fmaf per element
void kr_axpy_f32(float a, const float *x, float *y, int64_t n);
void kr_axpy_f16_f32(float a, const kr_f16 *x, float *y, int64_t n);
void kr_axpy_f32_ref(float a, const float *x, float *y, int64_t n);
void kr_axpy_f16_f32_ref(float a, const kr_f16 *x, float *y, int64_t n);
void kr_axpy_f32_avx2(float a, const float *x, float *y, int64_t n);
void kr_axpy_f16_f32_avx2(float a, const kr_f16 *x, float *y, int64_t n);

// Attention over a KV cache, several rows per call (rows of n values, type KR_F32 or KR_F16, row i
// at `rows + i * row_stride` bytes):
//   kr_dot_rows:  out[i] = dot(row i, x), bit for bit what kr_dot_f32 / kr_dot_f16_f32 give per row;
//   kr_axpy_rows: y += weights[i] * row i for i = 0, 1, ..., bit for bit n_rows kr_axpy_* calls.
// Faster than a call per row: independent rows overlap, and y stays in registers.
void kr_dot_rows(int32_t type, const void *rows, size_t row_stride, int64_t n_rows, const float *x, int64_t n, float *out);
void kr_dot_rows_ref(int32_t type, const void *rows, size_t row_stride, int64_t n_rows, const float *x, int64_t n, float *out);
void kr_dot_rows_avx2(int32_t type, const void *rows, size_t row_stride, int64_t n_rows, const float *x, int64_t n, float *out);
void kr_axpy_rows(int32_t type, const float *weights, const void *rows, size_t row_stride, int64_t n_rows, float *y, int64_t n);
void kr_axpy_rows_ref(int32_t type, const float *weights, const void *rows, size_t row_stride, int64_t n_rows, float *y,
                      int64_t n);
void kr_axpy_rows_avx2(int32_t type, const float *weights, const void *rows, size_t row_stride, int64_t n_rows, float *y,
                       int64_t n);

// Element-wise functions built on one exp: the same bits in every build (the reference and AVX2
// run the same float operations), error within 2 ulp of the true exp. exp overflows to inf and
// underflows through the subnormals to 0 as IEEE float does; NaN stays NaN.
//   kr_exp_f32:           y[i] = exp(x[i])
//   kr_exp_shift_sum_f32: x[i] = exp(x[i] - shift), returns their sum in the 8-lane order (softmax)
//   kr_silu_mul_f32:      gate[i] = gate[i] / (1 + exp(-gate[i])) * up[i]
//   kr_gelu_tanh_mul_f32: gate[i] = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * up[i],
//                         tanh(z) = 1 - 2 / (exp(2z) + 1)
//   kr_swiglu_oai_mul_f32: gpt-oss's clamped SwiGLU, g = min(gate[i], limit), u = up[i] clamped to
//                         [-limit, limit], gate[i] = g / (1 + exp(-alpha g)) * (u + 1); the scalar
//                         reference in every build (NaN stays NaN)
float kr_exp_one_ref(float x);  // one value (the AVX2 versions' scalar tails use it too)
void kr_swiglu_oai_mul_f32(float *gate, const float *up, int64_t n, float alpha, float limit);
void kr_swiglu_oai_mul_f32_ref(float *gate, const float *up, int64_t n, float alpha, float limit);
void kr_exp_f32(const float *x, float *y, int64_t n);
float kr_exp_shift_sum_f32(float *x, int64_t n, float shift);
void kr_silu_mul_f32(float *gate, const float *up, int64_t n);
void kr_gelu_tanh_mul_f32(float *gate, const float *up, int64_t n);
void kr_exp_f32_ref(const float *x, float *y, int64_t n);
float kr_exp_shift_sum_f32_ref(float *x, int64_t n, float shift);
void kr_silu_mul_f32_ref(float *gate, const float *up, int64_t n);
void kr_gelu_tanh_mul_f32_ref(float *gate, const float *up, int64_t n);
void kr_exp_f32_avx2(const float *x, float *y, int64_t n);
float kr_exp_shift_sum_f32_avx2(float *x, int64_t n, float shift);
void kr_silu_mul_f32_avx2(float *gate, const float *up, int64_t n);
void kr_gelu_tanh_mul_f32_avx2(float *gate, const float *up, int64_t n);

// The sampler's scan of a row of logits, one pass: the lowest id among the greatest values
// (compared with >, so -0 and +0 are equal), or -1 when a value is NaN or +inf, or every value is
// -inf (the caller then looks for which). Every build picks the same id.
int64_t kr_argmax_f32(const float *x, int64_t n);
int64_t kr_argmax_f32_ref(const float *x, int64_t n);
int64_t kr_argmax_f32_avx2(const float *x, int64_t n);

// The pieces of the fixed reduction order (quant_ref.c explains it): the horizontal sum of 8
// lanes (float kernels), and the exact integer sum of one quantized block pair (32 products).
float kr_lanes_sum(const float lanes[8]);
int32_t kr_block_sum_q8_0_ref(const kr_block_q8_0 *w, const kr_block_q8_0 *a);
int32_t kr_block_sum_q4_0_ref(const kr_block_q4_0 *w, const kr_block_q8_sum *a);

// --- Packed weights (owner: speed; pack.c, quant_ref.c, kernels_avx2.c)
// The packed layout of a q4_0 or q8_0 matrix, the same size as the file layout. The rows go in
// groups of KR_PACK_ROWS (8), each group where its rows are in the file; rows past the last whole
// group stay as they are in the file. Inside a group, block after block: first the 8 rows' f16
// scales (16 bytes), then the quants in chunks of 32 bytes, chunk i holding bytes 4i..4i+3 of each
// row's quants, row after row (4 chunks for q4_0, 8 for q8_0). One 32-byte load then gives 8 rows x
// 4 bytes: a vector whose lanes are rows, so a kernel multiplies it by 4 activation bytes
// broadcast to every lane and adds the block's integer sums of 8 rows in the lanes, and 8 outputs
// take their per-block fused multiply-add in one instruction. For q4_0, chunk i's low nibbles are
// elements 4i..4i+3 of the rows and its high nibbles elements 16+4i..16+4i+3. q4_1, q5_0, q5_1,
// iq4_nl and mxfp4 extend q4_0's layout (legacy.h), the k-quants have their own (kquant_ref.c).
// Version of this layout (packed caches carry it): KR_PACK_LAYOUT (3: iq4_nl and mxfp4 packed too;
// 4: q6_K's chunks in the order the tiles read them, kr_q6_K_ql_at; 5: q5_K's fifth bits before its
// quants, kr_q5_K_qh_at; 6: long q4_K rows in column slices, kr_slice_blocks).
#define KR_PACK_ROWS 8
// Groups per tile in one-token packed matmuls (q8_0, q4_0 and its family; the k-quants through
// kquant_vnni256.c): one. Generation is bound by memory, and tiles of one group read a matrix as one
// stream, group after group, where tiles of two read two streams a group's bytes apart, which the
// prefetchers follow worse: on this machine (4 Dec, quiet) one thread's generation went from 22 to
// 28.5 tokens/s on Qwen2.5-Coder-1.5B Q4_K_M, 42 to 72 on Qwen2.5-Coder-0.5B Q4_0 and 123 to 261 on
// SmolLM2-135M Q4_1 (two threads on the 1.5B: 35.5 to 43). Whatever the tile, the bits are the same.
#ifndef KR_ONE_TOKEN_GROUPS
#define KR_ONE_TOKEN_GROUPS 1
#endif
#define KR_PACK_LAYOUT 6

// Column slices. A packed matrix whose rows are long is stored as column slices: slice after slice
// of kr_slice_blocks(type, n_blocks) blocks of every row (the last slice may be shorter), each slice
// the packed layout above of its blocks, over the rows of whole groups; the rows past the last
// group stay in file layout after the last slice. A matmul goes through the slices in order, each
// tile continuing its rows' sums where the slice before left them (kr_group_tile's `resume`), so
// every output takes the same float steps in the same order as without slices.
// Why: a one-token tile of a group reads the token's activations for the whole row between the
// group's weights. A q4_K row of 8960 columns has 10 KiB of them (q8_K), read between 40 KiB of
// weights: more than L1 holds, so every group fetches them again from L2, and a cold q4_K 1536x8960
// matmul streamed at 23-25 GB/s at one thread, against 29-30 for rows of 1536 columns. A slice's
// activations (at most 4.6 KiB) stay in L1 from one group to the next: in 3 slices the same matrix
// streams at 26-29.5 GB/s, and a 3584x18944 one (a 7B's ffn_down) in 5 at 27.5-29 instead of 23.
// Rows of up to KR_SLICE_ABOVE super-blocks stream as fast whole (29-29.5 GB/s at 3072 and 4608
// columns, 27 at 6144), and cut in two they lost at two threads (Qwen2.5-0.5B's 896x4864: 29-34 GB/s
// against 34.5-35.5), so they are not sliced.
// Only q4_K is sliced: its tiles leave the stream to the hardware prefetchers (kr_stream_fetches),
// while q4_0, q5_K and q6_K, whose tiles fetch ahead on AMD, stream as fast either way there (bench/
// cold_matmul.c, docs/kernels.md, "Long q4_K rows in column slices").
#define KR_SLICE_BLOCKS 16  // the longest slice
#define KR_SLICE_ABOVE 20   // rows longer than this are sliced
static inline int64_t kr_slice_blocks(int32_t type, int64_t n_blocks) {
    if (type != KR_Q4_K || n_blocks <= KR_SLICE_ABOVE) return n_blocks;
    const int64_t slices = (n_blocks + KR_SLICE_BLOCKS - 1) / KR_SLICE_BLOCKS;
    return (n_blocks + slices - 1) / slices;  // slices of equal length, but the last
}
// The blocks of the slice that starts at block `first`.
static inline int64_t kr_slice_length(int64_t n_blocks, int64_t per_slice, int64_t first) {
    return n_blocks - first < per_slice ? n_blocks - first : per_slice;
}
// Where in a packed matrix of `grouped` rows in whole groups and n_blocks blocks of block_bytes per
// row the group block of row r's block b lies (r < grouped): KR_PACK_ROWS * block_bytes bytes.
static inline const char *kr_packed_group_block(int32_t type, const void *w, int64_t grouped, int64_t n_blocks,
                                                size_t block_bytes, int64_t r, int64_t b) {
    const int64_t per_slice = kr_slice_blocks(type, n_blocks), first = b - b % per_slice;
    const int64_t length = kr_slice_length(n_blocks, per_slice, first);
    return (const char *)w + ((size_t)grouped * (size_t)first + (size_t)(r - r % KR_PACK_ROWS) * (size_t)length +
                              KR_PACK_ROWS * (size_t)(b - first)) * block_bytes;
}

// Where q6_K's chunks lie in a packed group super-block (kquant_ref.c; chunk i of 32 bytes holds
// bytes 4i..4i+3 of each of the 8 rows): after d and the scales (144 bytes), one half of 768 bytes
// per 128 weights h, which holds qh's chunks 8h..8h+7, each followed by ql's chunk 16h + i of the
// same weights' low bits, then ql's chunks 16h + 8..16h + 15. A one-token tile then reads every
// super-block front to back, which the hardware prefetchers follow; in the order of the file's
// fields (all of ql, then all of qh) the tile read two regions in turn, and a cold q6_K matmul
// streamed at 27-29 GB/s where it now streams at 30-31, and Qwen2.5-Coder-1.5B Q4_K_M generated 5%
// slower at one thread and 3% at two (docs/kernels.md, "Where the prefetchers suffice").
static inline size_t kr_q6_K_qh_at(int chunk) { return 144 + 768 * (size_t)(chunk / 8) + 64 * (size_t)(chunk % 8); }
static inline size_t kr_q6_K_ql_at(int chunk) {
    const int h = chunk / 16, i = chunk % 16;
    return i < 8 ? kr_q6_K_qh_at(8 * h + i) + 32 : 144 + 768 * (size_t)h + 512 + 32 * (size_t)(i - 8);
}
// q5_K's chunk i of fifth bits, and q4_K's and q5_K's chunk (c, i) of quants (kquant_ref.c): in
// q5_K each chunk of fifth bits comes just before the quants' chunk (0, i) it is first read with,
// for the same reason (the steps of every later c read it again, from L1). After all the quants, as
// until layout 5, a cold q5_K matmul streamed at 25-26.5 GB/s at one thread, and now at 30-31
// (bench/cold_matmul.c, 8960x1536 and 1536x8960; with the chunks of fifth bits all before the
// quants, 29.3-30.8); it keeps its fetches ahead, without which it streams at 26.5-28.
static inline size_t kr_q5_K_qh_at(int i) { return 128 + 64 * (size_t)i; }
static inline size_t kr_q45_K_qs_at(int is_q5, int c, int i) {
    if (!is_q5) return 128 + 256 * (size_t)c + 32 * (size_t)i;
    return c == 0 ? kr_q5_K_qh_at(i) + 32 : 384 + 256 * (size_t)c + 32 * (size_t)i;
}

// One token's matmul reads each weight once, straight from memory, group after group as one
// stream. Its tiles fetch ahead by a fixed distance: while a tile computes, it fetches the bytes
// KR_STREAM_AHEAD past its own (its `next`), and the call first fetches the first KR_STREAM_AHEAD
// bytes of its rows at once, so no part of the stream waits for the hardware prefetchers to find
// it. Fetching the next tile instead (one tile ahead: 7 KiB for a q4_K row of 1536 columns, 59 KiB
// for a q6_K one of 8960) left a cold one-token matmul at 24-27 GB/s on this machine (AMD EPYC,
// AVX-512, where one thread's plain read gives 32-35: bench/stream_read.c); 16 KiB ahead gives
// 28-31, and Qwen2.5-Coder-1.5B Q4_K_M generates 10% faster at one thread and 9% at two (16 KiB was
// best at two threads of 12, 16, 24 and 32; docs/kernels.md, "A fixed distance ahead"). Nothing is
// fetched past the rows of the call: at two threads those belong to the other thread's parts.
#define KR_STREAM_AHEAD (16 * 1024)

// Whether a one-token matmul's tiles of `type` fetch KR_STREAM_AHEAD ahead, or leave the stream to
// the hardware prefetchers after the call's first fetch. q4_K's tiles read each group super-block
// front to back, which the prefetchers follow alone: without the tiles' fetches a cold q4_K matmul
// streams as fast at one thread and at 100% of `stream_read 2` at two (36 GB/s, against 32-33 with
// them), and Qwen2.5-Coder-1.5B Q4_K_M generates 5-7% faster at two threads when the host gives two
// threads 36 GB/s (bench/ab_generate.c, docs/kernels.md, "Where the prefetchers suffice"). The
// others lose without theirs: q6_K 2% at one thread (and fell to 7 GB/s before its chunks were in
// reading order, kr_q6_K_ql_at), q5_K and the q4_0 family of long rows 10-25%.
// That was on AMD EPYC (Zen 4). On Intel Xeon (a Sapphire Rapids-class host, 7 Dec: 15 GB/s from
// `stream_read 1`, 28 from `stream_read 2`) q5_K's, q6_K's and q8_0's fetches cost what they cost
// q4_K on AMD: without them a cold matmul streams at 13.5-14.3 GB/s instead of 12.5-12.9 (q6_K),
// 13.5-14.2 instead of 11.8 (q5_K) and 15-16 instead of 12.2-13 (q8_0) at one thread, and 6-10%,
// 21% and 20% faster at two; only the q4_0 family's short rows still gain from theirs (13.8
// against 12.9 GB/s). So kr_cpu_prefetchers_suffice() (kernels.c: an Intel CPU) drops them there.
// Fetching decides no bits, only when bytes arrive.
bool kr_cpu_prefetchers_suffice(void);
static inline bool kr_stream_fetches(int32_t type) {
    if (type == KR_Q4_K) return false;
    return !(kr_cpu_prefetchers_suffice() && (type == KR_Q5_K || type == KR_Q6_K || type == KR_Q8_0));
}

// The first KR_STREAM_AHEAD bytes from `first`, up to `end`, fetched into L2 (prefetcht1): what a
// one-token matmul over them reads first. experts.c also fetches the next expert's rows so.
static inline void kr_stream_start(const void *first, const void *end) {
    const char *line = first, *stop = (const char *)first + KR_STREAM_AHEAD;
    for (; line < stop && line < (const char *)end; line += 64) __builtin_prefetch(line, 0, 2);
}
// The start of a one-token matmul reading [first, end): kr_stream_start, unless one of this
// thread's last four ended at `first`. Then the call continues a stream the prefetchers already follow
// (a thread's runs of its share of a matmul, threads.h's kr_pool_run_shares), and fetching its
// first bytes again only stalls it: a cold q4_K 8960x1536 matmul cut into 64 calls in order
// streamed at 26.5 GB/s with the fetch and 30 without it, as fast as in one call (one thread,
// bench/cold_matmul.c; in an order that starts a new stream at each call, 23 either way).
void kr_stream_call(const void *first, const void *end);

// The packable types: types.h's kr_packable.
// Rearrange a (rows, cols) matrix of a packable type from file layout (src) to packed (dst).
void kr_pack_rows(int32_t weight_type, const void *src, void *dst, int64_t rows, int64_t cols);
// The inverse, a block or a row at a time: row r's block b of a packed (rows, cols) matrix back in
// file form (KR_MAX_BLOCK_BYTES at most), and row r as floats (kernels.c), bit for bit
// kr_dequantize_row of the file's row (a tied output head, packed, is the token embedding the model
// looks rows up in).
#define KR_MAX_BLOCK_BYTES 256
void kr_packed_block(int32_t weight_type, const void *w, int64_t rows, int64_t cols, int64_t r, int64_t b, void *block);
void kr_dequantize_packed_row(int32_t weight_type, const void *w, int64_t rows, int64_t cols, int64_t r, float *out);
// The walk every packed layout shares (q4_0/q8_0, legacy.h's, the k-quants'): each whole group of
// KR_PACK_ROWS rows, block after block, pack_block puts row r's block (file form, block_bytes) into
// the group's block (KR_PACK_ROWS * block_bytes); the rows past the last group are copied. Inline,
// so each layout's pack_block is inlined into it: the AVX2 k-quant matmul packs every 8 (16) rows
// of the file layout on the fly.
typedef void kr_pack_block(int32_t weight_type, const char *block, int r, char *group_block);
static inline void kr_pack_groups(int32_t weight_type, const void *src, void *dst, int64_t rows, int64_t cols,
                                  size_t block_bytes, kr_pack_block *pack_block) {
    const size_t row_bytes = kr_weight_row_bytes(weight_type, cols), group_block_bytes = KR_PACK_ROWS * block_bytes;
    const int64_t n_blocks = (int64_t)(row_bytes / block_bytes), grouped = rows - rows % KR_PACK_ROWS;
    const int64_t per_slice = kr_slice_blocks(weight_type, n_blocks);
    for (int64_t slice = 0; slice < n_blocks; slice += per_slice) {  // kr_slice_blocks: one slice unless the rows are long
        const int64_t length = kr_slice_length(n_blocks, per_slice, slice);
        for (int64_t first = 0; first < grouped; first += KR_PACK_ROWS) {
            const char *in = (const char *)src + (size_t)first * row_bytes + (size_t)slice * block_bytes;
            char *out = (char *)dst + ((size_t)grouped * (size_t)slice + (size_t)first * (size_t)length) * block_bytes;
            for (int64_t b = 0; b < length; b++)
                for (int r = 0; r < KR_PACK_ROWS; r++)
                    pack_block(weight_type, in + (size_t)r * row_bytes + (size_t)b * block_bytes, r,
                               out + (size_t)b * group_block_bytes);
        }
    }
    __builtin_memcpy((char *)dst + (size_t)grouped * row_bytes, (const char *)src + (size_t)grouped * row_bytes,
                     (size_t)(rows - grouped) * row_bytes);
}
// kr_matmul on a packed matrix (of all `rows`), bit for bit the same results; other types: kr_matmul.
void kr_matmul_packed(int32_t weight_type, const void *w, int64_t rows, int64_t cols, const void *prepared,
                      int64_t n_tokens, float *out, int64_t out_stride, int64_t row_begin, int64_t row_end);
void kr_matmul_packed_ref(int32_t weight_type, const void *w, int64_t rows, int64_t cols, const void *prepared,
                          int64_t n_tokens, float *out, int64_t out_stride, int64_t row_begin, int64_t row_end);
void kr_matmul_packed_avx2(int32_t weight_type, const void *w, int64_t rows, int64_t cols, const void *prepared,
                           int64_t n_tokens, float *out, int64_t out_stride, int64_t row_begin, int64_t row_end);
// ISA=avx512 (q8_avx512.c): q8_0, T <= 8 tokens over two packed groups (16 rows) in 512-bit lanes,
// with kr_packed_tile_avx2's arguments (tiles_avx2.h); kr_matmul_packed_avx2 hands it those tiles.
void kr_q8_0_pair_tile_avx512(int T, const char *w, size_t group_stride, const char *a, size_t a_stride,
                              int64_t n_blocks, float *out, int64_t out_stride, int keep_begin, int keep_end,
                              const char *next);
// KV cache q8_0 (model/layers.c): kr_axpy_rows also takes KR_Q8_0 rows (n a multiple of 32):
//   y[e] = fmaf(weights[i] * d, (float)q[e], y[e]) for each row i in order, d the f16 scale of
//   e's block. Heads up to KR_KV_Q8_MAX_HEAD_DIM values.
#define KR_KV_Q8_MAX_HEAD_DIM 1024
// --- end Packed weights

// --- k-quants (owner: kquant; kquant_ref.c, kquant_avx2.c, kquant_tile.h, kquant_avx512.c)
// ggml's q4_K, q5_K and q6_K weights: super-blocks of KR_QK_K = 256 weights, so a row's columns are
// a multiple of 256. Activations for them are q8_K (ggml's quantize_row_q8_K_ref: d = 1/iscale with
// iscale = -127/max, max the element of largest magnitude with its sign; q = round-half-even(x * iscale)
// at most 127; bsums[j] = the sum of q[16j..16j+15]).
// Per output, super-block after super-block, exact integer sums, then fixed float steps:
//   q4_K, q5_K: isum = sum_j sc[j] * sum_{e in sub-block j} q[e] * a[e]   (8 sub-blocks of 32)
//               msum = sum_j m[j] * (bsums[2j] + bsums[2j+1])
//               acc = fmaf(d_w * d_a, (float)isum, acc); acc = fmaf(-(dmin_w * d_a), (float)msum, acc)
//   q6_K:       isum = sum_j sc[j] * sum_{e in sub-block j} (q[e] - 32) * a[e]   (16 sub-blocks of 16)
//               acc = fmaf(d_w * d_a, (float)isum, acc)
// |isum|, |msum| < 2^31, so they are exact however a kernel adds them up.
#define KR_QK_K 256

typedef struct {
    kr_f16 d, dmin;        // super-block scales of the sub-block scales and of the mins
    uint8_t scales[12];    // 8 six-bit scales sc[j] and 8 six-bit mins m[j], ggml's packing
    uint8_t qs[128];       // byte 32c + l: weight 64c + l (low nibble), 64c + 32 + l (high nibble)
} kr_block_q4_K;           // weight e = d * sc[e/32] * q - dmin * m[e/32]

typedef struct {
    kr_f16 d, dmin;
    uint8_t scales[12];
    uint8_t qh[32];        // bit s of qh[l]: the fifth bit of weight 32s + l
    uint8_t qs[128];       // as q4_K
} kr_block_q5_K;

typedef struct {
    uint8_t ql[128];       // byte 64h + l (l < 64): low 4 bits of weight 128h + l (low nibble), 128h + 64 + l (high)
    uint8_t qh[64];        // byte 32h + l: bits 2p..2p+1 = high 2 bits of weight 128h + 32p + l
    int8_t scales[16];     // sub-blocks of 16
    kr_f16 d;
} kr_block_q6_K;           // weight e = d * scales[e/16] * (q - 32)

typedef struct kr_block_q8_K {
    float d;
    int8_t q[KR_QK_K];
    int16_t bsums[KR_QK_K / 16];
} kr_block_q8_K;

static_assert(sizeof(kr_block_q4_K) == 144, "q4_K block size");
static_assert(sizeof(kr_block_q5_K) == 176, "q5_K block size");
static_assert(sizeof(kr_block_q6_K) == 210, "q6_K block size");
static_assert(sizeof(kr_block_q8_K) == 292, "q8_K block size");

int kr_is_kquant(int32_t weight_type);  // q4_K, q5_K, q6_K
size_t kr_kquant_block_bytes(int32_t weight_type);
kr_quantize_q8_K_kernel kr_quantize_row_q8_K, kr_quantize_row_q8_K_ref, kr_quantize_row_q8_K_avx2;  // kr_quantizers' type
void kr_dequantize_row_kquant(int32_t weight_type, const void *row, float *out, int64_t n);
// One row's dot product against a prepared q8_K row, in the order above.
float kr_dot_kquant_ref(int32_t weight_type, const void *row, const kr_block_q8_K *a, int64_t cols);
// Packed k-quants: groups of 8 rows as for q4_0 (same size as the file layout), each super-block of
// a group laid out for 8 rows in the lanes (docs/kernels.md, "Packed k-quants").
void kr_pack_rows_kquant(int32_t weight_type, const void *src, void *dst, int64_t rows, int64_t cols);
void kr_packed_block_kquant(int32_t weight_type, const void *w, int64_t rows, int64_t cols, int64_t r, int64_t b,
                            void *block);  // kr_packed_block's share
void kr_matmul_packed_kquant_ref(int32_t weight_type, const void *w, int64_t rows, int64_t cols, const void *prepared,
                                 int64_t n_tokens, float *out, int64_t out_stride, int64_t row_begin, int64_t row_end);
// The tiles of kquant_tile.h: 8 rows in 256 bits (kquant_avx2.c) in an ISA=avx2 build, 16 rows in
// 512 bits (kquant_avx512.c) in an ISA=avx512 build.
void kr_matmul_kquant_avx2(int32_t weight_type, const void *w, int64_t cols, const void *prepared, int64_t n_tokens,
                           float *out, int64_t out_stride, int64_t row_begin, int64_t row_end);
void kr_matmul_packed_kquant_avx2(int32_t weight_type, const void *w, int64_t rows, int64_t cols, const void *prepared,
                                  int64_t n_tokens, float *out, int64_t out_stride, int64_t row_begin, int64_t row_end);
// ISA=avx512: kquant_tile.h with one group of 8 rows in 256 bits and VNNI sums (kquant_vnni256.c), the
// tiles the 16-row ones hand one-token matmuls to (KR_ONE_TOKEN_GROUPS says why).
void kr_matmul_kquant_vnni256(int32_t weight_type, const void *w, int64_t cols, const void *prepared, int64_t n_tokens,
                              float *out, int64_t out_stride, int64_t row_begin, int64_t row_end);
void kr_matmul_packed_kquant_vnni256(int32_t weight_type, const void *w, int64_t rows, int64_t cols, const void *prepared,
                                     int64_t n_tokens, float *out, int64_t out_stride, int64_t row_begin, int64_t row_end);
// --- end k-quants

#endif
