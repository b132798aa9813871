// types.h: the tensor types (krafla.h's kr_type) in one table: each type's name, its block (how
// many elements, how many bytes) and which kernels take it. Internal to the library.
#ifndef KRAFLA_TYPES_H
#define KRAFLA_TYPES_H

#include "krafla.h"

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *name;      // kr_type_name
    uint32_t block;        // elements per block: 1 (f32, f16, bf16, i32, u8), 32, 256 (the k-quants)
    uint16_t block_bytes;
    bool kernels;          // kr_matmul and kr_dequantize_row take it as weights
    bool packable;         // kr_pack_rows packs it (kernels.h, "Packed weights")
} kr_type_traits;

// Indexed by kr_type. Hidden: not exported from the library, and read without a GOT load.
extern const kr_type_traits kr_types[KR_TYPE_COUNT] __attribute__((visibility("hidden")));

// The weight types the kernels take (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, the k-quants and
// the low-bit q2_K, q3_K, iq4_nl, iq4_xs, mxfp4):
// check a tensor's type with this where it enters; the kernels themselves do not check.
int kr_kernel_type_supported(int32_t type);
// Weights per block of such a type (1 for f32, f16, bf16; 32; 256 for the k-quants and iq4_xs): a row's
// columns are a multiple of it. 0 for other types.
int64_t kr_kernel_type_block(int32_t type);
// Bytes of one weight row of `cols` (a multiple of the type's block), 0 for other types.
size_t kr_weight_row_bytes(int32_t type, int64_t cols);
// q4_0, q8_0, q4_1, q5_0, q5_1 (legacy.h's layout) and q4_K, q5_K, q6_K (not the low-bit types).
int kr_packable(int32_t weight_type);

#endif
