// loader.c: the loader helpers of model.h, which model.c and every architecture read a .mlb with.
//
// Every metadata key of docs/formats.md is read through these helpers and checked for a sane
// value; every tensor a step reads is looked up by name and checked for type and shape, so the
// steps can trust the model completely. Anything unsupported is refused with a message naming it.
#include "model/model.h"
#include "types/types.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

// --- Metadata

int kr_load_int(kr_model *m, const char *path, const char *key, bool required, int64_t fallback, int64_t low,
                int64_t high, int32_t *out, kr_error *err) {
    if (required && kr_file_find_meta(m->file, key) < 0)
        return kr_fail(err, KR_ERR_FORMAT, "%s: metadata %s is missing", path, key);
    int64_t value;
    int status = kr_file_get_int(m->file, key, fallback, &value, err);
    if (status) return status;
    if (value < low || value > high)
        return kr_fail(err, KR_ERR_FORMAT, "%s: metadata %s = %lld, expected %lld to %lld", path, key,
                       (long long)value, (long long)low, (long long)high);
    *out = (int32_t)value;
    return KR_OK;
}

int kr_load_float(kr_model *m, const char *path, const char *key, bool required, double fallback, double low,
                  bool strict_low, double high, float *out, kr_error *err) {
    if (required && kr_file_find_meta(m->file, key) < 0)
        return kr_fail(err, KR_ERR_FORMAT, "%s: metadata %s is missing", path, key);
    double value;
    int status = kr_file_get_float(m->file, key, fallback, &value, err);
    if (status) return status;
    if (!isfinite(value) || value < low || (strict_low && value == low) || value > high)
        return kr_fail(err, KR_ERR_FORMAT, "%s: metadata %s = %g, expected %s%g to %g", path, key, value,
                       strict_low ? "more than " : "", low, high);
    *out = (float)value;
    return KR_OK;
}

int kr_find_layer_list(kr_model *m, const char *path, const char *key, int32_t *index, kr_error *err) {
    *index = kr_file_find_meta(m->file, key);
    if (*index < 0) return KR_OK;
    int32_t kind;
    uint32_t count;
    int status = kr_file_meta(m->file, *index, NULL, &kind, NULL, NULL, NULL, &count, err);
    if (status) return status;
    if (kind != KR_META_INTS)
        return kr_fail(err, KR_ERR_FORMAT, "%s: metadata %s should be a list of integers", path, key);
    if (count != (uint32_t)m->info.n_layers)
        return kr_fail(err, KR_ERR_FORMAT, "%s: %s has %u entries for %d layers", path, key, count, m->info.n_layers);
    return KR_OK;
}

int kr_load_layer_types(kr_model *m, const char *path, const char *allowed, int32_t fallback, int32_t *types,
                        kr_error *err) {
    const kr_model_info *h = &m->info;
    int32_t index;
    int status = kr_find_layer_list(m, path, "layer_types", &index, err);
    if (status) return status;
    if (index < 0) {
        if (fallback < 0)
            return kr_fail(err, KR_ERR_FORMAT, "%s: %s needs layer_types, one integer per layer", path, h->arch);
        for (int32_t i = 0; i < h->n_layers; i++) types[i] = fallback;
        return KR_OK;
    }
    for (int32_t i = 0; i < h->n_layers; i++) {
        int64_t type = kr_file_meta_int_at(m->file, index, (uint32_t)i);
        if (type == 2 && !strchr(allowed, '2'))
            return kr_fail(err, KR_ERR_UNSUPPORTED, "%s: layer %d is linear attention, which only qwen35 has", path, i);
        if (type < 0 || type > 9 || !strchr(allowed, (char)('0' + type)))
            return kr_fail(err, KR_ERR_FORMAT, "%s: layer_types[%d] = %lld, %s has %s", path, i, (long long)type,
                           h->arch, !strcmp(allowed, "01") ? "0 (full) and 1 (sliding)" : "0 (full) and 2 (linear)");
        types[i] = (int32_t)type;
    }
    return KR_OK;
}

int kr_load_sliding_layers(kr_model *m, const char *path, int32_t *sliding, kr_error *err) {
    kr_model_info *h = &m->info;
    int status = kr_load_layer_types(m, path, "01", 0, sliding, err);
    if (status) return status;
    for (int32_t i = 0; i < h->n_layers; i++) h->n_sliding_layers += sliding[i];
    if (h->n_sliding_layers && !h->sliding_window)
        return kr_fail(err, KR_ERR_FORMAT, "%s: %d sliding-window layers but sliding_window is 0", path,
                       h->n_sliding_layers);
    return KR_OK;
}

// --- Tensors

// "(a, b)" or "(a,)", numpy style.
static const char *format_shape(const kr_tensor_info *t, char *out, size_t size) {
    int used = snprintf(out, size, "(");
    for (int32_t d = 0; d < t->n_dims && used < (int)size; d++)
        used += snprintf(out + used, size - (size_t)used, d ? ", %llu" : "%llu", (unsigned long long)t->dims[d]);
    if (used < (int)size) snprintf(out + used, size - (size_t)used, t->n_dims == 1 ? ",)" : ")");
    return out;
}

