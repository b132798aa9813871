// file.c: open, validate and mmap a krafla container (.mlb / .mlt).
//
// The whole file is mapped read-only; the header, the metadata table and the tensor table are
// parsed with a bounds-checked cursor, and every tensor's extent is checked against the file
// before anything else may look at it. After kr_file_open succeeds, every pointer handed out
// lies inside the mapping.
#include "runtime/internal.h"
#include "types/types.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define HEADER_SIZE 40
#define KR_SHOWN_PATH 240

typedef struct {
    char *key;
    int32_t kind;
    int64_t int_value;
    double float_value;
    char *str_value;        // NUL-terminated copy for KR_META_STR
    uint32_t count;         // string length or array count
    const uint8_t *array;   // KR_META_INTS / KR_META_FLOATS: raw little-endian values
} meta_entry;

struct kr_file {
    char magic[8];
    const uint8_t *map;
    uint64_t size;
    uint64_t data_offset;
    int32_t n_meta;
    int32_t n_tensors;
    meta_entry *meta;
    kr_tensor_info *tensors;
    char *path;             // copy of the path given to kr_file_open, for messages
};

typedef struct {
    const uint8_t *base;
    uint64_t pos, end;
} cursor;

static bool take(cursor *c, void *out, uint64_t n) {
    if (n > c->end - c->pos) return false;
    memcpy(out, c->base + c->pos, n);
    c->pos += n;
    return true;
}

// True when s[0..n) is well-formed UTF-8 (no overlong forms, surrogates or code points past
// U+10FFFF), the same rule Python's strict decoder applies, so both readers accept the same names.
static bool valid_utf8(const uint8_t *s, uint64_t n) {
    uint64_t i = 0;
    while (i < n) {
        uint8_t b = s[i];
        uint32_t extra, min;
        if (b < 0x80) { i++; continue; }
        if ((b & 0xE0) == 0xC0) { extra = 1; min = 0x80; }
        else if ((b & 0xF0) == 0xE0) { extra = 2; min = 0x800; }
        else if ((b & 0xF8) == 0xF0) { extra = 3; min = 0x10000; }
        else return false;
        if (extra > n - i - 1) return false;
        uint32_t code = b & (0x3Fu >> extra);
        for (uint32_t k = 1; k <= extra; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return false;
            code = code << 6 | (s[i + k] & 0x3Fu);
        }
        if (code < min || code > 0x10FFFF || (code >= 0xD800 && code <= 0xDFFF)) return false;
        i += extra + 1;
    }
    return true;
}

// The index of the first name that repeats an earlier one, or -1. An open-addressing hash set,
// so a hostile file with 2^20 entries costs milliseconds rather than a quadratic scan.
static int64_t first_duplicate(const char *const *names, size_t stride, int32_t n, kr_error *err, bool *failed) {
    *failed = false;
    if (n < 2) return -1;
    size_t slots = 4;
    while (slots < 2 * (size_t)n) slots *= 2;
    int32_t *table = malloc(slots * sizeof *table);
    if (!table) {
        *failed = true;
        kr_fail(err, KR_ERR_MEMORY, "out of memory checking %d names", n);
        return -1;
    }
    memset(table, 0xFF, slots * sizeof *table);  // -1: empty
    int64_t found = -1;
    for (int32_t i = 0; i < n && found < 0; i++) {
        const char *name = *(const char *const *)((const char *)names + (size_t)i * stride);
        uint64_t hash = 1469598103934665603ull;  // FNV-1a
        for (const char *p = name; *p; p++) hash = (hash ^ (uint8_t)*p) * 1099511628211ull;
        size_t slot = hash & (slots - 1);
        for (;;) {
            int32_t other = table[slot];
            if (other < 0) {
                table[slot] = i;
                break;
            }
            if (!strcmp(*(const char *const *)((const char *)names + (size_t)other * stride), name)) {
                found = i;
                break;
            }
            slot = (slot + 1) & (slots - 1);
        }
    }
    free(table);
    return found;
}

// A double as int64 without the undefined behaviour of casting NaN or an out-of-range value:
// NaN gives 0, anything else saturates.
static int64_t saturate_int64(double v) {
    if (v != v) return 0;
    if (v >= 9223372036854775807.0) return INT64_MAX;
    if (v <= -9223372036854775808.0) return INT64_MIN;
    return (int64_t)v;
}

