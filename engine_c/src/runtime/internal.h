// internal.h: helpers shared by the engine's source files; not part of the API.
#ifndef KRAFLA_INTERNAL_H
#define KRAFLA_INTERNAL_H

#include "krafla.h"

#include <stdarg.h>
#include <stdbool.h>

#define KR_VERSION "0.7.0"

// Fill err (if not NULL) with a status and a printf-style message; returns the status.
int kr_fail(kr_error *err, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
// Mark err as success.
void kr_ok(kr_error *err);

// a * b into *out, false on overflow.
static inline bool kr_mul_overflows(uint64_t a, uint64_t b, uint64_t *out) {
    return __builtin_mul_overflow(a, b, out);
}
static inline bool kr_add_overflows(uint64_t a, uint64_t b, uint64_t *out) {
    return __builtin_add_overflow(a, b, out);
}

#endif
