// kquant_width256.h: the vectors of a k-quant tile (kquant_tile.h) of one group of 8 rows in 256
// bits, shared by kquant_avx2.c (maddubs sums) and kquant_vnni256.c (VNNI sums). Internal; the
// including file defines KR_INLINE first, then its sums (part_add, part_flush, scale_vector).
#ifndef KRAFLA_KERNELS_KQUANT_WIDTH256_H
#define KRAFLA_KERNELS_KQUANT_WIDTH256_H

#include <immintrin.h>
#include <stddef.h>

#define ROWS 8
typedef __m256i vec;
typedef __m256 vecf;
#define V(name) _mm256_##name
#define V_SI(name) _mm256_##name##_si256
KR_INLINE vec v_load(const char *p, size_t stride) { return _mm256_loadu_si256((const __m256i *)p); }
// The 32 bytes at p ANDed with mask. A file that defines KQ_INDEXED_LOADS (kquant_vnni256.c, the
// avx512 build's one-token tiles) gets it as indexed_load.h's `vpand (base,index)`: Qwen2.5-Coder-1.5B
// generated 3-4% faster with it there. AVX2's tiles (int16 sums, more instructions per byte) lost
// 1-3% with it and leave the address form to the compiler.
#ifdef KQ_INDEXED_LOADS
#include "kernels/indexed_load.h"
KR_INLINE vec v_and_load(const char *p, size_t stride, vec mask) { return kr_and_load_indexed(p, mask); }
#else
KR_INLINE vec v_and_load(const char *p, size_t stride, vec mask) { return _mm256_and_si256(v_load(p, stride), mask); }
#endif
KR_INLINE vec v_join(__m256i low, __m256i high) { return low; }
KR_INLINE vecf vf_half(const char *p, size_t stride) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

#endif