// A length-prefixed (u16) name, copied and NUL-terminated. Names are UTF-8 without NUL.
static char *take_name(cursor *c, kr_file *f, const char *what, kr_error *err) {
    uint16_t length;
    if (!take(c, &length, 2)) {
        kr_fail(err, KR_ERR_FORMAT, "%s: truncated in the %s table", f->path, what);
        return NULL;
    }
    if (length == 0 || length > KR_MAX_NAME) {
        kr_fail(err, KR_ERR_FORMAT, "%s: %s name of %u bytes (1 to %d allowed)", f->path, what, length, KR_MAX_NAME);
        return NULL;
    }
    if (length > c->end - c->pos) {
        kr_fail(err, KR_ERR_FORMAT, "%s: %s name of %u bytes runs past the end of the tables", f->path, what, length);
        return NULL;
    }
    if (memchr(c->base + c->pos, 0, length)) {
        kr_fail(err, KR_ERR_FORMAT, "%s: %s name contains a NUL byte", f->path, what);
        return NULL;
    }
    if (!valid_utf8(c->base + c->pos, length)) {
        kr_fail(err, KR_ERR_FORMAT, "%s: %s name is not UTF-8", f->path, what);
        return NULL;
    }
    char *name = malloc(length + 1u);
    if (!name) {
        kr_fail(err, KR_ERR_MEMORY, "%s: out of memory", f->path);
        return NULL;
    }
    take(c, name, length);
    name[length] = '\0';
    return name;
}

static int parse_meta(kr_file *f, cursor *c, kr_error *err) {
    for (int32_t i = 0; i < f->n_meta; i++) {
        meta_entry *m = &f->meta[i];
        if (!(m->key = take_name(c, f, "metadata", err))) return err ? err->status : KR_ERR_FORMAT;
        uint8_t kind;
        if (!take(c, &kind, 1)) return kr_fail(err, KR_ERR_FORMAT, "%s: metadata %.200s: truncated", f->path, m->key);
        m->kind = kind;
        switch (kind) {
        case KR_META_INT:
            if (!take(c, &m->int_value, 8)) return kr_fail(err, KR_ERR_FORMAT, "%s: metadata %.200s: truncated", f->path, m->key);
            m->float_value = (double)m->int_value;
            break;
        case KR_META_FLOAT:
            if (!take(c, &m->float_value, 8)) return kr_fail(err, KR_ERR_FORMAT, "%s: metadata %.200s: truncated", f->path, m->key);
            m->int_value = saturate_int64(m->float_value);
            break;
        case KR_META_STR:
            if (!take(c, &m->count, 4) || m->count > c->end - c->pos)
                return kr_fail(err, KR_ERR_FORMAT, "%s: metadata %.200s: string runs past the end", f->path, m->key);
            if (!(m->str_value = malloc((size_t)m->count + 1)))
                return kr_fail(err, KR_ERR_MEMORY, "%s: out of memory", f->path);
            take(c, m->str_value, m->count);
            m->str_value[m->count] = '\0';
            break;
        case KR_META_INTS:
        case KR_META_FLOATS:
            if (!take(c, &m->count, 4) || (uint64_t)m->count * 8 > c->end - c->pos)
                return kr_fail(err, KR_ERR_FORMAT, "%s: metadata %.200s: array of %u runs past the end", f->path,
                               m->key, m->count);
            m->array = c->base + c->pos;
            c->pos += (uint64_t)m->count * 8;
            break;
        default:
            return kr_fail(err, KR_ERR_FORMAT, "%s: metadata %.200s: unknown kind %u", f->path, m->key, kind);
        }
    }
    return KR_OK;
}

