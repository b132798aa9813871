// pack.c: weight repacking at load, and the packed-weight cache file (owner: speed).
//
// kr_model_pack rewrites every packable (kr_packable: q8_0, q4_0, q4_1, q5_0, q5_1, q4_K, q5_K, q6_K,
// iq4_nl, mxfp4) matrix of a loaded model (the layers' projections, a qwen35 model's attention,
// DeltaNet and MLP matrices, each expert's, and the output head) into the packed layout of
// kernels.h (legacy.h for q4_1/q5_0/q5_1/iq4_nl/mxfp4, kquant_ref.c for the k-quants),
// where the lanes of a vector are 8 rows. The arithmetic per output does not change (kr_matmul_packed equals kr_matmul bit for
// bit), so packing only moves bytes.
//
// The cache file (KR_PACK_CACHE) holds the packed matrices, one after the other in a fixed order
// (the architecture's kr_arch.matrices order, layer by layer; then the output head), each 64-byte aligned,
// after a header page:
//
//   magic "KRPACK\0\1", layout version, ISA name, the model file's size and 64-bit checksum (of
//   every byte), the payload's size and checksum.
//
// A load checks all of it; anything that differs (another model or a changed one, another ISA,
// another layout, a truncated or corrupt payload) rebuilds the file, which is written beside
// and renamed over the old one, so a reader never sees half a cache.
#include "kernels/kernels.h"
#include "model/model.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define PACK_MAGIC "KRPACK\0\1"
#define PACK_HEADER_BYTES 4096
#define PACK_ALIGN 64
#define HUGE_PAGE (2u << 20)

typedef struct {
    char magic[8];
    uint32_t layout, header_bytes;
    char isa[16];
    uint64_t model_bytes, model_hash;
    uint64_t payload_bytes, payload_hash;
} pack_header;

// What a packed model keeps: the memory or the mapping the packed matrices live in.
typedef struct {
    int32_t status;      // a kr_pack_status
    char note[256];
    void *memory;        // packed in memory (free)
    void *map;           // cache file mapping (munmap)
    size_t map_bytes;
} pack_state;

void kr_matrix_matmul(const kr_matrix *w, const void *prepared, int64_t n_tokens, float *out, int64_t begin, int64_t end) {
    if (w->packed) kr_matmul_packed(w->type, w->data, w->rows, w->cols, prepared, n_tokens, out, w->rows, begin, end);
    else kr_matmul(w->type, w->data, w->cols, prepared, n_tokens, out, w->rows, begin, end);
}

// Packed or not, when begin starts a group, a matmul over rows [begin, end) reads first the bytes
// from begin * row_bytes, where row_bytes are a row's in the matrix's first column slice (kernels.h,
// kr_slice_blocks: the whole row unless a packed row is long).
void kr_matrix_prefetch(const kr_matrix *w, int64_t begin, int64_t end) {
    const int64_t block = kr_kernel_type_block(w->type), n_blocks = block ? w->cols / block : 0;
    const size_t row_bytes = w->packed && n_blocks ? kr_weight_row_bytes(w->type, kr_slice_blocks(w->type, n_blocks) * block)
                                                   : w->row_bytes;
    kr_stream_start((const char *)w->data + (size_t)begin * row_bytes, (const char *)w->data + (size_t)end * row_bytes);
}

// --- The matrices, in the cache's order

// The architecture's packable matrices in its order (m->matrices), then the output head.
static int list_matrices(kr_model *m, kr_matrix **out) {
    int n = 0;
    for (int32_t i = 0; i < m->n_matrices; i++)
        if (kr_packable(m->matrices[i]->type)) {
            if (out) out[n] = m->matrices[i];
            n++;
        }
    if (kr_packable(m->output.type)) {
        if (out) out[n] = &m->output;
        n++;
    }
    return n;
}

static size_t matrix_bytes(const kr_matrix *w) { return (size_t)w->rows * w->row_bytes; }
static size_t aligned(size_t n) { return (n + PACK_ALIGN - 1) / PACK_ALIGN * PACK_ALIGN; }

