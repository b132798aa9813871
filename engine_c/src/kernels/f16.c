// f16.c: f16 and bf16 to f32 and back (kernels.h; IEEE binary16, round to nearest even, NaNs
// quieted as F16C does): the references (suffix _ref), which define the bits, and the scalar
// dispatch names, F16C in an ISA=avx2 (or avx512) build. The AVX2 row conversions are
// kernels_avx2.c's, the rows' dispatch names kernels.c's.
#include "kernels/kernels.h"

#if defined(KR_HAVE_AVX2)
#include <immintrin.h>
#endif

float kr_f16_to_f32_ref(kr_f16 h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0x1f) {
        // inf, or NaN with the quiet bit set and the payload kept
        return kr_bits_float(sign | 0x7f800000u | (mantissa ? (0x400000u | (mantissa << 13)) : 0));
    }
    if (exponent == 0) {
        if (mantissa == 0) return kr_bits_float(sign);
        // subnormal: mantissa * 2^-24, normalised into a float
        exponent = 113;
        while (!(mantissa & 0x400u)) {
            mantissa <<= 1;
            exponent--;
        }
        return kr_bits_float(sign | (exponent << 23) | ((mantissa & 0x3ffu) << 13));
    }
    return kr_bits_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

kr_f16 kr_f32_to_f16_ref(float f) {
    uint32_t x = kr_float_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t magnitude = x & 0x7fffffffu;
    if (magnitude > 0x7f800000u) return (kr_f16)(sign | 0x7e00u | ((magnitude >> 13) & 0x3ffu));
    if (magnitude >= 0x477ff000u) return (kr_f16)(sign | 0x7c00u);  // >= 65520 rounds to inf
    uint32_t exponent = magnitude >> 23;
    if (exponent < 113) {
        // result is subnormal (or rounds up to the smallest normal): round(value * 2^24)
        if (exponent < 102) return (kr_f16)sign;  // below 2^-25: rounds to zero
        uint32_t mantissa = (magnitude & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126 - exponent;  // 14..24
        uint32_t q = mantissa >> shift;
        uint32_t rest = mantissa & ((1u << shift) - 1);
        uint32_t half = 1u << (shift - 1);
        if (rest > half || (rest == half && (q & 1))) q++;
        return (kr_f16)(sign | q);
    }
    // normal: rebias the exponent, round the 13 dropped mantissa bits (a carry may bump the
    // exponent, which is the right result)
    uint32_t value = ((exponent - 112) << 10) | ((magnitude >> 13) & 0x3ffu);
    uint32_t rest = magnitude & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (value & 1))) value++;
    return (kr_f16)(sign | value);
}

float kr_bf16_to_f32(uint16_t h) { return kr_bits_float((uint32_t)h << 16); }

void kr_f16_to_f32_row_ref(const kr_f16 *x, float *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = kr_f16_to_f32_ref(x[i]);
}

void kr_f32_to_f16_row_ref(const float *x, kr_f16 *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = kr_f32_to_f16_ref(x[i]);
}

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
