// tokenizer.c: .mlt tokenizers: byte-level BPE and SentencePiece BPE with byte fallback.
//
// The behaviour is llama.cpp's (llama-vocab.cpp, unicode.cpp), rebuilt in plain C:
//
//   text -> special-token partition (longest token first; control tokens only in `special` mode,
//           user-defined tokens always) -> for each raw fragment:
//   BPE: pre-tokenize (a hand-written equivalent of the vocabulary's split regex) -> each
//        pre-token's bytes are symbols -> merge the lowest-ranked adjacent pair, leftmost first
//   SPM: (space prefix) -> symbols are UTF-8 characters, ' ' spelled U+2581 -> merge the pair whose
//        concatenation is the highest-scored token, leftmost first -> unknown characters become
//        byte tokens <0xXX>
//
// Both merge loops keep a binary heap of candidate pairs over a linked list of symbols, so a
// pre-token of n symbols costs O(n log n): one giant pre-token (a megabyte of one letter) is no
// worse than many small ones. The special-token partition walks a trie of the special spellings
// from each position (depth bounded by the longest one) and keeps one candidate per position, so
// it is linear too. SentencePiece text is merged word by word when no token can span the start
// of a "▁word" (checked at open), which gives the same ids with small heaps.
//
// Deliberate differences from llama.cpp, all on input it handles badly: plain text never turns
// into a control or unknown token (llama.cpp's SPM lookups would let merges spell one); an
// invalid UTF-8 lead byte in SPM text is one symbol, not one that swallows the next bytes; a
// missing byte token falls back to unk (or is dropped) instead of throwing. The o200k split is
// tiktoken's regex itself, where llama.cpp runs a rewrite that tells case by ASCII only.
//
// Input text is bytes. NUL is an ordinary character. An invalid UTF-8 byte stays in the text as
// one symbol of its own with no letter/number/space class, and reaches the output through the
// byte tokens, so decode(encode(text)) returns the exact input bytes (SPM: with the documented
// leading space when add_space_prefix is set).
#include "runtime/internal.h"
#include "tokenizer/tokenizer_unicode.h"

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { KIND_BPE = 1, KIND_SPM = 2 };
enum { PRE_NONE, PRE_GPT2, PRE_LLAMA3, PRE_QWEN2, PRE_SMOLLM, PRE_QWEN35, PRE_O200K };
static const char *const PRE_NAMES[] = {"none", "gpt2", "llama3", "qwen2", "smollm", "qwen35", "o200k"};

enum { STRIP_LEFT = 1, STRIP_RIGHT = 2 };

#define NO_CODEPOINT 0xFFFFFFFFu  // past the end of the range being split
#define BAD_CODEPOINT 0xFFFFFFFEu // an invalid UTF-8 byte
#define MAX_TEXT (1 << 28)         // bytes per encode call: symbol indices (SPM: 3 bytes per space) stay in int32

// ---------------------------------------------------------------------------------------------
// Small growable arrays and hashing

typedef struct {
    void *data;
    int64_t n, cap;
} vec;

static bool vec_reserve(vec *v, int64_t n, size_t item) {
    if (n <= v->cap) return true;
    int64_t cap = v->cap ? v->cap : 64;
    while (cap < n) cap *= 2;
    void *data = realloc(v->data, (size_t)cap * item);
    if (!data) return false;
    v->data = data;
    v->cap = cap;
    return true;
}

static bool vec_push_i32(vec *v, int32_t x) {
    if (!vec_reserve(v, v->n + 1, sizeof x)) return false;
    ((int32_t *)v->data)[v->n++] = x;
    return true;
}

static uint64_t hash_bytes(const uint8_t *p, int64_t n) {
    uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a, then a final mix for the low bits
    for (int64_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ull;
    return h ^ (h >> 32);
}

static uint64_t hash_u64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint32_t table_size_for(int64_t n) {
    uint32_t size = 16;
    while ((int64_t)size < 2 * n) size *= 2;
    return size;
}

// ---------------------------------------------------------------------------------------------
// Unicode classes and UTF-8

static uint8_t bmp_classes[65536];
static pthread_once_t bmp_once = PTHREAD_ONCE_INIT;

static void build_bmp_classes(void) {
    for (uint32_t r = 0; r < kr_unicode_range_count && kr_unicode_ranges[r].first < 65536; r++) {
        uint32_t end = r + 1 < kr_unicode_range_count ? kr_unicode_ranges[r + 1].first : 0x110000;
        if (end > 65536) end = 65536;
        memset(bmp_classes + kr_unicode_ranges[r].first, kr_unicode_ranges[r].flags, end - kr_unicode_ranges[r].first);
    }
}

static uint8_t codepoint_class(uint32_t cp) {
    if (cp < 65536) return bmp_classes[cp];
    if (cp > 0x10FFFF) return 0;
    uint32_t lo = 0, hi = kr_unicode_range_count;  // last range whose first <= cp
    while (hi - lo > 1) {
        uint32_t mid = (lo + hi) / 2;
        if (kr_unicode_ranges[mid].first <= cp) lo = mid;
        else hi = mid;
    }
    return kr_unicode_ranges[lo].flags;
}

int32_t kr_unicode_class(uint32_t codepoint) {
    pthread_once(&bmp_once, build_bmp_classes);
    return codepoint_class(codepoint);
}

// Decode one strict UTF-8 character at p[0..n); returns its length, or 0 if p[0] does not start a
// valid sequence (overlong forms, surrogates and values past U+10FFFF are invalid).
static int utf8_decode(const uint8_t *p, int64_t n, uint32_t *cp) {
    uint8_t b = p[0];
    if (b < 0x80) {
        *cp = b;
        return 1;
    }
    int len;
    uint32_t value, min;
    if ((b & 0xE0) == 0xC0) len = 2, value = b & 0x1F, min = 0x80;
    else if ((b & 0xF0) == 0xE0) len = 3, value = b & 0x0F, min = 0x800;
    else if ((b & 0xF8) == 0xF0) len = 4, value = b & 0x07, min = 0x10000;
    else return 0;
    if (n < len) return 0;
    for (int i = 1; i < len; i++) {
        if ((p[i] & 0xC0) != 0x80) return 0;
        value = value << 6 | (p[i] & 0x3F);
    }
    if (value < min || value > 0x10FFFF || (value >= 0xD800 && value <= 0xDFFF)) return 0;
    *cp = value;
    return len;
}

static int utf8_encode(uint32_t cp, uint8_t *out) {
    if (cp < 0x80) {
        out[0] = (uint8_t)cp;
        return 1;
    }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | cp >> 6);
        out[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | cp >> 12);
        out[1] = (uint8_t)(0x80 | (cp >> 6 & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | cp >> 18);
    out[1] = (uint8_t)(0x80 | (cp >> 12 & 0x3F));
    out[2] = (uint8_t)(0x80 | (cp >> 6 & 0x3F));
    out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

// SentencePiece's space, U+2581 (E2 96 81), at p.
static bool is_space_mark(const uint8_t *p, int64_t available) {
    return available >= 3 && p[0] == 0xE2 && p[1] == 0x96 && p[2] == 0x81;
}

// GPT-2's byte-to-unicode alphabet: printable Latin-1 bytes stand for themselves, the other 68
// bytes for U+0100.. in byte order.
static bool gpt2_printable(int b) { return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255); }

static void gpt2_byte_alphabet(uint32_t byte_to_cp[256], int16_t cp_to_byte[324]) {
    int extra = 0;
    for (int i = 0; i < 324; i++) cp_to_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        byte_to_cp[b] = gpt2_printable(b) ? (uint32_t)b : 256u + (uint32_t)extra++;
        cp_to_byte[byte_to_cp[b]] = (int16_t)b;
    }
}

// ---------------------------------------------------------------------------------------------
// The tokenizer

typedef struct {
    int32_t token;       // special token ending here (any type), lowest id; -1 if none
    int32_t token_user;  // user-defined token ending here (matched even without `special`)
} trie_node;