static int parse_tensors(kr_file *f, cursor *c, kr_error *err) {
    for (int32_t i = 0; i < f->n_tensors; i++) {
        kr_tensor_info *t = &f->tensors[i];
        char *name = take_name(c, f, "tensor", err);
        if (!name) return err ? err->status : KR_ERR_FORMAT;
        t->name = name;
        uint32_t type, n_dims;
        if (!take(c, &type, 4) || !take(c, &n_dims, 4))
            return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %.200s: truncated", f->path, name);
        if (type >= KR_TYPE_COUNT) return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %.200s: unknown type %u", f->path, name, type);
        if (n_dims < 1 || n_dims > KR_MAX_DIMS)
            return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %.200s: %u dimensions (1 to %d allowed)", f->path, name, n_dims,
                           KR_MAX_DIMS);
        t->type = (int32_t)type;
        t->n_dims = (int32_t)n_dims;
        uint64_t count = 1;
        for (uint32_t d = 0; d < n_dims; d++) {
            if (!take(c, &t->dims[d], 8)) return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %.200s: truncated", f->path, name);
            if (t->dims[d] == 0 || t->dims[d] > (1ull << 40) || kr_mul_overflows(count, t->dims[d], &count))
                return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %.200s: dimension %u is %llu", f->path, name, d,
                               (unsigned long long)t->dims[d]);
        }
        if (t->dims[n_dims - 1] % kr_types[type].block)
            return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %.200s: last dimension %llu is not a multiple of %s's block of %u",
                           f->path, name, (unsigned long long)t->dims[n_dims - 1], kr_types[type].name, kr_types[type].block);
        t->n_elements = count;
        t->n_bytes = kr_type_size(t->type, count);
        uint64_t offset, start, end;
        if (!take(c, &offset, 8)) return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %.200s: truncated", f->path, name);
        if (t->n_bytes == 0)
            return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %.200s: %llu elements of %s take more than 2^64 bytes", f->path,
                           name, (unsigned long long)count, kr_types[type].name);
        if (offset % KR_ALIGNMENT)
            return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %.200s: data offset %llu is not a multiple of %d", f->path, name,
                           (unsigned long long)offset, KR_ALIGNMENT);
        if (kr_add_overflows(f->data_offset, offset, &start) ||
            kr_add_overflows(start, t->n_bytes, &end) || end > f->size)
            return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %.200s: %llu bytes at data offset %llu lie outside the file",
                           f->path, name, (unsigned long long)t->n_bytes, (unsigned long long)offset);
        t->data = f->map + start;
    }
    return KR_OK;
}

kr_file *kr_file_open(const char *path, const char *magic, kr_error *err) {
    if (!path) {
        kr_fail(err, KR_ERR_ARGUMENT, "no file path given");
        return NULL;
    }
    kr_file *f = calloc(1, sizeof *f);
    if (!f) {
        kr_fail(err, KR_ERR_MEMORY, "%s: out of memory", path);
        return NULL;
    }
    // Messages name the file by its path, or by the path's last KR_SHOWN_PATH bytes if longer,
    // so the problem itself always fits in the error message.
    size_t length = strlen(path);
    const char *shown = length > KR_SHOWN_PATH ? path + length - KR_SHOWN_PATH : path;
    if (!(f->path = malloc(strlen(shown) + 4))) {
        kr_fail(err, KR_ERR_MEMORY, "%s: out of memory", shown);
        free(f);
        return NULL;
    }
    snprintf(f->path, strlen(shown) + 4, "%s%s", shown == path ? "" : "...", shown);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0) {
        kr_fail(err, KR_ERR_IO, "%s: cannot open: %s", f->path, strerror(errno));
        goto fail_fd;
    }
    if (!S_ISREG(st.st_mode)) {
        kr_fail(err, KR_ERR_IO, "%s: not a regular file", f->path);
        goto fail_fd;
    }
    if ((uint64_t)st.st_size < HEADER_SIZE) {
        kr_fail(err, KR_ERR_FORMAT, "%s: %lld bytes is too short for a krafla file", f->path, (long long)st.st_size);
        goto fail_fd;
    }
    f->size = (uint64_t)st.st_size;
    void *map = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    close(fd);
    fd = -1;
    if (map == MAP_FAILED) {
        kr_fail(err, KR_ERR_IO, "%s: cannot map: %s", f->path, strerror(errno));
        goto fail;
    }
    f->map = map;

    cursor c = {f->map, 0, f->size};
    uint32_t version = 0, n_meta = 0, n_tensors = 0, reserved = 0;  // reserved: written as 0, ignored
    uint64_t file_size = 0;
    take(&c, f->magic, 8);
    take(&c, &version, 4);
    take(&c, &n_meta, 4);
    take(&c, &n_tensors, 4);
    take(&c, &reserved, 4);
    (void)reserved;
    take(&c, &f->data_offset, 8);
    take(&c, &file_size, 8);
    if (memcmp(f->magic, KR_MODEL_MAGIC, 8) && memcmp(f->magic, KR_TOKENIZER_MAGIC, 8)) {
        kr_fail(err, KR_ERR_FORMAT, "%s: not a krafla file (bad magic)", f->path);
        goto fail;
    }
    if (magic && memcmp(f->magic, magic, 8)) {
        kr_fail(err, KR_ERR_FORMAT, "%s: expected a %s file", f->path,
                memcmp(magic, KR_MODEL_MAGIC, 8) ? "tokenizer (.mlt)" : "model (.mlb)");
        goto fail;
    }
    if (version != KR_FILE_VERSION) {
        kr_fail(err, KR_ERR_UNSUPPORTED, "%s: file version %u, this krafla reads version %d", f->path, version,
                KR_FILE_VERSION);
        goto fail;
    }
    if (file_size != f->size) {
        kr_fail(err, KR_ERR_FORMAT, "%s: header says %llu bytes, file has %llu (truncated or padded)", f->path,
                (unsigned long long)file_size, (unsigned long long)f->size);
        goto fail;
    }
    if (n_meta > KR_MAX_ENTRIES || n_tensors > KR_MAX_ENTRIES) {
        kr_fail(err, KR_ERR_FORMAT, "%s: %u metadata entries and %u tensors exceed the limit of %u", f->path, n_meta,
                n_tensors, KR_MAX_ENTRIES);
        goto fail;
    }
    if (f->data_offset % KR_ALIGNMENT || f->data_offset > f->size || f->data_offset < HEADER_SIZE) {
        kr_fail(err, KR_ERR_FORMAT, "%s: data offset %llu is misaligned or outside the file", f->path,
                (unsigned long long)f->data_offset);
        goto fail;
    }
    // Before allocating for the counts, check the tables could hold them: a metadata entry
    // takes at least 8 bytes (an empty string) and a tensor entry at least 27 (1 dimension).
    if ((uint64_t)n_meta * 8 + (uint64_t)n_tensors * 27 > f->data_offset - HEADER_SIZE) {
        kr_fail(err, KR_ERR_FORMAT, "%s: %u metadata entries and %u tensors cannot fit in the %llu bytes before the data",
                f->path, n_meta, n_tensors, (unsigned long long)(f->data_offset - HEADER_SIZE));
        goto fail;
    }
    f->n_meta = (int32_t)n_meta;
    f->n_tensors = (int32_t)n_tensors;
    f->meta = calloc(n_meta ? n_meta : 1, sizeof *f->meta);
    f->tensors = calloc(n_tensors ? n_tensors : 1, sizeof *f->tensors);
    if (!f->meta || !f->tensors) {
        kr_fail(err, KR_ERR_MEMORY, "%s: out of memory for %u entries", f->path, n_meta + n_tensors);
        goto fail;
    }
    c.end = f->data_offset;  // the tables must end before the data
    if (parse_meta(f, &c, err) != KR_OK || parse_tensors(f, &c, err) != KR_OK) goto fail;
    bool failed;
    int64_t dup = first_duplicate((const char *const *)&f->meta[0].key, sizeof *f->meta, f->n_meta, err, &failed);
    if (failed) goto fail;
    if (dup >= 0) {
        kr_fail(err, KR_ERR_FORMAT, "%s: metadata key %.200s appears twice", f->path, f->meta[dup].key);
        goto fail;
    }
    dup = first_duplicate(&f->tensors[0].name, sizeof *f->tensors, f->n_tensors, err, &failed);
    if (failed) goto fail;
    if (dup >= 0) {
        kr_fail(err, KR_ERR_FORMAT, "%s: tensor %.200s appears twice", f->path, f->tensors[dup].name);
        goto fail;
    }
    kr_ok(err);
    return f;

