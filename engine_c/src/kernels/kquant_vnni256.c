// kquant_vnni256.c: the ISA=avx512 build's one-token k-quant tiles (kernels.h, "k-quants"):
// kquant_tile.h with one group of 8 rows in 256 bits, as kquant_avx2.c's, but with VNNI's int32
// sums as kquant_avx512.c's. The 16-row tiles hand them every one-token matmul (KQ_ONE_TOKEN):
// generation is bound by memory, and one group after the other reads a matrix as one stream,
// where the 16-row tiles read two (a group and the next, a group's bytes apart). Every lane goes
// through kquant_ref.c's per-super-block sequence, so the bits are those of every other build.
#include "kernels/kernels.h"
#include "krafla.h"

#if defined(KR_HAVE_AVX512)
#include <immintrin.h>

#define KR_INLINE static inline __attribute__((always_inline))

#define KQ_INDEXED_LOADS 1  // the weights through base+index loads (kquant_width256.h, v_and_load)
#include "kernels/kquant_width256.h"
KR_INLINE vec part_add(vec part, vec u, vec s) { return _mm256_dpbusd_epi32(part, u, s); }
KR_INLINE vec part_flush(vec isum, vec part, vec scale) { return _mm256_add_epi32(isum, _mm256_mullo_epi32(part, scale)); }
// The scales of one sub-block: 8 bytes at `low`, as int32 lanes.
KR_INLINE vec scale_vector(const char *low, const char *high, const int is_signed) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)low);
    return is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
}
#define Q5_FLUSH 8
#define Q6_FLUSH 4
#define KQ_WIDE_PARTS 1
#define KR_KQUANT_TOKENS 4  // unused: these tiles only get one-token matmuls
#define KQ_NAME(name) name##_vnni256

#include "kernels/kquant_tile.h"

#else
typedef int kr_kquant_vnni256_not_built;  // ISA=generic and ISA=avx2: this file is empty
#endif