// --- A 64-bit checksum, 32 bytes a step in four independent lanes (multiply, rotate, xor), then
// the tail byte by byte. Not cryptographic: it tells a changed or damaged file from the right one.

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static uint64_t checksum(const void *data, size_t n) {
    const uint64_t k1 = 0x9E3779B185EBCA87ull, k2 = 0xC2B2AE3D27D4EB4Full;
    uint64_t lane[4] = {k1, k2, k1 ^ k2, ~k1};
    const unsigned char *p = data;
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int j = 0; j < 4; j++) {
            uint64_t v;
            memcpy(&v, p + i + 8 * j, 8);
            lane[j] = rotl(lane[j] ^ (v * k2), 31) * k1;
        }
    uint64_t h = (uint64_t)n * k1;
    for (int j = 0; j < 4; j++) h = rotl(h ^ lane[j], 27) * k1 + k2;
    for (; i < n; i++) h = rotl(h ^ (p[i] * k2), 11) * k1;
    h ^= h >> 33;
    h *= k2;
    h ^= h >> 29;
    return h;
}

// The model's checksum: every tensor's type, shape and bytes, and the file's size. Reading them
// all would leave the whole file resident, so each tensor's pages are released after it.
static uint64_t model_checksum(const kr_model *m, uint64_t *bytes) {
    *bytes = kr_file_size(m->file);
    uint64_t h = checksum(bytes, sizeof *bytes);
    for (int32_t i = 0; i < kr_file_n_tensors(m->file); i++) {
        kr_tensor_info t;
        if (kr_file_tensor(m->file, i, &t, NULL)) continue;
        uint64_t shape[2 + KR_MAX_DIMS] = {(uint64_t)t.type, (uint64_t)t.n_dims};
        memcpy(shape + 2, t.dims, sizeof t.dims);
        h = h * 0x9E3779B185EBCA87ull ^ checksum(shape, sizeof shape);
        h = h * 0x9E3779B185EBCA87ull ^ checksum(t.data, t.n_bytes);
        kr_release_file_pages(t.data, t.n_bytes);
    }
    return h;
}

// The memory the packed weights are written to: aligned to a huge page and asked to be backed by
// huge pages (Linux's transparent huge pages in their default "madvise" mode take the hint), so a
// generation step, which streams every weight from memory, crosses a page boundary every 2 MiB
// rather than every 4 KiB (one thread's generation on Qwen2.5-Coder-1.5B Q4_K_M about 7% faster).
// NULL when out of memory.
static void *payload_memory(size_t bytes) {
    void *p = NULL;
    if (posix_memalign(&p, HUGE_PAGE, bytes ? bytes : 1)) return NULL;
#ifdef MADV_HUGEPAGE
    madvise(p, bytes, MADV_HUGEPAGE);  // a hint: without it the pages are small, the weights the same
#endif
    return p;
}

// Pack every listed matrix into `payload`: their concatenation, each aligned.
static void pack_into(kr_matrix **list, int n, char *payload) {
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        kr_pack_rows(list[i]->type, list[i]->data, payload + at, list[i]->rows, list[i]->cols);
        at += aligned(matrix_bytes(list[i]));
    }
}

// The listed matrices now read `payload`. A tied output head is the token embedding: its rows are
// looked up in the packed copy too (kr_dequantize_packed_row), so no page of the file's copy is
// read again (each lookup in the file mapped the pages around its row back in).
static void repoint(kr_model *m, kr_matrix **list, int n, const char *payload) {
    size_t at = 0;
    for (int i = 0; i < n; i++) {
        list[i]->data = payload + at;
        list[i]->packed = 1;
        at += aligned(matrix_bytes(list[i]));
    }
    if (m->info.tied_embeddings && m->output.packed) m->token_embd = m->output;
}

// The file's pages of the matrices just packed are not read again.
static void release_sources(kr_matrix **list, const void **sources, int n) {
    for (int i = 0; i < n; i++) kr_release_file_pages(sources[i], matrix_bytes(list[i]));
}

// --- The cache file