fail_fd:
    if (fd >= 0) close(fd);
fail:
    kr_file_close(f);
    return NULL;
}

void kr_file_close(kr_file *f) {
    if (!f) return;
    if (f->meta)
        for (int32_t i = 0; i < f->n_meta; i++) {
            free(f->meta[i].key);
            free(f->meta[i].str_value);
        }
    if (f->tensors)
        for (int32_t i = 0; i < f->n_tensors; i++) free((void *)f->tensors[i].name);
    free(f->meta);
    free(f->tensors);
    if (f->map) munmap((void *)f->map, f->size);
    free(f->path);
    free(f);
}

const char *kr_file_magic(const kr_file *f) { return f ? f->magic : "\0\0\0\0\0\0\0\0"; }
uint64_t kr_file_size(const kr_file *f) { return f ? f->size : 0; }
int32_t kr_file_n_meta(const kr_file *f) { return f ? f->n_meta : 0; }
int32_t kr_file_n_tensors(const kr_file *f) { return f ? f->n_tensors : 0; }

int kr_file_meta(const kr_file *f, int32_t index, const char **key, int32_t *kind, int64_t *int_value,
                 double *float_value, const char **str_value, uint32_t *count, kr_error *err) {
    if (!f || index < 0 || index >= f->n_meta)
        return kr_fail(err, KR_ERR_ARGUMENT, "metadata index %d out of range", index);
    const meta_entry *m = &f->meta[index];
    if (key) *key = m->key;
    if (kind) *kind = m->kind;
    if (int_value) *int_value = m->int_value;
    if (float_value) *float_value = m->float_value;
    if (str_value) *str_value = m->str_value;
    if (count) *count = m->count;
    kr_ok(err);
    return KR_OK;
}