struct kr_tokenizer {
    kr_file *file;
    int32_t kind, pre, n_vocab;
    const uint8_t *text;      // token_text: every token's spelling, back to back
    const int32_t *offsets;   // token_offsets (n_vocab + 1): token i is text[offsets[i]..offsets[i+1])
    const int32_t *types;     // token_types (n_vocab): kr_token_type
    const float *scores;      // SPM: token_scores (n_vocab)
    const int32_t *merges;    // BPE: merges (n_merges, 3): left, right, result; rank = row
    int32_t n_merges;
    int32_t bos_id, eos_id, unk_id, pad_id;
    bool add_bos, add_eos, add_space_prefix, ignore_merges;
    bool spm_words;           // SPM: no token has U+2581 after another character, so merges never
                              // cross the start of a "▁word" and each word can be merged alone
    int32_t *eot_ids;
    int32_t n_eot;
    uint8_t *strip;           // per token: STRIP_LEFT / STRIP_RIGHT whitespace around a special match

    int32_t *vocab_slots;     // open addressing: spelling -> id (-1 empty); a duplicate keeps the last id
    uint32_t vocab_mask;
    int32_t *merge_slots;     // (left, right) -> merge row (-1 empty); a duplicate pair keeps the first
    uint32_t merge_mask;
    int32_t byte_ids[256];    // BPE: the one-byte symbol's token; SPM: <0xXX>; -1 if none
    uint32_t byte_to_cp[256];

    uint8_t *pieces;          // decoded bytes of every token (what decode emits)
    int64_t *piece_offsets;   // n_vocab + 1

    trie_node *trie;          // special tokens; node 0 is the root
    int32_t n_trie;
    int32_t max_special, max_user;  // longest special / user-defined spelling in bytes
    uint64_t *edge_keys;      // node * 256 + byte (UINT64_MAX empty)
    int32_t *edge_children;
    uint32_t edge_mask;
    char path[256];
};

static int32_t vocab_find(const kr_tokenizer *tok, const uint8_t *s, int64_t n) {
    for (uint32_t slot = (uint32_t)hash_bytes(s, n) & tok->vocab_mask;; slot = (slot + 1) & tok->vocab_mask) {
        int32_t id = tok->vocab_slots[slot];
        if (id < 0) return -1;
        int64_t len = tok->offsets[id + 1] - tok->offsets[id];
        if (len == n && !memcmp(tok->text + tok->offsets[id], s, (size_t)n)) return id;
    }
}

// A vocabulary entry that plain text may turn into: never a control or unknown token, so user
// text can never produce them (llama.cpp would, for a control token that merges can spell).
static int32_t vocab_find_text(const kr_tokenizer *tok, const uint8_t *s, int64_t n) {
    int32_t id = vocab_find(tok, s, n);
    if (id >= 0 && (tok->types[id] == KR_TOKEN_CONTROL || tok->types[id] == KR_TOKEN_UNKNOWN)) return -1;
    return id;
}

static int32_t merge_find(const kr_tokenizer *tok, int32_t left, int32_t right) {
    uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
    for (uint32_t slot = (uint32_t)hash_u64(key) & tok->merge_mask;; slot = (slot + 1) & tok->merge_mask) {
        int32_t row = tok->merge_slots[slot];
        if (row < 0) return -1;
        if (tok->merges[3 * row] == left && tok->merges[3 * row + 1] == right) return row;
    }
}

static int32_t trie_child(const kr_tokenizer *tok, int32_t node, uint8_t byte) {
    uint64_t key = (uint64_t)node * 256 + byte;
    for (uint32_t slot = (uint32_t)hash_u64(key) & tok->edge_mask;; slot = (slot + 1) & tok->edge_mask) {
        if (tok->edge_keys[slot] == UINT64_MAX) return -1;
        if (tok->edge_keys[slot] == key) return tok->edge_children[slot];
    }
}

void kr_tokenizer_close(kr_tokenizer *tok) {
    if (!tok) return;
    free(tok->eot_ids);
    free(tok->strip);
    free(tok->vocab_slots);
    free(tok->merge_slots);
    free(tok->pieces);
    free(tok->piece_offsets);
    free(tok->trie);
    free(tok->edge_keys);
    free(tok->edge_children);
    kr_file_close(tok->file);
    free(tok);
}

// A tensor of the given type and shape (dims[1] == 0: one dimension).
static int bind_tensor(kr_tokenizer *tok, const char *name, int32_t type, uint64_t dim0, uint64_t dim1,
                       const void **data, kr_error *err) {
    kr_tensor_info info;
    if (kr_file_find_tensor(tok->file, name, &info, err) != KR_OK) return KR_ERR_FORMAT;
    int32_t n_dims = dim1 ? 2 : 1;
    if (info.type != type || info.n_dims != n_dims || (dim0 && info.dims[0] != dim0) || (dim1 && info.dims[1] != dim1))
        return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %s should be %s of shape (%llu%s), found %s with %d dimensions",
                       tok->path, name, kr_type_name(type), (unsigned long long)dim0, dim1 ? ", 3" : "",
                       kr_type_name(info.type), info.n_dims);
    *data = info.data;
    return KR_OK;
}

static int get_id(kr_tokenizer *tok, const char *key, int32_t *out, kr_error *err) {
    int64_t value;
    if (kr_file_get_int(tok->file, key, -1, &value, err) != KR_OK) return KR_ERR_FORMAT;
    if (value < -1 || value >= tok->n_vocab)
        return kr_fail(err, KR_ERR_FORMAT, "%s: %s = %lld is outside the vocabulary of %d tokens", tok->path, key,
                       (long long)value, tok->n_vocab);
    *out = (int32_t)value;
    return KR_OK;
}

static int get_flag(kr_tokenizer *tok, const char *key, bool *out, kr_error *err) {
    int64_t value;
    if (kr_file_get_int(tok->file, key, 0, &value, err) != KR_OK) return KR_ERR_FORMAT;
    if (value != 0 && value != 1) return kr_fail(err, KR_ERR_FORMAT, "%s: %s = %lld, expected 0 or 1", tok->path, key, (long long)value);
    *out = value == 1;
    return KR_OK;
}

