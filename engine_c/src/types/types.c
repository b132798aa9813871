// types.c: the table of types.h, and what is looked up in it.
#include "types/types.h"
#include "runtime/internal.h"

// name, elements and bytes per block, kernels, packable
const kr_type_traits kr_types[KR_TYPE_COUNT] = {
    [KR_F32] = {"f32", 1, 4, true, false},
    [KR_F16] = {"f16", 1, 2, true, false},
    [KR_BF16] = {"bf16", 1, 2, true, false},
    [KR_Q8_0] = {"q8_0", 32, 34, true, true},
    [KR_Q4_0] = {"q4_0", 32, 18, true, true},
    [KR_I32] = {"i32", 1, 4, false, false},
    [KR_U8] = {"u8", 1, 1, false, false},
    [KR_Q4_1] = {"q4_1", 32, 20, true, true},
    [KR_Q5_0] = {"q5_0", 32, 22, true, true},
    [KR_Q5_1] = {"q5_1", 32, 24, true, true},
    [KR_Q4_K] = {"q4_K", 256, 144, true, true},
    [KR_Q5_K] = {"q5_K", 256, 176, true, true},
    [KR_Q6_K] = {"q6_K", 256, 210, true, true},
    [KR_Q2_K] = {"q2_K", 256, 84, true, false},
    [KR_Q3_K] = {"q3_K", 256, 110, true, false},
    [KR_IQ4_NL] = {"iq4_nl", 32, 18, true, true},
    [KR_IQ4_XS] = {"iq4_xs", 256, 136, true, false},
    [KR_MXFP4] = {"mxfp4", 32, 17, true, true},
};

uint64_t kr_type_size(int32_t type, uint64_t n_elements) {
    if (type < 0 || type >= KR_TYPE_COUNT || n_elements % kr_types[type].block) return 0;
    uint64_t bytes;
    if (kr_mul_overflows(n_elements / kr_types[type].block, kr_types[type].block_bytes, &bytes)) return 0;
    return bytes;
}

const char *kr_type_name(int32_t type) {
    return type >= 0 && type < KR_TYPE_COUNT ? kr_types[type].name : "unknown";
}

int64_t kr_kernel_type_block(int32_t type) {
    return type >= 0 && type < KR_TYPE_COUNT && kr_types[type].kernels ? kr_types[type].block : 0;
}

int kr_kernel_type_supported(int32_t type) { return kr_kernel_type_block(type) != 0; }

size_t kr_weight_row_bytes(int32_t type, int64_t cols) {
    const int64_t block = kr_kernel_type_block(type);
    return block ? (size_t)(cols / block) * kr_types[type].block_bytes : 0;
}

int kr_packable(int32_t weight_type) { return kr_kernel_type_supported(weight_type) && kr_types[weight_type].packable; }

// The public name of kr_kernel_type_supported, which takes any integer.
int kr_weight_type_supported(int32_t type) { return kr_kernel_type_supported(type); }
