// kernels.c: the dispatch names of kernels.h. An ISA=avx2 (or avx512) build calls the AVX2
// versions in kernels_avx2.c; an ISA=generic build calls the references in quant_ref.c. Then the
// kernels that take any weight type and run the dispatch conversions and quantizers: dequantizing
// a row and preparing activations.
#include "kernels/deltanet.h"
#include "kernels/kernels.h"
#include "kernels/legacy.h"
#include "kernels/lowbit.h"

#include <string.h>

#if defined(KR_HAVE_AVX2)
#define KR_KERNEL(name) name##_avx2
#else
#define KR_KERNEL(name) name##_ref
#endif

void kr_f16_to_f32_row(const kr_f16 *x, float *y, int64_t n) { KR_KERNEL(kr_f16_to_f32_row)(x, y, n); }
void kr_f32_to_f16_row(const float *x, kr_f16 *y, int64_t n) { KR_KERNEL(kr_f32_to_f16_row)(x, y, n); }

void kr_quantize_row_q8_0(const float *x, kr_block_q8_0 *y, int64_t n) { KR_KERNEL(kr_quantize_row_q8_0)(x, y, n); }
void kr_quantize_row_q8_sum(const float *x, kr_block_q8_sum *y, int64_t n) { KR_KERNEL(kr_quantize_row_q8_sum)(x, y, n); }
void kr_quantize_row_q8_K(const float *x, kr_block_q8_K *y, int64_t n) { KR_KERNEL(kr_quantize_row_q8_K)(x, y, n); }

void kr_matmul(int32_t weight_type, const void *w, int64_t cols, const void *prepared, int64_t n_tokens,
               float *out, int64_t out_stride, int64_t row_begin, int64_t row_end) {
    KR_KERNEL(kr_matmul)(weight_type, w, cols, prepared, n_tokens, out, out_stride, row_begin, row_end);
}

void kr_matmul_packed(int32_t weight_type, const void *w, int64_t rows, int64_t cols, const void *prepared,
                      int64_t n_tokens, float *out, int64_t out_stride, int64_t row_begin, int64_t row_end) {
    KR_KERNEL(kr_matmul_packed)(weight_type, w, rows, cols, prepared, n_tokens, out, out_stride, row_begin, row_end);
}

float kr_dot_f32(const float *a, const float *b, int64_t n) { return KR_KERNEL(kr_dot_f32)(a, b, n); }
float kr_dot_f16_f32(const kr_f16 *a, const float *b, int64_t n) { return KR_KERNEL(kr_dot_f16_f32)(a, b, n); }
void kr_axpy_f32(float a, const float *x, float *y, int64_t n) { KR_KERNEL(kr_axpy_f32)(a, x, y, n); }
void kr_axpy_f16_f32(float a, const kr_f16 *x, float *y, int64_t n) { KR_KERNEL(kr_axpy_f16_f32)(a, x, y, n); }
void kr_exp_f32(const float *x, float *y, int64_t n) { KR_KERNEL(kr_exp_f32)(x, y, n); }
float kr_exp_shift_sum_f32(float *x, int64_t n, float shift) { return KR_KERNEL(kr_exp_shift_sum_f32)(x, n, shift); }
int64_t kr_argmax_f32(const float *x, int64_t n) { return KR_KERNEL(kr_argmax_f32)(x, n); }
void kr_silu_mul_f32(float *gate, const float *up, int64_t n) { KR_KERNEL(kr_silu_mul_f32)(gate, up, n); }
void kr_gelu_tanh_mul_f32(float *gate, const float *up, int64_t n) { KR_KERNEL(kr_gelu_tanh_mul_f32)(gate, up, n); }
void kr_swiglu_oai_mul_f32(float *gate, const float *up, int64_t n, float alpha, float limit) {
    kr_swiglu_oai_mul_f32_ref(gate, up, n, alpha, limit);  // gpt-oss's experts only: no vector version yet
}
void kr_dot_rows(int32_t type, const void *rows, size_t row_stride, int64_t n_rows, const float *x, int64_t n, float *out) {
    KR_KERNEL(kr_dot_rows)(type, rows, row_stride, n_rows, x, n, out);
}
void kr_axpy_rows(int32_t type, const float *weights, const void *rows, size_t row_stride, int64_t n_rows, float *y,
                  int64_t n) {
    KR_KERNEL(kr_axpy_rows)(type, weights, rows, row_stride, n_rows, y, n);
}

// ---------------------------------------------------------------------------------------------
// Any weight type

