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
KR_INLINE vec v_join(__m256i low, __m256i high) { return low; }
KR_INLINE vecf vf_half(const char *p, size_t stride) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

#endif