int64_t kr_file_meta_int_at(const kr_file *f, int32_t index, uint32_t element) {
    if (!f || index < 0 || index >= f->n_meta) return 0;
    const meta_entry *m = &f->meta[index];
    if (!m->array || element >= m->count) return 0;
    if (m->kind == KR_META_FLOATS) return saturate_int64(kr_file_meta_float_at(f, index, element));
    int64_t v;
    memcpy(&v, m->array + 8ull * element, 8);
    return v;
}

double kr_file_meta_float_at(const kr_file *f, int32_t index, uint32_t element) {
    if (!f || index < 0 || index >= f->n_meta) return 0;
    const meta_entry *m = &f->meta[index];
    if (!m->array || element >= m->count) return 0;
    if (m->kind == KR_META_INTS) return (double)kr_file_meta_int_at(f, index, element);
    double v;
    memcpy(&v, m->array + 8ull * element, 8);
    return v;
}

int kr_file_meta_array(const kr_file *f, int32_t index, void *out, uint32_t count, kr_error *err) {
    if (!f || index < 0 || index >= f->n_meta)
        return kr_fail(err, KR_ERR_ARGUMENT, "metadata index %d out of range", index);
    const meta_entry *m = &f->meta[index];
    if (!m->array) return kr_fail(err, KR_ERR_ARGUMENT, "metadata %.200s is not an array", m->key);
    if (count != m->count)
        return kr_fail(err, KR_ERR_ARGUMENT, "metadata %.200s has %u values, not %u", m->key, m->count, count);
    if (count && !out) return kr_fail(err, KR_ERR_ARGUMENT, "metadata %.200s: no output buffer", m->key);
    if (count) memcpy(out, m->array, (size_t)count * 8);
    kr_ok(err);
    return KR_OK;
}

int32_t kr_file_find_meta(const kr_file *f, const char *key) {
    if (!f || !key) return -1;
    for (int32_t i = 0; i < f->n_meta; i++)
        if (!strcmp(f->meta[i].key, key)) return i;
    return -1;
}

// The index of metadata `key` into *index (-1 if the file has none: the caller's fallback); an
// error if the key is there with a kind outside `kinds` (bits 1 << KR_META_*), which `expected` names.
static int find_meta_of(const kr_file *f, const char *key, unsigned kinds, const char *expected, int32_t *index,
                        kr_error *err) {
    *index = kr_file_find_meta(f, key);
    if (*index >= 0 && !(kinds & (1u << f->meta[*index].kind)))
        return kr_fail(err, KR_ERR_FORMAT, "%s: metadata %.200s should be %s", f->path, key, expected);
    kr_ok(err);
    return KR_OK;
}

int kr_file_get_int(const kr_file *f, const char *key, int64_t fallback, int64_t *out, kr_error *err) {
    int32_t i;
    const int status = find_meta_of(f, key, 1u << KR_META_INT, "an integer", &i, err);
    if (!status) *out = i < 0 ? fallback : f->meta[i].int_value;
    return status;
}

int kr_file_get_float(const kr_file *f, const char *key, double fallback, double *out, kr_error *err) {
    int32_t i;
    const int status = find_meta_of(f, key, 1u << KR_META_FLOAT | 1u << KR_META_INT, "a number", &i, err);
    if (!status) *out = i < 0 ? fallback : f->meta[i].float_value;
    return status;
}

int kr_file_get_str(const kr_file *f, const char *key, const char *fallback, const char **out, kr_error *err) {
    int32_t i;
    const int status = find_meta_of(f, key, 1u << KR_META_STR, "a string", &i, err);
    if (!status) *out = i < 0 ? fallback : f->meta[i].str_value;
    return status;
}

int kr_file_tensor(const kr_file *f, int32_t index, kr_tensor_info *info, kr_error *err) {
    if (!f || !info || index < 0 || index >= f->n_tensors)
        return kr_fail(err, KR_ERR_ARGUMENT, "tensor index %d out of range", index);
    *info = f->tensors[index];
    kr_ok(err);
    return KR_OK;
}

int32_t kr_file_find_tensor_index(const kr_file *f, const char *name) {
    if (!f || !name) return -1;
    for (int32_t i = 0; i < f->n_tensors; i++)
        if (!strcmp(f->tensors[i].name, name)) return i;
    return -1;
}

int kr_file_find_tensor(const kr_file *f, const char *name, kr_tensor_info *info, kr_error *err) {
    int32_t i = kr_file_find_tensor_index(f, name);
    if (i < 0) return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %.200s is missing", f ? f->path : "?", name ? name : "?");
    return kr_file_tensor(f, i, info, err);
}