void kr_dequantize_row(int32_t type, const void *row, float *out, int64_t n) {
    switch (type) {
    case KR_F32:
        memcpy(out, row, (size_t)n * sizeof(float));
        break;
    case KR_F16:
        kr_f16_to_f32_row(row, out, n);
        break;
    case KR_BF16: {
        const uint16_t *h = row;
        for (int64_t i = 0; i < n; i++) out[i] = kr_bf16_to_f32(h[i]);
        break;
    }
    case KR_Q8_0: {
        const kr_block_q8_0 *blocks = row;
        for (int64_t b = 0; b < n / KR_QK; b++) {
            const float d = kr_f16_to_f32(blocks[b].d);
            for (int j = 0; j < KR_QK; j++) out[b * KR_QK + j] = d * (float)blocks[b].q[j];
        }
        break;
    }
    case KR_Q4_0: {
        const kr_block_q4_0 *blocks = row;
        for (int64_t b = 0; b < n / KR_QK; b++) {
            const float d = kr_f16_to_f32(blocks[b].d);
            for (int j = 0; j < KR_QK / 2; j++) {
                out[b * KR_QK + j] = d * (float)((blocks[b].q[j] & 0x0f) - 8);
                out[b * KR_QK + j + KR_QK / 2] = d * (float)((blocks[b].q[j] >> 4) - 8);
            }
        }
        break;
    }
    case KR_Q4_1:
    case KR_Q5_0:
    case KR_Q5_1:
        kr_dequantize_legacy_row(type, row, out, n);
        break;
    case KR_Q4_K:
    case KR_Q5_K:
    case KR_Q6_K: kr_dequantize_row_kquant(type, row, out, n); break;
    case KR_Q2_K:
    case KR_Q3_K:
    case KR_IQ4_NL:
    case KR_IQ4_XS:
    case KR_MXFP4: kr_dequantize_row_lowbit(type, row, out, n); break;
    default:
        // kr_kernel_type_supported() is checked where a tensor's type enters; nothing to do here
        break;
    }
}

void kr_dequantize_packed_row(int32_t weight_type, const void *w, int64_t rows, int64_t cols, int64_t r, float *out) {
    if (!kr_packable(weight_type)) {
        kr_dequantize_row(weight_type, (const char *)w + (size_t)r * kr_weight_row_bytes(weight_type, cols), out, cols);
        return;
    }
    const int64_t block = kr_kernel_type_block(weight_type);
    for (int64_t b = 0; b < cols / block; b++) {
        _Alignas(16) char bytes[KR_MAX_BLOCK_BYTES];
        kr_packed_block(weight_type, w, rows, cols, r, b, bytes);
        kr_dequantize_row(weight_type, bytes, out + b * block, block);
    }
}

void kr_prepare_activations(int32_t weight_type, const float *x, int64_t cols, void *prepared,
                            int64_t token_begin, int64_t token_end) {
    static const kr_quantizers dispatch = {kr_quantize_row_q8_0, kr_quantize_row_q8_sum, kr_quantize_row_q8_K};
    kr_prepare_activations_with(weight_type, x, cols, prepared, token_begin, token_end, &dispatch);
}

void kr_prepare_columns(int32_t weight_type, const float *x, int64_t col_begin, int64_t col_end, void *prepared) {
    char *first = (char *)prepared + kr_activation_row_bytes(weight_type, col_begin);
    kr_prepare_activations(weight_type, x + col_begin, col_end - col_begin, first, 0, 1);
}

// Whether this CPU's hardware prefetchers alone stream q5_K, q6_K and q8_0 one-token tiles faster
// than the tiles' own fetches do (kernels.h, kr_stream_fetches): an Intel CPU. Read once, when the
// library is loaded, so the tiles only read a flag.
static bool prefetchers_suffice;

__attribute__((constructor)) static void detect_prefetchers(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    prefetchers_suffice = __builtin_cpu_is("intel");
#endif
}

bool kr_cpu_prefetchers_suffice(void) { return prefetchers_suffice; }

// Where this thread's last one-token matmuls stopped reading, the latest first (kernels.h,
// kr_stream_call): a gated job's runs read gate's rows, then up's, then gate's next ones.
#define STREAM_ENDS 4
static _Thread_local const void *stream_ends[STREAM_ENDS];

void kr_stream_call(const void *first, const void *end) {
    int i = 0;  // where `first` is in the list, or its last place
    while (i < STREAM_ENDS - 1 && stream_ends[i] != first) i++;
    if (stream_ends[i] != first) kr_stream_start(first, end);
    for (; i > 0; i--) stream_ends[i] = stream_ends[i - 1];
    stream_ends[0] = end;
}

