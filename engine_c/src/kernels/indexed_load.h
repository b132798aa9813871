// indexed_load.h: 32 bytes of weights ANDed with a mask in one `vpand (base,index)`, the index a
// register that holds 0, for the one-token tiles of the ISA=avx512 build (kquant_width256.h's
// v_and_load, legacy_avx2.c's packed_quants). The compiler addresses weights through a pointer it
// steps (`vpand (ptr)`); on the Intel host of 7 Dec the indexed form of the same load made cold
// one-token matrices stream 3-17% faster (docs/kernels.md, "Indexed loads in the one-token tiles"),
// as it makes a bare read a fifth faster (bench/stream_read.c). GCC has no way to ask for an
// address form, hence the inline assembly; only the form differs: the same bytes, the same AND.
// Internal; only included where KR_HAVE_AVX2 is defined.
#ifndef KRAFLA_KERNELS_INDEXED_LOAD_H
#define KRAFLA_KERNELS_INDEXED_LOAD_H

#include <immintrin.h>
#include <stddef.h>

static inline __attribute__((always_inline)) __m256i kr_and_load_indexed(const char *p, __m256i mask) {
    size_t index;
    __asm__("xor %k0, %k0" : "=r"(index));
    __m256i out;
    __asm__("vpand (%1,%2), %3, %0" : "=x"(out) : "r"(p), "r"(index), "x"(mask), "m"(*(const char(*)[32])p));
    return out;
}

#endif