// Map `path` and check it against the model; NULL (and why, in `why`) unless it is valid.
static void *map_valid_cache(const char *path, const pack_header *want, size_t *map_bytes, char *why, size_t size) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        snprintf(why, size, "no cache yet (%s)", strerror(errno));
        return NULL;
    }
    struct stat st;
    if (fstat(fd, &st) || (uint64_t)st.st_size != PACK_HEADER_BYTES + want->payload_bytes) {
        snprintf(why, size, "cache has the wrong size");
        close(fd);
        return NULL;
    }
    void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
    close(fd);
    if (map == MAP_FAILED) {
        snprintf(why, size, "cannot map the cache (%s)", strerror(errno));
        return NULL;
    }
    const pack_header *got = map;
    const char *problem = NULL;
    if (memcmp(got->magic, PACK_MAGIC, 8) || got->header_bytes != PACK_HEADER_BYTES) problem = "not a krafla pack cache";
    else if (got->layout != want->layout) problem = "cache has another layout version";
    else if (strncmp(got->isa, want->isa, sizeof got->isa)) problem = "cache was made for another ISA";
    else if (got->model_bytes != want->model_bytes || got->model_hash != want->model_hash)
        problem = "cache was made from another model file (checksum differs)";
    else if (got->payload_bytes != want->payload_bytes) problem = "cache has the wrong payload size";
    else if (checksum((const char *)map + PACK_HEADER_BYTES, want->payload_bytes) != got->payload_hash)
        problem = "cache payload is corrupt (checksum differs)";
    if (problem) {
        snprintf(why, size, "%s", problem);
        munmap(map, (size_t)st.st_size);
        return NULL;
    }
    *map_bytes = (size_t)st.st_size;
    return map;
}

static int write_all(int fd, const void *data, size_t n) {
    const char *p = data;
    while (n) {
        ssize_t done = write(fd, p, n);
        if (done < 0 && errno == EINTR) continue;
        if (done <= 0) return -1;
        p += done;
        n -= (size_t)done;
    }
    return 0;
}

// Write header + payload to path (through a temporary file renamed over it); 0 or -1 with `why`.
static int write_cache(const char *path, const pack_header *header, const void *payload, char *why, size_t size) {
    char tmp[4200];
    if (snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp) {
        snprintf(why, size, "cache path is too long");
        return -1;
    }
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) {
        snprintf(why, size, "cannot write the cache %.160s (%s)", tmp, strerror(errno));
        return -1;
    }
    char page[PACK_HEADER_BYTES] = {0};
    memcpy(page, header, sizeof *header);
    int failed = write_all(fd, page, sizeof page) || write_all(fd, payload, header->payload_bytes) || fsync(fd);
    if (close(fd)) failed = 1;
    if (failed || rename(tmp, path)) {
        snprintf(why, size, "cannot write the cache %.160s (%s)", path, strerror(errno));
        unlink(tmp);
        return -1;
    }
    return 0;
}

// --- API

// m->pack_free: what kr_model_close calls.
static void pack_free(void *state) {
    pack_state *p = state;
    if (!p) return;
    free(p->memory);
    if (p->map) munmap(p->map, p->map_bytes);
    free(p);
}