int kr_bind_matrix(kr_model *m, const char *path, const char *name, int64_t rows, int64_t cols, kr_matrix *out,
                   kr_error *err) {
    kr_tensor_info t;
    int status = kr_file_find_tensor(m->file, name, &t, err);
    if (status) return status;
    if (!kr_kernel_type_supported(t.type))
        return kr_fail(err, KR_ERR_UNSUPPORTED,
                       "%s: tensor %s has type %s; weights must be f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_K, q5_K or q6_K",
                       path, name, kr_type_name(t.type));
    if (t.n_dims != 2 || t.dims[0] != (uint64_t)rows || t.dims[1] != (uint64_t)cols) {
        char shape[128];
        return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %s has shape %s, expected (%lld, %lld)", path, name,
                       format_shape(&t, shape, sizeof shape), (long long)rows, (long long)cols);
    }
    out->type = t.type;
    out->data = t.data;
    out->rows = rows;
    out->cols = cols;
    out->row_bytes = kr_type_size(t.type, (uint64_t)cols);
    return KR_OK;
}

int kr_bind_f32(kr_model *m, const char *path, const char *name, int64_t d0, int64_t d1, const float **out,
                kr_error *err) {
    kr_tensor_info t;
    int status = kr_file_find_tensor(m->file, name, &t, err);
    if (status) return status;
    if (t.type != KR_F32)
        return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %s has type %s, expected f32", path, name, kr_type_name(t.type));
    bool ok = d1 ? t.n_dims == 2 && t.dims[0] == (uint64_t)d0 && t.dims[1] == (uint64_t)d1
                 : t.n_dims == 1 && t.dims[0] == (uint64_t)d0;
    if (!ok) {
        char shape[128], want[64];
        if (d1) snprintf(want, sizeof want, "(%lld, %lld)", (long long)d0, (long long)d1);
        else snprintf(want, sizeof want, "(%lld,)", (long long)d0);
        return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %s has shape %s, expected %s", path, name,
                       format_shape(&t, shape, sizeof shape), want);
    }
    // A copy the model owns: a step reads every norm and bias, and the file's pages around them are
    // mapped in folios of up to 2 MiB, which would bring back the pages of the packed matrices next
    // to them (about 110 MiB of Qwen2.5-Coder 0.5B's file, resident beside the packed copy). The
    // pages the copy was read from are given back too (they stayed mapped, about 1 MiB of SmolLM2's).
    if (m->n_vectors == m->vectors_cap) {
        int32_t cap = m->vectors_cap ? 2 * m->vectors_cap : 64;
        float **grown = realloc(m->vectors, (size_t)cap * sizeof *grown);
        if (!grown) return kr_fail(err, KR_ERR_MEMORY, "out of memory for tensor %s", name);
        m->vectors = grown, m->vectors_cap = cap;
    }
    float *copy = malloc(t.n_bytes ? t.n_bytes : 1);
    if (!copy) return kr_fail(err, KR_ERR_MEMORY, "out of memory for tensor %s", name);
    memcpy(copy, t.data, t.n_bytes);
    kr_release_file_pages(t.data, t.n_bytes);
    m->vectors[m->n_vectors++] = copy;
    *out = copy;
    return KR_OK;
}

void kr_release_file_pages(const void *data, size_t bytes) {
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    uintptr_t begin = (uintptr_t)data / page * page, end = ((uintptr_t)data + bytes + page - 1) / page * page;
    if (end > begin) madvise((void *)begin, end - begin, MADV_DONTNEED);
}

#define NAME(suffix) (snprintf(name, sizeof name, "blk.%d.%s", layer, suffix), name)

int kr_bind_attention(kr_model *m, const char *path, int32_t layer, int64_t q_rows, bool biases, bool qk_norms,
                      kr_attention *l, kr_error *err) {
    const kr_model_info *h = &m->info;
    char name[96];
    int status;
    if ((status = kr_bind_matrix(m, path, NAME("attn_q.weight"), q_rows, h->dim, &l->wq, err)) ||
        (status = kr_bind_matrix(m, path, NAME("attn_k.weight"), m->kv_dim, h->dim, &l->wk, err)) ||
        (status = kr_bind_matrix(m, path, NAME("attn_v.weight"), m->kv_dim, h->dim, &l->wv, err)) ||
        (status = kr_bind_matrix(m, path, NAME("attn_output.weight"), h->dim, m->q_dim, &l->wo, err)))
        return status;
    if (biases && ((status = kr_bind_f32(m, path, NAME("attn_q.bias"), q_rows, 0, &l->bq, err)) ||
                   (status = kr_bind_f32(m, path, NAME("attn_k.bias"), m->kv_dim, 0, &l->bk, err)) ||
                   (status = kr_bind_f32(m, path, NAME("attn_v.bias"), m->kv_dim, 0, &l->bv, err))))
        return status;
    if (qk_norms && ((status = kr_bind_f32(m, path, NAME("attn_q_norm.weight"), h->head_dim, 0, &l->q_norm, err)) ||
                     (status = kr_bind_f32(m, path, NAME("attn_k_norm.weight"), h->head_dim, 0, &l->k_norm, err))))
        return status;
    l->gated = q_rows == 2 * (int64_t)m->q_dim;
    l->cache_layer = m->n_cache_layers++;
    return KR_OK;
}

int kr_bind_mlp(kr_model *m, const char *path, int32_t layer, kr_mlp *l, kr_error *err) {
    const kr_model_info *h = &m->info;
    char name[96];
    int status;
    if ((status = kr_bind_matrix(m, path, NAME("ffn_gate.weight"), h->ffn_dim, h->dim, &l->gate, err)) ||
        (status = kr_bind_matrix(m, path, NAME("ffn_up.weight"), h->ffn_dim, h->dim, &l->up, err)) ||
        (status = kr_bind_matrix(m, path, NAME("ffn_down.weight"), h->dim, h->ffn_dim, &l->down, err)))
        return status;
    return KR_OK;
}

#undef NAME