// An ints metadata list of token ids: copied to *out (may be NULL to only validate), count to *n.
static int get_id_list(kr_tokenizer *tok, const char *key, int32_t **out, int32_t *n, kr_error *err) {
    int32_t index = kr_file_find_meta(tok->file, key);
    *n = 0;
    if (out) *out = NULL;
    if (index < 0) return KR_OK;
    int32_t kind;
    uint32_t count;
    kr_file_meta(tok->file, index, NULL, &kind, NULL, NULL, NULL, &count, NULL);
    if (kind != KR_META_INTS) return kr_fail(err, KR_ERR_FORMAT, "%s: metadata %s should be a list of integers", tok->path, key);
    int32_t *ids = malloc(sizeof *ids * (count ? count : 1));
    if (!ids) return kr_fail(err, KR_ERR_MEMORY, "%s: out of memory", tok->path);
    for (uint32_t i = 0; i < count; i++) {
        int64_t id = kr_file_meta_int_at(tok->file, index, i);
        if (id < 0 || id >= tok->n_vocab) {
            free(ids);
            return kr_fail(err, KR_ERR_FORMAT, "%s: %s[%u] = %lld is outside the vocabulary of %d tokens", tok->path, key, i,
                           (long long)id, tok->n_vocab);
        }
        ids[i] = (int32_t)id;
    }
    *n = (int32_t)count;
    if (out) *out = ids;
    else free(ids);
    return KR_OK;
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

static int build_tables(kr_tokenizer *tok, kr_error *err) {
    const int32_t n = tok->n_vocab;
    // spelling -> id
    uint32_t size = table_size_for(n);
    tok->vocab_mask = size - 1;
    if (!(tok->vocab_slots = malloc(sizeof(int32_t) * size))) return kr_fail(err, KR_ERR_MEMORY, "%s: out of memory", tok->path);
    memset(tok->vocab_slots, 0xFF, sizeof(int32_t) * size);
    for (int32_t id = 0; id < n; id++) {
        const uint8_t *s = tok->text + tok->offsets[id];
        int64_t len = tok->offsets[id + 1] - tok->offsets[id];
        uint32_t slot = (uint32_t)hash_bytes(s, len) & tok->vocab_mask;
        for (;; slot = (slot + 1) & tok->vocab_mask) {
            int32_t other = tok->vocab_slots[slot];
            if (other < 0) break;
            if (tok->offsets[other + 1] - tok->offsets[other] == len && !memcmp(tok->text + tok->offsets[other], s, (size_t)len))
                break;  // duplicate spelling: the later id wins, as in llama.cpp's token_to_id
        }
        tok->vocab_slots[slot] = id;
    }
    // (left, right) -> merge row
    if (tok->kind == KIND_BPE) {
        size = table_size_for(tok->n_merges);
        tok->merge_mask = size - 1;
        if (!(tok->merge_slots = malloc(sizeof(int32_t) * size))) return kr_fail(err, KR_ERR_MEMORY, "%s: out of memory", tok->path);
        memset(tok->merge_slots, 0xFF, sizeof(int32_t) * size);
        for (int32_t row = 0; row < tok->n_merges; row++) {
            int32_t left = tok->merges[3 * row], right = tok->merges[3 * row + 1];
            uint64_t key = (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
            uint32_t slot = (uint32_t)hash_u64(key) & tok->merge_mask;
            bool seen = false;
            for (;; slot = (slot + 1) & tok->merge_mask) {
                int32_t other = tok->merge_slots[slot];
                if (other < 0) break;
                if (tok->merges[3 * other] == left && tok->merges[3 * other + 1] == right) {
                    seen = true;  // the earlier (better-ranked) merge of a pair stands
                    break;
                }
            }
            if (!seen) tok->merge_slots[slot] = row;
        }
    }
    // the token of each single byte
    gpt2_byte_alphabet(tok->byte_to_cp, (int16_t[324]){0});
    for (int b = 0; b < 256; b++) {
        uint8_t spelling[8];
        int len;
        if (tok->kind == KIND_BPE) {
            len = utf8_encode(tok->byte_to_cp[b], spelling);
            tok->byte_ids[b] = vocab_find_text(tok, spelling, len);
        } else {
            static const char hex[] = "0123456789ABCDEF";
            uint8_t name[6] = {'<', '0', 'x', (uint8_t)hex[b >> 4], (uint8_t)hex[b & 15], '>'};
            tok->byte_ids[b] = vocab_find_text(tok, name, 6);
            if (tok->byte_ids[b] < 0 && b < 0x80) {
                spelling[0] = (uint8_t)b;
                tok->byte_ids[b] = vocab_find_text(tok, spelling, 1);
            }
        }
    }
    return KR_OK;
}

// The bytes each token stands for, as llama.cpp's token_to_piece(special = true) gives them.
static int build_pieces(kr_tokenizer *tok, kr_error *err) {
    const int32_t n = tok->n_vocab;
    uint32_t byte_to_cp[256];
    int16_t cp_to_byte[324];
    gpt2_byte_alphabet(byte_to_cp, cp_to_byte);
    // a decoded piece is never longer than its spelling
    tok->pieces = malloc((size_t)tok->offsets[n] + 1);
    tok->piece_offsets = malloc(sizeof(int64_t) * ((size_t)n + 1));
    if (!tok->pieces || !tok->piece_offsets) return kr_fail(err, KR_ERR_MEMORY, "%s: out of memory", tok->path);
    int64_t out = 0;
    for (int32_t id = 0; id < n; id++) {
        const uint8_t *s = tok->text + tok->offsets[id];
        int64_t len = tok->offsets[id + 1] - tok->offsets[id];
        int32_t type = tok->types[id];
        tok->piece_offsets[id] = out;
        if (type == KR_TOKEN_CONTROL || type == KR_TOKEN_UNKNOWN || type == KR_TOKEN_USER_DEFINED) {
            memcpy(tok->pieces + out, s, (size_t)len);
            out += len;
        } else if (type == KR_TOKEN_NORMAL && tok->kind == KIND_BPE) {
            for (int64_t i = 0; i < len;) {
                uint32_t cp;
                int step = utf8_decode(s + i, len - i, &cp);
                if (step && cp < 324 && cp_to_byte[cp] >= 0) {
                    tok->pieces[out++] = (uint8_t)cp_to_byte[cp];
                } else {  // outside the byte alphabet: keep the spelling's bytes
                    step = step ? step : 1;
                    memcpy(tok->pieces + out, s + i, (size_t)step);
                    out += step;
                }
                i += step;
            }
        } else if (type == KR_TOKEN_NORMAL) {  // SPM: U+2581 is a space
            for (int64_t i = 0; i < len;) {
                if (i + 3 <= len && s[i] == 0xE2 && s[i + 1] == 0x96 && s[i + 2] == 0x81) {
                    tok->pieces[out++] = ' ';
                    i += 3;
                } else {
                    tok->pieces[out++] = s[i++];
                }
            }
        } else if (type == KR_TOKEN_BYTE && tok->kind == KIND_SPM) {
            unsigned value;
            char tail;
            char name[8] = {0};
            if (len == 6) memcpy(name, s, 6);
            if (len == 6 && sscanf(name, "<0x%2x%c", &value, &tail) == 2 && tail == '>') tok->pieces[out++] = (uint8_t)value;
            else return kr_fail(err, KR_ERR_FORMAT, "%s: byte token %d is spelled %.*s, expected <0xXX>", tok->path, id,
                                (int)(len < 32 ? len : 32), (const char *)s);
        }
        // unused tokens (and BPE byte tokens) stand for nothing, as in llama.cpp
    }
    tok->piece_offsets[n] = out;
    return KR_OK;
}

static int build_trie(kr_tokenizer *tok, kr_error *err) {
    int64_t n_nodes = 1, n_special = 0;
    for (int32_t id = 0; id < tok->n_vocab; id++) {
        int32_t type = tok->types[id];
        if (type == KR_TOKEN_CONTROL || type == KR_TOKEN_USER_DEFINED || type == KR_TOKEN_UNKNOWN) {
            n_nodes += tok->offsets[id + 1] - tok->offsets[id];
            n_special++;
        }
    }
    tok->trie = malloc(sizeof(trie_node) * (size_t)n_nodes);
    uint32_t size = table_size_for(n_nodes);
    tok->edge_mask = size - 1;
    tok->edge_keys = malloc(sizeof(uint64_t) * size);
    tok->edge_children = malloc(sizeof(int32_t) * size);
    if (!tok->trie || !tok->edge_keys || !tok->edge_children) return kr_fail(err, KR_ERR_MEMORY, "%s: out of memory", tok->path);
    memset(tok->edge_keys, 0xFF, sizeof(uint64_t) * size);
    tok->trie[0] = (trie_node){-1, -1};
    tok->n_trie = 1;
    for (int32_t id = 0; id < tok->n_vocab; id++) {
        int32_t type = tok->types[id];
        if (type != KR_TOKEN_CONTROL && type != KR_TOKEN_USER_DEFINED && type != KR_TOKEN_UNKNOWN) continue;
        const uint8_t *s = tok->text + tok->offsets[id];
        int64_t len = tok->offsets[id + 1] - tok->offsets[id];
        if (len == 0) continue;
        int32_t node = 0;
        for (int64_t i = 0; i < len; i++) {
            int32_t child = trie_child(tok, node, s[i]);
            if (child < 0) {
                child = tok->n_trie++;
                tok->trie[child] = (trie_node){-1, -1};
                uint64_t key = (uint64_t)node * 256 + s[i];
                uint32_t slot = (uint32_t)hash_u64(key) & tok->edge_mask;
                while (tok->edge_keys[slot] != UINT64_MAX) slot = (slot + 1) & tok->edge_mask;
                tok->edge_keys[slot] = key;
                tok->edge_children[slot] = child;
            }
            node = child;
        }
        if (len > tok->max_special) tok->max_special = (int32_t)len;
        if (type == KR_TOKEN_USER_DEFINED && len > tok->max_user) tok->max_user = (int32_t)len;
        if (tok->trie[node].token < 0) tok->trie[node].token = id;
        if (type == KR_TOKEN_USER_DEFINED && tok->trie[node].token_user < 0) tok->trie[node].token_user = id;
    }
    return KR_OK;
}

kr_tokenizer *kr_tokenizer_open(const char *path, kr_error *err) {
    pthread_once(&bmp_once, build_bmp_classes);
    kr_file *file = kr_file_open(path, KR_TOKENIZER_MAGIC, err);
    if (!file) return NULL;
    kr_tokenizer *tok = calloc(1, sizeof *tok);
    if (!tok) {
        kr_file_close(file);
        kr_fail(err, KR_ERR_MEMORY, "%s: out of memory", path);
        return NULL;
    }
    tok->file = file;
    snprintf(tok->path, sizeof tok->path, "%s", path);

    const char *kind, *pre;
    int64_t n_vocab;
    if (kr_file_get_str(file, "kind", "", &kind, err) || kr_file_get_str(file, "pre", "none", &pre, err) ||
        kr_file_get_int(file, "n_vocab", 0, &n_vocab, err))
        goto fail;
    if (!strcmp(kind, "bpe")) tok->kind = KIND_BPE;
    else if (!strcmp(kind, "spm")) tok->kind = KIND_SPM;
    else {
        kr_fail(err, KR_ERR_UNSUPPORTED, "%s: tokenizer kind \"%s\" is not bpe or spm", path, kind);
        goto fail;
    }
    tok->pre = -1;
    for (int i = 0; i < (int)(sizeof PRE_NAMES / sizeof *PRE_NAMES); i++)
        if (!strcmp(pre, PRE_NAMES[i])) tok->pre = i;
    if (tok->pre < 0 || (tok->kind == KIND_SPM) != (tok->pre == PRE_NONE)) {
        kr_fail(err, KR_ERR_UNSUPPORTED, "%s: pre-tokenizer \"%s\" is unknown or does not fit a %s tokenizer", path, pre, kind);
        goto fail;
    }
    if (n_vocab < 1 || n_vocab >= INT32_MAX) {
        kr_fail(err, KR_ERR_FORMAT, "%s: n_vocab = %lld is not a usable vocabulary size", path, (long long)n_vocab);
        goto fail;
    }
    tok->n_vocab = (int32_t)n_vocab;

    const void *data;
    kr_tensor_info text_info;
    if (kr_file_find_tensor(file, "token_text", &text_info, err)) goto fail;
    if (text_info.type != KR_U8 || text_info.n_dims != 1) {
        kr_fail(err, KR_ERR_FORMAT, "%s: tensor token_text should be one-dimensional u8", path);
        goto fail;
    }
    tok->text = text_info.data;
    if (bind_tensor(tok, "token_offsets", KR_I32, (uint64_t)n_vocab + 1, 0, &data, err)) goto fail;
    tok->offsets = data;
    if (bind_tensor(tok, "token_types", KR_I32, (uint64_t)n_vocab, 0, &data, err)) goto fail;
    tok->types = data;
    if (tok->offsets[0] != 0 || (uint64_t)tok->offsets[n_vocab] != text_info.n_bytes) {
        kr_fail(err, KR_ERR_FORMAT, "%s: token_offsets must run from 0 to the %llu bytes of token_text", path,
                (unsigned long long)text_info.n_bytes);
        goto fail;
    }
    for (int32_t id = 0; id < tok->n_vocab; id++) {
        if (tok->offsets[id + 1] < tok->offsets[id]) {
            kr_fail(err, KR_ERR_FORMAT, "%s: token_offsets decrease at token %d", path, id);
            goto fail;
        }
        if (tok->types[id] < 0 || tok->types[id] > KR_TOKEN_BYTE) {
            kr_fail(err, KR_ERR_FORMAT, "%s: token %d has type %d, expected 0 to 6", path, id, tok->types[id]);
            goto fail;
        }
    }
    if (tok->kind == KIND_BPE) {
        kr_tensor_info merges;
        if (kr_file_find_tensor(file, "merges", &merges, err)) goto fail;
        if (merges.type != KR_I32 || merges.n_dims != 2 || merges.dims[1] != 3 || merges.dims[0] >= INT32_MAX) {
            kr_fail(err, KR_ERR_FORMAT, "%s: tensor merges should be i32 of shape (n_merges, 3)", path);
            goto fail;
        }
        tok->merges = merges.data;
        tok->n_merges = (int32_t)merges.dims[0];
        for (int64_t i = 0; i < 3 * (int64_t)tok->n_merges; i++)
            if (tok->merges[i] < 0 || tok->merges[i] >= tok->n_vocab) {
                kr_fail(err, KR_ERR_FORMAT, "%s: merge %lld names token %d, outside the vocabulary", path, (long long)(i / 3),
                        tok->merges[i]);
                goto fail;
            }
    } else {
        if (bind_tensor(tok, "token_scores", KR_F32, (uint64_t)n_vocab, 0, &data, err)) goto fail;
        tok->scores = data;
        for (int32_t id = 0; id < tok->n_vocab; id++)
            if (isnan(tok->scores[id])) {
                kr_fail(err, KR_ERR_FORMAT, "%s: token %d has a NaN score", path, id);
                goto fail;
            }
    }
    if (get_id(tok, "bos_id", &tok->bos_id, err) || get_id(tok, "eos_id", &tok->eos_id, err) ||
        get_id(tok, "unk_id", &tok->unk_id, err) || get_id(tok, "pad_id", &tok->pad_id, err) ||
        get_flag(tok, "add_bos", &tok->add_bos, err) || get_flag(tok, "add_eos", &tok->add_eos, err) ||
        get_flag(tok, "add_space_prefix", &tok->add_space_prefix, err) ||
        get_flag(tok, "ignore_merges", &tok->ignore_merges, err))
        goto fail;
    if ((tok->add_bos && tok->bos_id < 0) || (tok->add_eos && tok->eos_id < 0)) {
        kr_fail(err, KR_ERR_FORMAT, "%s: add_bos/add_eos is set but the vocabulary has no such token", path);
        goto fail;
    }
    if (get_id_list(tok, "eot_ids", &tok->eot_ids, &tok->n_eot, err)) goto fail;
    qsort(tok->eot_ids, (size_t)tok->n_eot, sizeof *tok->eot_ids, cmp_i32);
    if (!(tok->strip = calloc((size_t)tok->n_vocab, 1))) {
        kr_fail(err, KR_ERR_MEMORY, "%s: out of memory", path);
        goto fail;
    }
    for (int side = 0; side < 2; side++) {
        int32_t *ids, count;
        if (get_id_list(tok, side ? "rstrip_ids" : "lstrip_ids", &ids, &count, err)) goto fail;
        for (int32_t i = 0; i < count; i++) tok->strip[ids[i]] |= side ? STRIP_RIGHT : STRIP_LEFT;
        free(ids);
    }
    if (build_tables(tok, err) || build_pieces(tok, err) || build_trie(tok, err)) goto fail;
    tok->spm_words = tok->kind == KIND_SPM;
    for (int32_t id = 0; id < tok->n_vocab && tok->spm_words; id++) {
        const uint8_t *t = tok->text + tok->offsets[id];
        int64_t len = tok->offsets[id + 1] - tok->offsets[id];
        if (tok->types[id] == KR_TOKEN_CONTROL || tok->types[id] == KR_TOKEN_UNKNOWN) continue;  // never merged
        for (int64_t i = 1; i < len; i++)
            if (is_space_mark(t + i, len - i) && !(i >= 3 && is_space_mark(t + i - 3, 3))) tok->spm_words = false;
    }
    kr_ok(err);
    return tok;

fail:
    kr_tokenizer_close(tok);
    return NULL;
}

int kr_tokenizer_get_info(const kr_tokenizer *tok, kr_tokenizer_info *info, kr_error *err) {
    if (!tok || !info) return kr_fail(err, KR_ERR_ARGUMENT, "no tokenizer or info given");
    memset(info, 0, sizeof *info);
    info->n_vocab = tok->n_vocab;
    info->kind = tok->kind;
    info->bos_id = tok->bos_id;
    info->eos_id = tok->eos_id;
    info->unk_id = tok->unk_id;
    info->pad_id = tok->pad_id;
    info->add_bos = tok->add_bos;
    info->add_eos = tok->add_eos;
    info->add_space_prefix = tok->add_space_prefix;
    info->n_eot = tok->n_eot;
    snprintf(info->pre, sizeof info->pre, "%s", PRE_NAMES[tok->pre]);
    kr_ok(err);
    return KR_OK;
}

int32_t kr_tokenizer_eot_ids(const kr_tokenizer *tok, int32_t *ids, int32_t capacity) {
    if (!tok) return 0;
    for (int32_t i = 0; i < tok->n_eot && i < capacity; i++) ids[i] = tok->eot_ids[i];
    return tok->n_eot;
}

int kr_tokenizer_is_eot(const kr_tokenizer *tok, int32_t id) {
    if (!tok) return 0;
    return bsearch(&id, tok->eot_ids, (size_t)tok->n_eot, sizeof id, cmp_i32) != NULL;
}

int32_t kr_tokenizer_token_type(const kr_tokenizer *tok, int32_t id) {
    return tok && id >= 0 && id < tok->n_vocab ? tok->types[id] : 0;
}

const char *kr_tokenizer_token_text(const kr_tokenizer *tok, int32_t id, int64_t *length) {
    if (!tok || id < 0 || id >= tok->n_vocab) return NULL;
    *length = tok->offsets[id + 1] - tok->offsets[id];
    return (const char *)tok->text + tok->offsets[id];
}

const char *kr_tokenizer_token_piece(const kr_tokenizer *tok, int32_t id, int64_t *length) {
    if (!tok || id < 0 || id >= tok->n_vocab) return NULL;
    *length = tok->piece_offsets[id + 1] - tok->piece_offsets[id];
    return (const char *)tok->pieces + tok->piece_offsets[id];
}

int32_t kr_tokenizer_find(const kr_tokenizer *tok, const char *text, int64_t n_text) {
    if (!tok || (!text && n_text) || n_text < 0) return -1;
    return vocab_find(tok, (const uint8_t *)text, n_text);
}

// ---------------------------------------------------------------------------------------------
// Encoding workspace (one per call, so a tokenizer can be shared between threads)

typedef struct {
    int64_t start, end;  // byte range in the fragment
} span;

typedef struct {
    const kr_tokenizer *tok;
    vec out;             // int32 token ids
    vec cps, classes, offsets, words, symbols, heap, scratch;
    bool oom;
} encoder;

static void encoder_free(encoder *e) {
    free(e->out.data);
    free(e->cps.data);
    free(e->classes.data);
    free(e->offsets.data);
    free(e->words.data);
    free(e->symbols.data);
    free(e->heap.data);
    free(e->scratch.data);
}

static void emit(encoder *e, int32_t id) {
    if (!vec_push_i32(&e->out, id)) e->oom = true;
}

// ---------------------------------------------------------------------------------------------
// Pre-tokenizers: hand-written equivalents of each vocabulary's split regex, on codepoints.

typedef struct {
    const uint32_t *cp;
    const uint8_t *cls;
    int64_t end;       // positions at or past end read as "no character"
    int64_t last;      // end of the previous pre-token
    encoder *e;
    bool ok;
} splitter;

static inline uint32_t cp_at(const splitter *s, int64_t i) { return i < s->end ? s->cp[i] : NO_CODEPOINT; }
static inline uint8_t class_at(const splitter *s, int64_t i) { return i < s->end ? s->cls[i] : 0; }
static inline uint32_t ascii_lower(uint32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

static void word_end(splitter *s, int64_t end) {
    if (end <= s->last) return;
    span w = {s->last, end};
    if (!vec_reserve(&s->e->words, s->e->words.n + 1, sizeof w)) s->ok = false;
    else ((span *)s->e->words.data)[s->e->words.n++] = w;
    s->last = end;
}

// How a contraction's letters compare: exactly; ASCII case folded (llama.cpp's '[sS]|'[tT]...);
// Unicode simple case folding, as (?i:...) in the regex engines, where U+017F LATIN SMALL LETTER LONG
// S also matches s (the only non-ASCII codepoint that folds to one of s t r e v m l d).
enum { CASE_EXACT, CASE_ASCII, CASE_UNICODE };

// 's|'t|'re|'ve|'m|'ll|'d compared by `fold`: the length matched at pos, or 0.
static int contraction(const splitter *s, int64_t pos, int fold) {
    if (cp_at(s, pos) != '\'') return 0;
    uint32_t a = cp_at(s, pos + 1), b = cp_at(s, pos + 2);
    if (fold != CASE_EXACT) a = ascii_lower(a), b = ascii_lower(b);
    if (fold == CASE_UNICODE && a == 0x17F) a = 's';
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l')) return 3;
    return 0;
}

// The regexes' first alternative: a contraction at *pos is a word of its own; true if there was one
// (the word ended, *pos past it).
static bool contraction_word(splitter *s, int64_t *pos, int fold) {
    const int n = contraction(s, *pos, fold);
    if (n) word_end(s, *pos += n);
    return n != 0;
}

// gpt-2: 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
static void split_gpt2(splitter *s, int64_t pos, int64_t end) {
    s->end = end;
    while (pos < end) {
        if (contraction_word(s, &pos, CASE_EXACT)) continue;
        uint32_t c = cp_at(s, pos);
        int64_t body = pos + (c == ' ');  // where the class run starts after an optional space
        uint8_t cls = class_at(s, body);
        if (body < end && (cls & (KR_CP_LETTER | KR_CP_NUMBER))) {
            uint8_t want = cls & KR_CP_LETTER ? KR_CP_LETTER : KR_CP_NUMBER;
            for (pos = body; class_at(s, pos) & want;) pos++;
            word_end(s, pos);
            continue;
        }
        if (body < end && !(cls & KR_CP_SPACE)) {  // symbols: not space, letter or number (marks are symbols here)
            for (pos = body; pos < end && !(class_at(s, pos) & (KR_CP_SPACE | KR_CP_LETTER | KR_CP_NUMBER));) pos++;
            word_end(s, pos);
            continue;
        }
        int64_t spaces = 0;
        while (class_at(s, pos + spaces) & KR_CP_SPACE) spaces++;
        if (spaces > 1 && pos + spaces < end) pos += spaces - 1;  // \s+(?!\S): leave one space for the next word
        else pos += spaces ? spaces : 1;
        word_end(s, pos);
    }
}

// The alternatives after the words and numbers, from pos, shared by llama3's family and o200k:
//  ?[^\s\p{L}\p{N}]+[\r\n]* (o200k, `slash`: [\r\n/]*) | \s*[\r\n]+ | \s+(?!\S) | \s+
// Ends the pre-token and returns where the next one starts.
static int64_t symbols_or_spaces(splitter *s, int64_t pos, int64_t end, uint8_t not_symbol, bool slash) {
    int64_t body = pos + (cp_at(s, pos) == ' ');
    if (body < end && !(class_at(s, body) & not_symbol)) {
        for (pos = body; pos < end && !(class_at(s, pos) & not_symbol);) pos++;
        for (uint32_t c = cp_at(s, pos); c == '\r' || c == '\n' || (slash && c == '/'); c = cp_at(s, pos)) pos++;
        word_end(s, pos);
        return pos;
    }
    int64_t spaces = 0, after_newline = -1;
    for (; class_at(s, pos + spaces) & KR_CP_SPACE; spaces++)
        if (cp_at(s, pos + spaces) == '\r' || cp_at(s, pos + spaces) == '\n') after_newline = pos + spaces + 1;
    if (after_newline >= 0) pos = after_newline;                // \s*[\r\n]+
    else if (spaces > 1 && pos + spaces < end) pos += spaces - 1;  // \s+(?!\S)
    else pos += spaces ? spaces : 1;                          // \s+ (or one stray character)
    word_end(s, pos);
    return pos;
}

// llama3 (digits 3 at a time), qwen2 (1 at a time), qwen35 (1 at a time, marks join letters):
// (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
static void split_llama3_family(splitter *s, int64_t pos, int64_t end, int max_digits, bool marks) {
    s->end = end;
    const uint8_t word = marks ? (KR_CP_LETTER | KR_CP_MARK) : KR_CP_LETTER;
    const uint8_t not_symbol = KR_CP_SPACE | KR_CP_NUMBER | word;
    while (pos < end) {
        if (contraction_word(s, &pos, CASE_ASCII)) continue;
        uint32_t c = cp_at(s, pos);
        uint8_t cls = class_at(s, pos);
        // [^\r\n\p{L}\p{N}]?\p{L}+ : this character is a letter, or an allowed prefix before one
        if (c != '\r' && c != '\n' && !(cls & KR_CP_NUMBER) && ((cls & word) || (class_at(s, pos + 1) & word))) {
            for (pos++; class_at(s, pos) & word;) pos++;
            word_end(s, pos);
            continue;
        }
        if (cls & KR_CP_NUMBER) {
            for (int digits = 0; digits < max_digits && (class_at(s, pos) & KR_CP_NUMBER); digits++) pos++;
            word_end(s, pos);
            continue;
        }
        pos = symbols_or_spaces(s, pos, end, not_symbol, false);
    }
}

// o200k (gpt-4o, gpt-oss): words split where lower case turns upper, contractions stay on the word.
//   [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?
//  |[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?
//  |\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
// The two bracket sets are "upper side" and "lower side"; Lm, Lo and marks belong to both.
static inline bool upper_side(uint8_t cls) { return (cls & (KR_CP_LETTER | KR_CP_MARK)) && !(cls & KR_CP_LOWER); }
static inline bool lower_side(uint8_t cls) { return (cls & (KR_CP_LETTER | KR_CP_MARK)) && !(cls & KR_CP_UPPER); }

// upper* lower+ at start, as a backtracking regex settles it: the end, or -1 if it cannot match.
// upper* takes the whole upper-side run first; if no lower-side character follows the run, it gives
// back characters until one of its own (the last lower-side one in the run) can be lower+.
static int64_t upper_then_lower(const splitter *s, int64_t start) {
    int64_t pos = start, last_lower = -1;
    for (; upper_side(class_at(s, pos)); pos++)
        if (lower_side(class_at(s, pos))) last_lower = pos;
    if (!lower_side(class_at(s, pos))) return last_lower >= 0 ? last_lower + 1 : -1;
    while (lower_side(class_at(s, pos))) pos++;
    return pos;
}

// upper+ lower* at start: the end, or -1.
static int64_t upper_run_then_lower(const splitter *s, int64_t start) {
    if (!upper_side(class_at(s, start))) return -1;
    int64_t pos = start;
    while (upper_side(class_at(s, pos))) pos++;
    while (lower_side(class_at(s, pos))) pos++;
    return pos;
}

static void split_o200k(splitter *s, int64_t pos, int64_t end) {
    s->end = end;
    const uint8_t not_symbol = KR_CP_SPACE | KR_CP_LETTER | KR_CP_NUMBER;
    while (pos < end) {
        uint32_t c = cp_at(s, pos);
        uint8_t cls = class_at(s, pos);
        // The two word alternatives in order, each first with its optional prefix character taken,
        // then without (a mark is both a prefix and a word character).
        bool prefix = c != '\r' && c != '\n' && !(cls & (KR_CP_LETTER | KR_CP_NUMBER));
        int64_t word = prefix ? upper_then_lower(s, pos + 1) : -1;
        if (word < 0) word = upper_then_lower(s, pos);
        if (word < 0 && prefix) word = upper_run_then_lower(s, pos + 1);
        if (word < 0) word = upper_run_then_lower(s, pos);
        if (word >= 0) {
            pos = word + contraction(s, word, CASE_UNICODE);
            word_end(s, pos);
            continue;
        }
        if (cls & KR_CP_NUMBER) {
            for (int digits = 0; digits < 3 && (class_at(s, pos) & KR_CP_NUMBER); digits++) pos++;
            word_end(s, pos);
            continue;
        }
        pos = symbols_or_spaces(s, pos, end, not_symbol, true);
    }
}

// Split fragment[0..n) into pre-tokens appended to e->words as byte spans.
static bool pretokenize(encoder *e, const uint8_t *text, int64_t n) {
    e->words.n = 0;
    if (!vec_reserve(&e->cps, n, sizeof(uint32_t)) || !vec_reserve(&e->classes, n, 1) ||
        !vec_reserve(&e->offsets, n + 1, sizeof(int64_t)))
        return false;
    uint32_t *cps = e->cps.data;
    uint8_t *classes = e->classes.data;
    int64_t *offsets = e->offsets.data;
    int64_t m = 0;
    for (int64_t i = 0; i < n; m++) {
        uint32_t cp;
        int len = utf8_decode(text + i, n - i, &cp);
        offsets[m] = i;
        if (len) {
            cps[m] = cp;
            classes[m] = codepoint_class(cp);
            i += len;
        } else {
            cps[m] = BAD_CODEPOINT;
            classes[m] = 0;
            i += 1;
        }
    }
    offsets[m] = n;
    splitter s = {cps, classes, m, 0, e, true};
    switch (e->tok->pre) {
    case PRE_GPT2: split_gpt2(&s, 0, m); break;
    case PRE_LLAMA3: split_llama3_family(&s, 0, m, 3, false); break;
    case PRE_QWEN2: split_llama3_family(&s, 0, m, 1, false); break;
    case PRE_QWEN35: split_llama3_family(&s, 0, m, 1, true); break;
    case PRE_O200K: split_o200k(&s, 0, m); break;
    case PRE_SMOLLM:
        // two regexes in turn: \p{N} isolates every digit, then gpt-2's split runs inside each piece
        for (int64_t i = 0; i < m;) {
            int64_t j = i;
            if (classes[i] & KR_CP_NUMBER) j = i + 1;
            else
                while (j < m && !(classes[j] & KR_CP_NUMBER)) j++;
            split_gpt2(&s, i, j);
            i = j;
        }
        break;
    default: word_end(&s, m); break;
    }
    if (!s.ok) return false;
    span *words = e->words.data;
    for (int64_t i = 0; i < e->words.n; i++) words[i] = (span){offsets[words[i].start], offsets[words[i].end]};
    return true;
}

// ---------------------------------------------------------------------------------------------
// Merge loops

typedef struct {
    int32_t id;          // BPE: token id of the symbol
    int32_t prev, next;  // linked list of live symbols, -1 at the ends
    int32_t length;      // bytes; 0 once merged into the left neighbour
    int64_t start;       // SPM: byte offset in the text
} symbol;

typedef struct {
    uint32_t key;        // lower first: BPE the merge rank, SPM the merged token's score, order reversed
    int32_t left, right; // symbol indices
    int32_t size;        // bytes of both symbols when queued: a changed symbol makes this stale
} pair;

// Heap order: lowest rank / highest score first, then the leftmost pair (llama.cpp's comparators).
static inline bool pair_before(const pair *a, const pair *b) {
    return a->key < b->key || (a->key == b->key && a->left < b->left);
}

// A key that sorts higher scores first: the float's bits made monotonic, then reversed.
static inline uint32_t score_key(float score) {
    uint32_t bits;
    if (score == 0) score = 0;  // -0 ties with +0, as a float comparison has it
    memcpy(&bits, &score, 4);
    return ~(bits & 0x80000000u ? ~bits : bits | 0x80000000u);
}

static bool heap_push(vec *heap, pair p) {
    if (!vec_reserve(heap, heap->n + 1, sizeof p)) return false;
    pair *h = heap->data;
    int64_t i = heap->n++;
    while (i > 0) {
        int64_t parent = (i - 1) / 2;
        if (!pair_before(&p, &h[parent])) break;
        h[i] = h[parent];
        i = parent;
    }
    h[i] = p;
    return true;
}

static pair heap_pop(vec *heap) {
    pair *h = heap->data;
    pair top = h[0], last = h[--heap->n];
    int64_t i = 0, n = heap->n;
    for (;;) {
        int64_t child = 2 * i + 1;
        if (child >= n) break;
        if (child + 1 < n && pair_before(&h[child + 1], &h[child])) child++;
        if (!pair_before(&h[child], &last)) break;
        h[i] = h[child];
        i = child;
    }
    if (n) h[i] = last;
    return top;
}

static void bpe_queue(encoder *e, int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    symbol *sym = e->symbols.data;
    if (sym[left].id < 0 || sym[right].id < 0) return;
    int32_t row = merge_find(e->tok, sym[left].id, sym[right].id);
    if (row < 0) return;
    pair p = {(uint32_t)row, left, right, sym[left].length + sym[right].length};
    if (!heap_push(&e->heap, p)) e->oom = true;
}

// One pre-token of byte-level BPE.
static void bpe_word(encoder *e, const uint8_t *word, int64_t n) {
    const kr_tokenizer *tok = e->tok;
    if (tok->ignore_merges) {  // a pre-token that is a whole token is taken as it is
        if (!vec_reserve(&e->scratch, 4 * n, 1)) {
            e->oom = true;
            return;
        }
        uint8_t *spelled = e->scratch.data;
        int64_t len = 0;
        for (int64_t i = 0; i < n; i++) len += utf8_encode(tok->byte_to_cp[word[i]], spelled + len);
        int32_t id = vocab_find_text(tok, spelled, len);
        if (id >= 0) {
            emit(e, id);
            return;
        }
    }
    if (!vec_reserve(&e->symbols, n, sizeof(symbol))) {
        e->oom = true;
        return;
    }
    symbol *sym = e->symbols.data;
    for (int32_t i = 0; i < (int32_t)n; i++)
        sym[i] = (symbol){tok->byte_ids[word[i]], i - 1, i + 1 < n ? i + 1 : -1, 1, i};
    e->heap.n = 0;
    for (int32_t i = 1; i < (int32_t)n; i++) bpe_queue(e, i - 1, i);
    while (e->heap.n && !e->oom) {
        pair p = heap_pop(&e->heap);
        symbol *left = &sym[p.left], *right = &sym[p.right];
        // stale: a symbol merged since the pair was queued (symbols only grow, so lengths tell)
        if (!left->length || !right->length || left->length + right->length != p.size) continue;
        left->id = tok->merges[3 * (int64_t)p.key + 2];
        left->length += right->length;
        right->length = 0;
        left->next = right->next;
        if (right->next >= 0) sym[right->next].prev = p.left;
        bpe_queue(e, left->prev, p.left);
        bpe_queue(e, p.left, left->next);
    }
    // a byte with no token of its own is dropped, as llama.cpp does (byte-level vocabularies have all 256)
    for (int32_t i = 0; i >= 0 && i < (int32_t)n; i = sym[i].next)
        if (sym[i].id >= 0) emit(e, sym[i].id);
}


static void spm_queue(encoder *e, const uint8_t *text, int32_t left, int32_t right) {
    if (left < 0 || right < 0) return;
    symbol *sym = e->symbols.data;
    int32_t size = sym[left].length + sym[right].length;
    int32_t id = vocab_find_text(e->tok, text + sym[left].start, size);
    if (id < 0) return;
    pair p = {score_key(e->tok->scores[id]), left, right, size};
    if (!heap_push(&e->heap, p)) e->oom = true;
}

// SentencePiece BPE over text[0..n), spaces already spelled U+2581.
static void spm_merge(encoder *e, const uint8_t *text, int64_t n);

static void spm_text(encoder *e, const uint8_t *text, int64_t n) {
    if (!e->tok->spm_words) {
        spm_merge(e, text, n);
        return;
    }
    // cut before every U+2581 that follows another character: no symbol can span such a cut
    int64_t start = 0;
    for (int64_t i = 1; i < n; i++)
        if (is_space_mark(text + i, n - i) && !(i >= 3 && is_space_mark(text + i - 3, 3))) {
            spm_merge(e, text + start, i - start);
            start = i;
        }
    spm_merge(e, text + start, n - start);
}

static void spm_merge(encoder *e, const uint8_t *text, int64_t n) {
    const kr_tokenizer *tok = e->tok;
    if (!vec_reserve(&e->symbols, n, sizeof(symbol))) {
        e->oom = true;
        return;
    }
    symbol *sym = e->symbols.data;
    int32_t count = 0;
    for (int64_t i = 0; i < n; count++) {
        // one UTF-8 character, or one invalid byte (llama.cpp would let a bad lead byte swallow
        // the next bytes, spaces included; keeping it alone lets it round-trip)
        uint32_t cp;
        int len = utf8_decode(text + i, n - i, &cp);
        if (!len) len = 1;
        sym[count] = (symbol){-1, count - 1, -1, len, i};
        if (count) sym[count - 1].next = count;
        i += len;
    }
    e->heap.n = 0;
    for (int32_t i = 1; i < count; i++) spm_queue(e, text, i - 1, i);
    while (e->heap.n && !e->oom) {
        pair p = heap_pop(&e->heap);
        symbol *left = &sym[p.left], *right = &sym[p.right];
        if (!left->length || !right->length || left->length + right->length != p.size) continue;
        left->length += right->length;
        right->length = 0;
        left->next = right->next;
        if (right->next >= 0) sym[right->next].prev = p.left;
        spm_queue(e, text, left->prev, p.left);
        spm_queue(e, text, p.left, left->next);
    }
    for (int32_t i = 0; i >= 0 && i < count; i = sym[i].next) {
        int32_t id = vocab_find_text(tok, text + sym[i].start, sym[i].length);
        if (id >= 0) {
            emit(e, id);
            continue;
        }
        for (int32_t j = 0; j < sym[i].length; j++) {  // byte fallback; no byte token: <unk>, else dropped
            int32_t byte_id = tok->byte_ids[text[sym[i].start + j]];
            if (byte_id < 0) byte_id = tok->unk_id;
            if (byte_id >= 0) emit(e, byte_id);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Special tokens and the whole encode

typedef struct {
    int64_t pos;
    int32_t length, id;
} match;

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

// The longest special token starting at text[p] that is shorter than `below` bytes (and eligible:
// any special type with `special`, else user-defined only); its length, 0 if none.
static int32_t longest_match(const kr_tokenizer *tok, const uint8_t *text, int64_t n, int64_t p, int32_t below,
                             int32_t special, int32_t *id) {
    int32_t node = 0, best = 0;
    for (int64_t j = p; j < n && j - p + 1 < below; j++) {
        if ((node = trie_child(tok, node, text[j])) < 0) break;
        int32_t found = special ? tok->trie[node].token : tok->trie[node].token_user;
        if (found >= 0) best = (int32_t)(j - p + 1), *id = found;
    }
    return best;
}

static int match_position(const void *a, const void *b) {
    const match *x = a, *y = b;
    return (x->pos > y->pos) - (x->pos < y->pos);
}

static bool c_space(uint8_t c) { return c == ' ' || (c >= '\t' && c <= '\r'); }

// A raw-text fragment: BPE pre-tokens and merges, or SPM with its space handling.
static void encode_fragment(encoder *e, const uint8_t *text, int64_t n, bool after_special) {
    const kr_tokenizer *tok = e->tok;
    if (tok->kind == KIND_BPE) {
        if (!pretokenize(e, text, n)) {
            e->oom = true;
            return;
        }
        for (int64_t i = 0; i < e->words.n && !e->oom; i++) {
            span w = ((span *)e->words.data)[i];
            bpe_word(e, text + w.start, w.end - w.start);
        }
        return;
    }
    bool prefix = tok->add_space_prefix && after_special;
    int64_t spaces = prefix;
    for (int64_t i = 0; i < n; i++) spaces += text[i] == ' ';
    if (!vec_reserve(&e->scratch, n + 2 * spaces + 1, 1)) {
        e->oom = true;
        return;
    }
    uint8_t *escaped = e->scratch.data;
    int64_t len = 0;
    for (int64_t i = -prefix; i < n; i++) {
        if (i < 0 || text[i] == ' ') {
            escaped[len++] = 0xE2, escaped[len++] = 0x96, escaped[len++] = 0x81;
        } else {
            escaped[len++] = text[i];
        }
    }
    spm_text(e, escaped, len);
}

int kr_tokenizer_encode(const kr_tokenizer *tok, const char *text_chars, int64_t n_text, int32_t add_bos, int32_t add_eos,
                        int32_t special, int32_t *tokens, int64_t capacity, int64_t *n_tokens, kr_error *err) {
    if (!tok || (!text_chars && n_text) || n_text < 0 || (!tokens && capacity) || capacity < 0 || !n_tokens)
        return kr_fail(err, KR_ERR_ARGUMENT, "kr_tokenizer_encode: bad arguments");
    if (n_text > MAX_TEXT)
        return kr_fail(err, KR_ERR_ARGUMENT, "a text of %lld bytes is over the tokenizer's limit of %d", (long long)n_text, MAX_TEXT);
    const uint8_t *text = (const uint8_t *)text_chars;
    bool bos = add_bos < 0 ? tok->add_bos : add_bos > 0, eos = add_eos < 0 ? tok->add_eos : add_eos > 0;
    if ((bos && tok->bos_id < 0) || (eos && tok->eos_id < 0))
        return kr_fail(err, KR_ERR_ARGUMENT, "%s: the vocabulary has no %s token to add", tok->path, bos && tok->bos_id < 0 ? "bos" : "eos");
    encoder e = {.tok = tok};
    vec matches = {0};
    uint8_t *state = NULL;  // per byte: 0 raw text, 1 inside an accepted special token, 2 stripped
    int status = KR_OK;
    if (bos) emit(&e, tok->bos_id);

    // llama.cpp's partition: special tokens longest first, each taking the occurrences that still
    // lie wholly in unclaimed text, and eating the whitespace its strip flags ask for. Done with
    // one candidate per position: its longest match, queued by length; a candidate that no longer
    // fits falls back to its next shorter match, and a position inside a claimed range is dropped,
    // so a megabyte of spaces against thirty space-run tokens stays linear.
    int64_t n_accepted = 0;
    int32_t max_length = special ? tok->max_special : tok->max_user;
    vec *buckets = NULL;  // buckets[L]: positions whose current candidate has length L
    bool any = false;
    if (max_length > 0 && n_text > 0) {
        if (!(buckets = calloc((size_t)max_length + 1, sizeof *buckets))) e.oom = true;
        for (int64_t p = 0; p < n_text && !e.oom; p++) {
            int32_t id, length = longest_match(tok, text, n_text, p, INT32_MAX, special, &id);
            if (length && !vec_reserve(&buckets[length], buckets[length].n + 1, sizeof(int64_t))) e.oom = true;
            else if (length) ((int64_t *)buckets[length].data)[buckets[length].n++] = p, any = true;
        }
    }
    if (any && !e.oom && !(state = calloc((size_t)n_text, 1))) e.oom = true;
    for (int32_t length = max_length; any && length > 0 && !e.oom; length--) {
        int64_t *positions = buckets[length].data;
        if (buckets[length].n > 1) qsort(positions, (size_t)buckets[length].n, sizeof *positions, cmp_i64);
        for (int64_t k = 0; k < buckets[length].n && !e.oom; k++) {
            int64_t p = positions[k];
            if (state[p]) continue;  // claimed or stripped: nothing can start here any more
            int64_t blocked = p;
            while (blocked < p + length && !state[blocked]) blocked++;
            int32_t id;
            if (blocked < p + length) {  // try the next shorter match at p later
                int32_t shorter = longest_match(tok, text, n_text, p, length, special, &id);
                if (shorter && !vec_reserve(&buckets[shorter], buckets[shorter].n + 1, sizeof(int64_t))) e.oom = true;
                else if (shorter) ((int64_t *)buckets[shorter].data)[buckets[shorter].n++] = p;
                positions = buckets[length].data;
                continue;
            }
            longest_match(tok, text, n_text, p, length + 1, special, &id);
            memset(state + p, 1, (size_t)length);
            if (tok->strip[id] & STRIP_LEFT)
                for (int64_t i = p - 1; i >= 0 && state[i] == 0 && c_space(text[i]); i--) state[i] = 2;
            if (tok->strip[id] & STRIP_RIGHT)
                for (int64_t i = p + length; i < n_text && state[i] == 0 && c_space(text[i]); i++) state[i] = 2;
            if (!vec_reserve(&matches, n_accepted + 1, sizeof(match))) e.oom = true;
            else ((match *)matches.data)[n_accepted++] = (match){p, length, id};
        }
    }
    if (buckets)
        for (int32_t length = 0; length <= max_length; length++) free(buckets[length].data);
    free(buckets);
    if (n_accepted) qsort(matches.data, (size_t)n_accepted, sizeof(match), match_position);
    // raw fragments between the accepted tokens, in text order
    const match *accepted = matches.data;
    int64_t cursor = 0;
    bool after_special = true;
    for (int64_t k = 0; k <= n_accepted && !e.oom; k++) {
        int64_t gap_end = k < n_accepted ? accepted[k].pos : n_text;
        int64_t start = cursor, end = gap_end;
        if (state) {
            while (start < end && state[start] == 2) start++;
            while (end > start && state[end - 1] == 2) end--;
        }
        if (end > start) {
            encode_fragment(&e, text + start, end - start, after_special);
            after_special = false;
        }
        if (k < n_accepted) {
            emit(&e, accepted[k].id);
            after_special = true;
            cursor = accepted[k].pos + accepted[k].length;
        }
    }
    if (eos) emit(&e, tok->eos_id);
    if (e.oom) {
        status = kr_fail(err, KR_ERR_MEMORY, "%s: out of memory encoding %lld bytes", tok->path, (long long)n_text);
    } else {
        *n_tokens = e.out.n;
        if (e.out.n && capacity) memcpy(tokens, e.out.data, sizeof(int32_t) * (size_t)(e.out.n < capacity ? e.out.n : capacity));
        kr_ok(err);
    }
    free(state);
    free(matches.data);
    encoder_free(&e);
    return status;
}

int kr_tokenizer_pretokenize(const kr_tokenizer *tok, const char *text, int64_t n_text, int64_t *ends, int64_t capacity,
                             int64_t *n_words, kr_error *err) {
    if (!tok || (!text && n_text) || n_text < 0 || (!ends && capacity) || !n_words)
        return kr_fail(err, KR_ERR_ARGUMENT, "kr_tokenizer_pretokenize: bad arguments");
    if (n_text > MAX_TEXT)
        return kr_fail(err, KR_ERR_ARGUMENT, "a text of %lld bytes is over the tokenizer's limit of %d", (long long)n_text, MAX_TEXT);
    encoder e = {.tok = tok};
    if (!pretokenize(&e, (const uint8_t *)text, n_text)) {
        encoder_free(&e);
        return kr_fail(err, KR_ERR_MEMORY, "%s: out of memory", tok->path);
    }
    const span *words = e.words.data;
    for (int64_t i = 0; i < e.words.n && i < capacity; i++) ends[i] = words[i].end;
    *n_words = e.words.n;
    encoder_free(&e);
    kr_ok(err);
    return KR_OK;
}

int kr_tokenizer_decode(const kr_tokenizer *tok, const int32_t *ids, int64_t n_ids, int32_t special, char *out,
                        int64_t capacity, int64_t *n_bytes, kr_error *err) {
    if (!tok || (!ids && n_ids) || n_ids < 0 || (!out && capacity) || capacity < 0 || !n_bytes)
        return kr_fail(err, KR_ERR_ARGUMENT, "kr_tokenizer_decode: bad arguments");
    int64_t total = 0;
    for (int64_t i = 0; i < n_ids; i++) {
        int32_t id = ids[i];
        if (id < 0 || id >= tok->n_vocab)
            return kr_fail(err, KR_ERR_ARGUMENT, "token id %d at position %lld is outside the vocabulary of %d tokens", id,
                           (long long)i, tok->n_vocab);
        if (!special && (tok->types[id] == KR_TOKEN_CONTROL || tok->types[id] == KR_TOKEN_UNKNOWN)) continue;
        int64_t len = tok->piece_offsets[id + 1] - tok->piece_offsets[id];
        if (total + len <= capacity) memcpy(out + total, tok->pieces + tok->piece_offsets[id], (size_t)len);
        total += len;
    }
    *n_bytes = total;
    kr_ok(err);
    return KR_OK;
}
