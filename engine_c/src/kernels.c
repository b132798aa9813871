// kernels.c: the dispatch names of kernels.h. An ISA=avx2 (or avx512) build calls the AVX2
// versions in kernels_avx2.c; an ISA=generic build calls the references in quant_ref.c.
#include "kernels.h"

#if defined(KR_HAVE_AVX2)
#include <immintrin.h>
#define KR_KERNEL(name) name##_avx2
#else
#define KR_KERNEL(name) name##_ref
#endif

float kr_f16_to_f32(kr_f16 h) {
#if defined(KR_HAVE_AVX2)
    return _cvtsh_ss(h);
#else
    return kr_f16_to_f32_ref(h);
#endif
}

kr_f16 kr_f32_to_f16(float f) {
#if defined(KR_HAVE_AVX2)
    return (kr_f16)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
    return kr_f32_to_f16_ref(f);
#endif
}

void kr_f16_to_f32_row(const kr_f16 *x, float *y, int64_t n) { KR_KERNEL(kr_f16_to_f32_row)(x, y, n); }
void kr_f32_to_f16_row(const float *x, kr_f16 *y, int64_t n) { KR_KERNEL(kr_f32_to_f16_row)(x, y, n); }

void kr_quantize_row_q8_0(const float *x, kr_block_q8_0 *y, int64_t n) { KR_KERNEL(kr_quantize_row_q8_0)(x, y, n); }

void kr_matmul(int32_t weight_type, const void *w, int64_t cols, const void *prepared, int64_t n_tokens,
               float *out, int64_t out_stride, int64_t row_begin, int64_t row_end) {
    KR_KERNEL(kr_matmul)(weight_type, w, cols, prepared, n_tokens, out, out_stride, row_begin, row_end);
}

float kr_dot_f32(const float *a, const float *b, int64_t n) { return KR_KERNEL(kr_dot_f32)(a, b, n); }
float kr_dot_f16_f32(const kr_f16 *a, const float *b, int64_t n) { return KR_KERNEL(kr_dot_f16_f32)(a, b, n); }
void kr_axpy_f32(float a, const float *x, float *y, int64_t n) { KR_KERNEL(kr_axpy_f32)(a, x, y, n); }
void kr_axpy_f16_f32(float a, const kr_f16 *x, float *y, int64_t n) { KR_KERNEL(kr_axpy_f16_f32)(a, x, y, n); }
