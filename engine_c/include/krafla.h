// krafla.h: the whole C API that krafla_twisted (ctypes) sees.
//
// Conventions: opaque handles, no globals. Every function that can fail takes a
// `kr_error *err` (may be NULL), returns a status (KR_OK = 0) or NULL, and fills err with a
// message the user can act on. The library never exits or aborts on bad input.
// Each section below belongs to one source file in engine_c/src/.
#ifndef KRAFLA_H
#define KRAFLA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// ---------------------------------------------------------------------------------------------
// Errors (error.c)

typedef enum {
    KR_OK = 0,
    KR_ERR_IO = 1,           // open, stat, mmap, read, write failed
    KR_ERR_FORMAT = 2,       // a file is malformed, truncated or hostile
    KR_ERR_UNSUPPORTED = 3,  // valid but not something this build can run
    KR_ERR_ARGUMENT = 4,     // a bad argument from the caller (token id, size, NULL)
    KR_ERR_MEMORY = 5,       // allocation failed or a size would overflow
    KR_ERR_CONTEXT = 6,      // positions past the session's context
    KR_ERR_STATE = 7,        // the handle cannot do this now (closed, busy)
} kr_status;

#define KR_ERROR_MESSAGE_SIZE 512

typedef struct {
    int32_t status;                        // kr_status
    char message[KR_ERROR_MESSAGE_SIZE];   // NUL-terminated, "" when status is KR_OK
} kr_error;

// Version string, e.g. "0.7.0", and the ISA this library was built for: "avx2", "generic".
const char *kr_version(void);
const char *kr_isa(void);

// ---------------------------------------------------------------------------------------------
// Container files .mlb / .mlt (file.c). The layout is in docs/formats.md and
// krafla_twisted/formats.py; these constants must agree with that module (tested).

#define KR_MODEL_MAGIC "KRAFLAMB"
#define KR_TOKENIZER_MAGIC "KRAFLATK"
#define KR_FILE_VERSION 1
#define KR_ALIGNMENT 64
#define KR_MAX_DIMS 4
#define KR_MAX_NAME 1024
#define KR_MAX_ENTRIES (1u << 20)

typedef enum { KR_META_INT = 1, KR_META_FLOAT = 2, KR_META_STR = 3, KR_META_INTS = 4, KR_META_FLOATS = 5 } kr_meta_kind;

typedef enum {
    KR_F32 = 0, KR_F16 = 1, KR_BF16 = 2, KR_Q8_0 = 3, KR_Q4_0 = 4, KR_I32 = 5, KR_U8 = 6,
    KR_TYPE_COUNT = 7,
} kr_type;

typedef struct kr_file kr_file;

typedef struct {
    const char *name;        // NUL-terminated copy, owned by the kr_file
    int32_t type;            // kr_type
    int32_t n_dims;
    uint64_t dims[KR_MAX_DIMS];  // outermost first (numpy order); rows of a matrix are dims[0]
    uint64_t n_elements;
    uint64_t n_bytes;
    const void *data;        // inside the mapping, KR_ALIGNMENT-aligned
} kr_tensor_info;

// Open and fully validate a container; `magic` is KR_MODEL_MAGIC, KR_TOKENIZER_MAGIC or NULL
// for either. Every offset, size, count and dimension is checked against the file length.
// Returns NULL and fills err on any problem.
kr_file *kr_file_open(const char *path, const char *magic, kr_error *err);
void kr_file_close(kr_file *file);
const char *kr_file_magic(const kr_file *file);  // 8 chars, not NUL-terminated
uint64_t kr_file_size(const kr_file *file);
int32_t kr_file_n_meta(const kr_file *file);
int32_t kr_file_n_tensors(const kr_file *file);

// Metadata entry by index: key, kind and value. For arrays, *count is the number of elements
// and ints/floats point at them (unaligned little-endian storage is copied for you on access
// through kr_file_meta_int_at / _float_at). Returns KR_ERR_ARGUMENT for a bad index.
int kr_file_meta(const kr_file *file, int32_t index, const char **key, int32_t *kind,
                 int64_t *int_value, double *float_value, const char **str_value,
                 uint32_t *str_length_or_count, kr_error *err);
int64_t kr_file_meta_int_at(const kr_file *file, int32_t index, uint32_t element);
double kr_file_meta_float_at(const kr_file *file, int32_t index, uint32_t element);
// Copy all `count` values of an ints/floats entry (as int64_t or double, the entry's kind) to
// `out`; `count` must equal the entry's count. KR_ERR_ARGUMENT for a bad index, kind or count.
int kr_file_meta_array(const kr_file *file, int32_t index, void *out, uint32_t count, kr_error *err);
// Index of a metadata key, or -1.
int32_t kr_file_find_meta(const kr_file *file, const char *key);
// Typed lookups with a default for a missing key; a present key of the wrong kind is an error.
int kr_file_get_int(const kr_file *file, const char *key, int64_t fallback, int64_t *out, kr_error *err);
int kr_file_get_float(const kr_file *file, const char *key, double fallback, double *out, kr_error *err);
// A string value, NUL-terminated copy owned by the file, or `fallback` if missing.
int kr_file_get_str(const kr_file *file, const char *key, const char *fallback, const char **out, kr_error *err);

int kr_file_tensor(const kr_file *file, int32_t index, kr_tensor_info *info, kr_error *err);
// Find a tensor by name; returns KR_ERR_FORMAT naming the file and tensor if missing.
int kr_file_find_tensor(const kr_file *file, const char *name, kr_tensor_info *info, kr_error *err);
int32_t kr_file_find_tensor_index(const kr_file *file, const char *name);

// Bytes taken by `n_elements` of `type` (a whole number of blocks), or 0 if invalid.
uint64_t kr_type_size(int32_t type, uint64_t n_elements);
const char *kr_type_name(int32_t type);

#ifdef __cplusplus
}
#endif
#endif
