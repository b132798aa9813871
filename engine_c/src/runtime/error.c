// error.c: filling kr_error, and the library's identity.
#include "runtime/internal.h"

#include <stdio.h>
#include <string.h>

int kr_fail(kr_error *err, int status, const char *fmt, ...) {
    if (err) {
        va_list args;
        va_start(args, fmt);
        vsnprintf(err->message, sizeof err->message, fmt, args);
        va_end(args);
        err->status = status;
    }
    return status;
}

void kr_ok(kr_error *err) {
    if (err) {
        err->status = KR_OK;
        err->message[0] = '\0';
    }
}

const char *kr_version(void) { return KR_VERSION; }

const char *kr_isa(void) {
#if defined(KR_HAVE_AVX512)
    return "avx512";
#elif defined(KR_HAVE_AVX2)
    return "avx2";
#else
    return "generic";
#endif
}