// ---------------------------------------------------------------------------------------------
// Test entry points (krafla.h, "Kernels (tests)"): one kernel on caller buffers, arguments checked

#include "runtime/internal.h"

#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <time.h>

static int check_impl(int impl, kr_error *err) {
    if (impl == KR_KERNEL_DISPATCH || impl == KR_KERNEL_REFERENCE) return KR_OK;
    if (impl == KR_KERNEL_AVX2) {
#if defined(KR_HAVE_AVX2)
        return KR_OK;
#else
        return kr_fail(err, KR_ERR_UNSUPPORTED, "this library was built with ISA=%s: it has no AVX2 kernels", kr_isa());
#endif
    }
    return kr_fail(err, KR_ERR_ARGUMENT, "kernel implementation %d is not one of 0 (dispatch), 1 (reference), 2 (avx2)", impl);
}

static int check_count(const char *what, int64_t n, int64_t multiple, kr_error *err) {
    if (n < 0) return kr_fail(err, KR_ERR_ARGUMENT, "%s must be >= 0, got %lld", what, (long long)n);
    if (n % multiple) return kr_fail(err, KR_ERR_ARGUMENT, "%s must be a multiple of %lld, got %lld", what, (long long)multiple, (long long)n);
    return KR_OK;
}

static int check_pointers(const void *a, const void *b, kr_error *err) {
    if (!a || !b) return kr_fail(err, KR_ERR_ARGUMENT, "a buffer is NULL");
    return KR_OK;
}

// The checks of a kernel over n values (a multiple of `multiple`) from x into y.
static int check_row_kernel(int impl, int64_t n, int64_t multiple, const void *x, const void *y, kr_error *err) {
    int status = check_impl(impl, err);
    if (!status) status = check_count("n", n, multiple, err);
    if (!status) status = check_pointers(x, y, err);
    return status;
}

// Each kernel under each implementation; AVX2 names only exist in an avx2 build.
#if defined(KR_HAVE_AVX2)
#define KR_PICK(impl, name) ((impl) == KR_KERNEL_REFERENCE ? name##_ref : (impl) == KR_KERNEL_AVX2 ? name##_avx2 : name)
#else
#define KR_PICK(impl, name) ((impl) == KR_KERNEL_REFERENCE ? name##_ref : name)
#endif

int kr_test_f16_to_f32(int impl, const uint16_t *x, float *y, int64_t n, kr_error *err) {
    const int status = check_row_kernel(impl, n, 1, x, y, err);
    if (status) return status;
    if (impl == KR_KERNEL_DISPATCH) {
        for (int64_t i = 0; i < n; i++) y[i] = kr_f16_to_f32(x[i]);
    } else {
        KR_PICK(impl, kr_f16_to_f32_row)(x, y, n);
    }
    kr_ok(err);
    return KR_OK;
}

int kr_test_f32_to_f16(int impl, const float *x, uint16_t *y, int64_t n, kr_error *err) {
    const int status = check_row_kernel(impl, n, 1, x, y, err);
    if (status) return status;
    if (impl == KR_KERNEL_DISPATCH) {
        for (int64_t i = 0; i < n; i++) y[i] = kr_f32_to_f16(x[i]);
    } else {
        KR_PICK(impl, kr_f32_to_f16_row)(x, y, n);
    }
    kr_ok(err);
    return KR_OK;
}

int kr_test_quantize_q8_0(int impl, const float *x, void *blocks, int64_t n, kr_error *err) {
    const int status = check_row_kernel(impl, n, KR_QK, x, blocks, err);
    if (status) return status;
    KR_PICK(impl, kr_quantize_row_q8_0)(x, blocks, n);
    kr_ok(err);
    return KR_OK;
}

static int check_weight_type(int32_t type, int64_t cols, kr_error *err) {
    if (!kr_kernel_type_supported(type))
        return kr_fail(err, KR_ERR_ARGUMENT,
                       "weight type %d (%s) has no kernels; expected f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_K, q5_K, q6_K, "
                       "q2_K, q3_K, iq4_nl, iq4_xs or mxfp4",
                       type, kr_type_name(type) ? kr_type_name(type) : "unknown");
    return check_count("cols", cols, kr_kernel_type_block(type), err);
}

