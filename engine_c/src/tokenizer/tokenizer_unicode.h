// tokenizer_unicode.h: codepoint classes for the pre-tokenizers (table in tokenizer_unicode.c).
#ifndef KRAFLA_TOKENIZER_UNICODE_H
#define KRAFLA_TOKENIZER_UNICODE_H

#include <stdint.h>

// KR_CP_UPPER marks Lu and Lt letters, KR_CP_LOWER Ll letters (o200k splits words by case)
enum { KR_CP_LETTER = 1, KR_CP_NUMBER = 2, KR_CP_MARK = 4, KR_CP_SPACE = 8, KR_CP_UPPER = 16, KR_CP_LOWER = 32 };

typedef struct {
    uint32_t first;  // first codepoint of the run
    uint8_t flags;   // KR_CP_* bits of every codepoint in the run
} kr_unicode_range;

extern const uint32_t kr_unicode_range_count;
extern const kr_unicode_range kr_unicode_ranges[];
extern const char kr_unicode_version[];

#endif
