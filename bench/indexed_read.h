// indexed_read.h: a read of memory whose loads are all `vpxor (base,index)`, eight a 256-byte step
// into four accumulators, returned folded into one vector. On the Intel host of 7 Dec it streamed a
// fifth faster than the same loop as the compiler writes it, `vpxor (ptr)` (docs/kernels.md, "The
// read roofline's loop"), so it is stream_read.c's roofline loop and stream_tile.c's bare read.
// Assembly, since the compiler gives no way to ask for an address form; x86-64 with AVX2 only.
#ifndef KRAFLA_BENCH_INDEXED_READ_H
#define KRAFLA_BENCH_INDEXED_READ_H

#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

// The XOR, lane by lane, of the 32-byte vectors of `bytes` (a multiple of 256) at `base`.
static inline __m256i indexed_read(const uint8_t *base, size_t bytes) {
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    if (bytes) {
        size_t at = 0;
        __asm__ volatile(
            "1:\n\t"
            "vpxor (%[base],%[at]), %[a], %[a]\n\t"
            "vpxor 32(%[base],%[at]), %[b], %[b]\n\t"
            "vpxor 64(%[base],%[at]), %[c], %[c]\n\t"
            "vpxor 96(%[base],%[at]), %[d], %[d]\n\t"
            "vpxor 128(%[base],%[at]), %[a], %[a]\n\t"
            "vpxor 160(%[base],%[at]), %[b], %[b]\n\t"
            "vpxor 192(%[base],%[at]), %[c], %[c]\n\t"
            "vpxor 224(%[base],%[at]), %[d], %[d]\n\t"
            "add $256, %[at]\n\t"
            "cmp %[bytes], %[at]\n\t"
            "jb 1b"
            : [at] "+r"(at), [a] "+x"(a), [b] "+x"(b), [c] "+x"(c), [d] "+x"(d)
            : [base] "r"(base), [bytes] "r"(bytes)
            : "cc", "memory");
    }
    return _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
}

#endif