static int check_packable(int32_t type, kr_error *err) {
    if (kr_packable(type)) return KR_OK;
    return kr_fail(err, KR_ERR_ARGUMENT, "only q8_0, q4_0, q4_1, q5_0, q5_1, q4_K, q5_K, q6_K, iq4_nl and mxfp4 weights are packed, not type %d",
                   type);
}

// n floats (a multiple of 256) -> n/256 q8_K blocks (kr_block_q8_K, 292 bytes).
int kr_test_quantize_q8_K(int impl, const float *x, void *blocks, int64_t n, kr_error *err) {
    const int status = check_row_kernel(impl, n, KR_QK_K, x, blocks, err);
    if (status) return status;
    KR_PICK(impl, kr_quantize_row_q8_K)(x, blocks, n);
    kr_ok(err);
    return KR_OK;
}

int kr_test_dequantize(int32_t type, const void *row, float *out, int64_t n, kr_error *err) {
    int status = check_weight_type(type, n, err);
    if (!status) status = check_pointers(row, out, err);
    if (status) return status;
    kr_dequantize_row(type, row, out, n);
    kr_ok(err);
    return KR_OK;
}

// The body of kr_test_matmul and kr_test_matmul_packed: check, prepare x, one matmul of the rows.
static int test_matmul(int impl, bool packed, int32_t weight_type, const void *weights, int64_t rows, int64_t cols,
                       const float *x, int64_t n_tokens, float *out, int64_t row_begin, int64_t row_end, kr_error *err) {
    int status = check_impl(impl, err);
    if (!status) status = check_weight_type(weight_type, cols, err);
    if (!status) status = check_count("rows", rows, 1, err);
    if (!status) status = check_count("n_tokens", n_tokens, 1, err);
    if (!status) status = check_pointers(weights, x, err);
    if (!status) status = check_pointers(out, out, err);
    if (status) return status;
    if (row_begin < 0 || row_begin > row_end || row_end > rows)
        return kr_fail(err, KR_ERR_ARGUMENT, "row range [%lld, %lld) is not inside [0, %lld)", (long long)row_begin,
                       (long long)row_end, (long long)rows);
    const size_t bytes = kr_activation_bytes(weight_type, n_tokens, cols);
    void *prepared = malloc(bytes ? bytes : 1);
    if (!prepared) return kr_fail(err, KR_ERR_MEMORY, "cannot allocate %zu bytes of prepared activations", bytes);
    const kr_quantizers quantize = {KR_PICK(impl, kr_quantize_row_q8_0), KR_PICK(impl, kr_quantize_row_q8_sum),
                                    KR_PICK(impl, kr_quantize_row_q8_K)};
    kr_prepare_activations_with(weight_type, x, cols, prepared, 0, n_tokens, &quantize);
    if (packed)
        KR_PICK(impl, kr_matmul_packed)(weight_type, weights, rows, cols, prepared, n_tokens, out, rows, row_begin,
                                        row_end);
    else
        KR_PICK(impl, kr_matmul)(weight_type, weights, cols, prepared, n_tokens, out, rows, row_begin, row_end);
    free(prepared);
    kr_ok(err);
    return KR_OK;
}

int kr_test_matmul(int impl, int32_t weight_type, const void *weights, int64_t rows, int64_t cols, const float *x,
                   int64_t n_tokens, float *out, int64_t row_begin, int64_t row_end, kr_error *err) {
    return test_matmul(impl, false, weight_type, weights, rows, cols, x, n_tokens, out, row_begin, row_end, err);
}

// --- Packed weights (tests; owner: speed)
int kr_test_pack(int32_t weight_type, const void *weights, int64_t rows, int64_t cols, void *packed, kr_error *err) {
    int status = check_weight_type(weight_type, cols, err);
    if (!status) status = check_count("rows", rows, 1, err);
    if (!status) status = check_pointers(weights, packed, err);
    if (!status) status = check_packable(weight_type, err);
    if (status) return status;
    kr_pack_rows(weight_type, weights, packed, rows, cols);
    kr_ok(err);
    return KR_OK;
}

int kr_test_matmul_packed(int impl, int32_t weight_type, const void *packed, int64_t rows, int64_t cols, const float *x,
                          int64_t n_tokens, float *out, int64_t row_begin, int64_t row_end, kr_error *err) {
    return test_matmul(impl, true, weight_type, packed, rows, cols, x, n_tokens, out, row_begin, row_end, err);
}

