// activations.c: prepared activations (kernels.h): what a matmul against weights of a type reads,
// its size, and the preparation with chosen quantizers (kernels.c's kr_prepare_activations passes
// the dispatch ones).
#include "kernels/kernels.h"

#include <string.h>

typedef enum { ACTIVATIONS_F32, ACTIVATIONS_Q8_0, ACTIVATIONS_Q8_SUM, ACTIVATIONS_Q8_K } activation_kind;

// q4_0 and its family (legacy.h), iq4_nl and mxfp4 take the same prepared blocks; the k-quants and
// iq4_xs q8_K; float weights, and types without kernels, the f32 rows.
static activation_kind activations_of(int32_t weight_type) {
    switch (weight_type) {
    case KR_Q8_0: return ACTIVATIONS_Q8_0;
    case KR_Q4_0:
    case KR_Q4_1:
    case KR_Q5_0:
    case KR_Q5_1:
    case KR_IQ4_NL:
    case KR_MXFP4: return ACTIVATIONS_Q8_SUM;
    case KR_Q4_K:
    case KR_Q5_K:
    case KR_Q6_K:
    case KR_Q2_K:
    case KR_Q3_K:
    case KR_IQ4_XS: return ACTIVATIONS_Q8_K;
    default: return ACTIVATIONS_F32;
    }
}

size_t kr_activation_row_bytes(int32_t weight_type, int64_t cols) {
    switch (activations_of(weight_type)) {
    case ACTIVATIONS_Q8_0: return (size_t)(cols / KR_QK) * sizeof(kr_block_q8_0);
    case ACTIVATIONS_Q8_SUM: return (size_t)(cols / KR_QK) * sizeof(kr_block_q8_sum);
    case ACTIVATIONS_Q8_K: return (size_t)(cols / KR_QK_K) * sizeof(kr_block_q8_K);
    default: return (size_t)cols * sizeof(float);
    }
}

int64_t kr_activation_block(int32_t weight_type) {
    switch (activations_of(weight_type)) {
    case ACTIVATIONS_Q8_0:
    case ACTIVATIONS_Q8_SUM: return KR_QK;
    case ACTIVATIONS_Q8_K: return KR_QK_K;
    default: return 1;
    }
}

size_t kr_activation_bytes(int32_t weight_type, int64_t n_tokens, int64_t cols) {
    return (size_t)n_tokens * kr_activation_row_bytes(weight_type, cols);
}

void kr_prepare_activations_with(int32_t weight_type, const float *x, int64_t cols, void *prepared,
                                 int64_t token_begin, int64_t token_end, const kr_quantizers *quantize) {
    const size_t row_bytes = kr_activation_row_bytes(weight_type, cols);
    const activation_kind kind = activations_of(weight_type);
    for (int64_t t = token_begin; t < token_end; t++) {
        char *dst = (char *)prepared + (size_t)t * row_bytes;
        switch (kind) {
        case ACTIVATIONS_Q8_0: quantize->q8_0(x + t * cols, (kr_block_q8_0 *)dst, cols); break;
        case ACTIVATIONS_Q8_SUM: quantize->q8_sum(x + t * cols, (kr_block_q8_sum *)dst, cols); break;
        case ACTIVATIONS_Q8_K: quantize->q8_K(x + t * cols, (kr_block_q8_K *)dst, cols); break;
        default: memcpy(dst, x + t * cols, row_bytes); break;
        }
    }
}