int kr_model_pack(kr_model *m, int32_t mode, const char *cache_path, kr_error *err) {
    if (!m) return kr_fail(err, KR_ERR_ARGUMENT, "kr_model_pack: model is NULL");
    if (mode != KR_PACK_OFF && mode != KR_PACK_ON && mode != KR_PACK_CACHE)
        return kr_fail(err, KR_ERR_ARGUMENT, "pack mode %d is not one of off (0), on (1), cache (2)", mode);
    if (m->pack) return kr_fail(err, KR_ERR_STATE, "kr_model_pack: already called for this model");
    if (atomic_load(&m->busy)) return kr_fail(err, KR_ERR_STATE, "kr_model_pack: a session is evaluating");
    pack_state *state = calloc(1, sizeof *state);
    if (!state) return kr_fail(err, KR_ERR_MEMORY, "out of memory");
    m->pack = state;
    m->pack_free = pack_free;
    int n = list_matrices(m, NULL);
    if (mode == KR_PACK_OFF || n == 0) {
        snprintf(state->note, sizeof state->note, mode == KR_PACK_OFF ? "packing off" : "no matrices of a packed type to pack");
        kr_ok(err);
        return KR_OK;
    }
    kr_matrix **list = calloc((size_t)n, sizeof *list);
    const void **sources = calloc((size_t)n, sizeof *sources);
    if (!list || !sources) {
        free(list), free(sources);
        return kr_fail(err, KR_ERR_MEMORY, "out of memory");
    }
    list_matrices(m, list);
    size_t payload_bytes = 0;
    for (int i = 0; i < n; i++) {
        sources[i] = list[i]->data;
        payload_bytes += aligned(matrix_bytes(list[i]));
    }
    int status = KR_OK;
    if (mode == KR_PACK_CACHE) {
        const char *path = cache_path;
        if (!path || !*path || strlen(path) > 4000) {
            status = kr_fail(err, KR_ERR_ARGUMENT, "pack cache: the cache path is missing or too long");
            goto done;
        }
        pack_header want = {.layout = KR_PACK_LAYOUT, .header_bytes = PACK_HEADER_BYTES, .payload_bytes = payload_bytes};
        memcpy(want.magic, PACK_MAGIC, 8);
        snprintf(want.isa, sizeof want.isa, "%s", kr_isa());
        want.model_hash = model_checksum(m, &want.model_bytes);
        char why[200];
        state->map = map_valid_cache(path, &want, &state->map_bytes, why, sizeof why);
        if (state->map) {
            repoint(m, list, n, (const char *)state->map + PACK_HEADER_BYTES);
            state->status = KR_PACK_STATUS_CACHE_MAPPED;
            snprintf(state->note, sizeof state->note, "packed weights mapped from the cache");
            release_sources(list, sources, n);
            goto done;
        }
        char *payload = payload_memory(payload_bytes);
        if (!payload) {
            status = kr_fail(err, KR_ERR_MEMORY, "out of memory packing %zu bytes of weights", payload_bytes);
            goto done;
        }
        memset(payload, 0, payload_bytes);  // alignment gaps too: the checksum covers them
        pack_into(list, n, payload);
        want.payload_hash = checksum(payload, payload_bytes);
        char write_why[300];
        if (write_cache(path, &want, payload, write_why, sizeof write_why) == 0 &&
            (state->map = map_valid_cache(path, &want, &state->map_bytes, write_why, sizeof write_why))) {
            free(payload);
            repoint(m, list, n, (const char *)state->map + PACK_HEADER_BYTES);
            state->status = KR_PACK_STATUS_CACHE_BUILT;
            snprintf(state->note, sizeof state->note, "pack cache rebuilt: %.200s", why);
        } else {
            state->memory = payload;  // keep running packed in memory
            repoint(m, list, n, payload);
            state->status = KR_PACK_STATUS_CACHE_FAILED;
            snprintf(state->note, sizeof state->note, "pack cache not written, packed in memory: %.200s", write_why);
        }
        release_sources(list, sources, n);
        goto done;
    }
    if (!(state->memory = payload_memory(payload_bytes))) {
        status = kr_fail(err, KR_ERR_MEMORY, "out of memory packing %zu bytes of weights", payload_bytes);
        goto done;
    }
    pack_into(list, n, state->memory);
    repoint(m, list, n, state->memory);
    state->status = KR_PACK_STATUS_MEMORY;
    snprintf(state->note, sizeof state->note, "packed in memory (%zu bytes)", payload_bytes);
    release_sources(list, sources, n);
done:
    free(list), free(sources);
    if (!status) kr_ok(err);
    return status;
}

int32_t kr_model_pack_status(const kr_model *m, char *note, size_t size) {
    const pack_state *p = m ? m->pack : NULL;
    if (note && size) snprintf(note, size, "%s", p ? p->note : "not packed");
    return p ? p->status : KR_PACK_STATUS_NONE;
}