int kr_test_dequantize_packed(int32_t weight_type, const void *packed, int64_t rows, int64_t cols, int64_t row, float *out,
                              kr_error *err) {
    int status = check_weight_type(weight_type, cols, err);
    if (!status) status = check_count("rows", rows, 1, err);
    if (!status && (row < 0 || row >= rows)) status = kr_fail(err, KR_ERR_ARGUMENT, "row %lld is not one of 0..%lld", (long long)row, (long long)rows - 1);
    if (!status) status = check_pointers(packed, out, err);
    if (!status) status = check_packable(weight_type, err);
    if (status) return status;
    kr_dequantize_packed_row(weight_type, packed, rows, cols, row, out);
    kr_ok(err);
    return KR_OK;
}
// --- end Packed weights (tests)

static int check_vector_type(int32_t type, kr_error *err) {
    if (type != KR_F32 && type != KR_F16)
        return kr_fail(err, KR_ERR_ARGUMENT, "vector kernels take f32 or f16 (types %d, %d), got %d", KR_F32, KR_F16, type);
    return KR_OK;
}

int kr_test_dot(int impl, int32_t type, const void *a, const float *b, int64_t n, float *result, kr_error *err) {
    int status = check_impl(impl, err);
    if (!status) status = check_vector_type(type, err);
    if (!status) status = check_count("n", n, 1, err);
    if (!status) status = check_pointers(a, b, err);
    if (!status) status = check_pointers(result, result, err);
    if (status) return status;
    *result = type == KR_F32 ? KR_PICK(impl, kr_dot_f32)(a, b, n) : KR_PICK(impl, kr_dot_f16_f32)(a, b, n);
    kr_ok(err);
    return KR_OK;
}

int kr_test_axpy(int impl, int32_t type, float alpha, const void *x, float *y, int64_t n, kr_error *err) {
    int status = check_impl(impl, err);
    if (!status) status = check_vector_type(type, err);
    if (!status) status = check_count("n", n, 1, err);
    if (!status) status = check_pointers(x, y, err);
    if (status) return status;
    if (type == KR_F32)
        KR_PICK(impl, kr_axpy_f32)(alpha, x, y, n);
    else
        KR_PICK(impl, kr_axpy_f16_f32)(alpha, x, y, n);
    kr_ok(err);
    return KR_OK;
}

int kr_bench_matmul(int impl, int32_t weight_type, const void *weights, int32_t packed, int64_t rows, int64_t cols,
                    const float *x, int64_t n_tokens, int32_t repeat, double *best_seconds, kr_error *err) {
    int status = check_impl(impl, err);
    if (!status) status = check_weight_type(weight_type, cols, err);
    if (!status) status = check_count("rows", rows, 1, err);
    if (!status) status = check_count("n_tokens", n_tokens, 1, err);
    if (!status) status = check_pointers(weights, x, err);
    if (!status) status = check_pointers(best_seconds, best_seconds, err);
    if (!status && repeat < 1) status = kr_fail(err, KR_ERR_ARGUMENT, "repeat must be >= 1, got %d", repeat);
    if (!status && packed) status = check_packable(weight_type, err);
    if (status) return status;
    uint64_t out_count;
    if (kr_mul_overflows((uint64_t)rows, (uint64_t)n_tokens, &out_count))
        return kr_fail(err, KR_ERR_MEMORY, "%lld x %lld outputs overflow", (long long)rows, (long long)n_tokens);
    const size_t bytes = kr_activation_bytes(weight_type, n_tokens, cols);
    void *prepared = malloc(bytes ? bytes : 1);
    float *out = malloc(out_count ? out_count * sizeof(float) : 1);
    if (!prepared || !out) {
        free(prepared);
        free(out);
        return kr_fail(err, KR_ERR_MEMORY, "cannot allocate the benchmark's buffers");
    }
    const kr_quantizers quantize = {KR_PICK(impl, kr_quantize_row_q8_0), KR_PICK(impl, kr_quantize_row_q8_sum),
                                    KR_PICK(impl, kr_quantize_row_q8_K)};
    double best = INFINITY;
    for (int32_t i = 0; i < repeat; i++) {
        struct timespec start, end;
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &start);
        kr_prepare_activations_with(weight_type, x, cols, prepared, 0, n_tokens, &quantize);
        if (packed)
            KR_PICK(impl, kr_matmul_packed)(weight_type, weights, rows, cols, prepared, n_tokens, out, rows, 0, rows);
        else
            KR_PICK(impl, kr_matmul)(weight_type, weights, cols, prepared, n_tokens, out, rows, 0, rows);
        clock_gettime(CLOCK_THREAD_CPUTIME_ID, &end);
        const double seconds = (double)(end.tv_sec - start.tv_sec) + 1e-9 * (double)(end.tv_nsec - start.tv_nsec);
        best = seconds < best ? seconds : best;
    }
    free(prepared);
    free(out);
    *best_seconds = best;
    kr_ok(err);
    return KR_OK;
}

int kr_test_dot_rows(int impl, int32_t type, const void *rows, int64_t row_stride, int64_t n_rows, const float *x,
                     int64_t n, float *out, kr_error *err) {
    int status = check_impl(impl, err);
    if (!status) status = check_vector_type(type, err);
    if (!status) status = check_count("n", n, 1, err);
    if (!status) status = check_count("n_rows", n_rows, 1, err);
    if (!status) status = check_pointers(rows, x, err);
    if (!status) status = check_pointers(out, out, err);
    if (!status && n_rows > 0 && row_stride < n * (type == KR_F32 ? 4 : 2))
        status = kr_fail(err, KR_ERR_ARGUMENT, "row stride %lld bytes is shorter than a row of %lld values",
                         (long long)row_stride, (long long)n);
    if (status) return status;
    KR_PICK(impl, kr_dot_rows)(type, rows, (size_t)row_stride, n_rows, x, n, out);
    kr_ok(err);
    return KR_OK;
}

int kr_test_axpy_rows(int impl, int32_t type, const float *weights, const void *rows, int64_t row_stride, int64_t n_rows,
                      float *y, int64_t n, kr_error *err) {
    int status = check_impl(impl, err);
    const int q8 = type == KR_Q8_0;  // KV cache q8_0 rows (owner: speed): whole blocks of 32
    if (!status && !q8) status = check_vector_type(type, err);
    if (!status && q8 && n % KR_QK)
        status = kr_fail(err, KR_ERR_ARGUMENT, "q8_0 rows hold whole blocks of %d values, not %lld", KR_QK, (long long)n);
    if (!status) status = check_count("n", n, 1, err);
    if (!status) status = check_count("n_rows", n_rows, 1, err);
    if (!status) status = check_pointers(rows, y, err);
    if (!status) status = check_pointers(weights, weights, err);
    if (!status && n_rows > 0 && row_stride < (q8 ? n / KR_QK * 34 : n * (type == KR_F32 ? 4 : 2)))
        status = kr_fail(err, KR_ERR_ARGUMENT, "row stride %lld bytes is shorter than a row of %lld values",
                         (long long)row_stride, (long long)n);
    if (status) return status;
    KR_PICK(impl, kr_axpy_rows)(type, weights, rows, (size_t)row_stride, n_rows, y, n);
    kr_ok(err);
    return KR_OK;
}

// which: 0 exp (y = exp(x)), 1 exp_shift_sum (x in place, *sum), 2 silu_mul, 3 gelu_tanh_mul (x = gate in place, y = up)
int kr_test_elementwise(int impl, int32_t which, float *x, float *y, int64_t n, float shift, float *sum, kr_error *err) {
    const int status = check_row_kernel(impl, n, 1, x, which == 1 ? (const void *)sum : (const void *)y, err);
    if (status) return status;
    switch (which) {
    case 0: KR_PICK(impl, kr_exp_f32)(x, y, n); break;
    case 1: *sum = KR_PICK(impl, kr_exp_shift_sum_f32)(x, n, shift); break;
    case 2: KR_PICK(impl, kr_silu_mul_f32)(x, y, n); break;
    case 3: KR_PICK(impl, kr_gelu_tanh_mul_f32)(x, y, n); break;
    default: return kr_fail(err, KR_ERR_ARGUMENT, "element-wise kernel %d is not one of 0 (exp), 1 (exp_shift_sum), 2 (silu_mul), 3 (gelu_tanh_mul)", which);
    }
    kr_ok(err);
    return KR_OK;
}

int kr_test_delta_rule(int impl, float *state, int64_t dk, int64_t dv, const float *q, const float *k, const float *v,
                       float beta, float decay, float *out, kr_error *err) {
    int status = check_impl(impl, err);
    if (!status) status = check_count("dk", dk, 1, err);
    if (!status) status = check_count("dv", dv, 1, err);
    if (!status) status = check_pointers(state, out, err);
    if (!status) status = check_pointers(q, k, err);
    if (!status) status = check_pointers(v, v, err);
    if (status) return status;
    KR_PICK(impl, kr_delta_rule_f32)(state, dk, dv, q, k, v, beta, decay, out);
    kr_ok(err);
    return KR_OK;
}
