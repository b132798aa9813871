// model.c: open a .mlb with its architecture's implementation, and the loader helpers they share.
//
// Every metadata key of docs/formats.md is read through these helpers and checked for a sane
// value; every tensor a step reads is looked up by name and checked for type and shape, so the
// steps can trust the model completely. Anything unsupported is refused with a message naming it.
#include "kernels/kernels.h"
#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

// Limits that keep every size computed from them far from overflow.
#define MAX_VOCAB (1 << 24)
#define MAX_DIM (1 << 16)
#define MAX_FFN (1 << 18)
#define MAX_LAYERS 1024
#define MAX_HEADS 1024
#define MAX_HEAD_DIM 1024
#define MAX_SEQ (1 << 24)
#define MAX_THREADS 256

static const kr_arch *const ARCHS[] = {&kr_arch_llama, &kr_arch_qwen2, &kr_arch_gemma3, &kr_arch_qwen3,
                                       &kr_arch_mistral, &kr_arch_phi3, &kr_arch_smollm3, &kr_arch_qwen35};
#define ARCH_NAMES "llama, qwen2, gemma3, qwen3, mistral, phi3, smollm3, qwen35"

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

static int load_string(kr_model *m, const char *path, const char *key, const char **out, kr_error *err) {
    if (kr_file_find_meta(m->file, key) < 0)
        return kr_fail(err, KR_ERR_FORMAT, "%s: metadata %s is missing", path, key);
    return kr_file_get_str(m->file, key, NULL, out, err);
}

// The common hyperparameters (dims, heads, RoPE, norms), before the architecture's own.
static int load_hparams(kr_model *m, const char *path, kr_error *err) {
    kr_model_info *h = &m->info;
    const char *name, *rope_style, *activation;
    int status;
    if ((status = kr_file_get_str(m->file, "name", "", &name, err))) return status;
    snprintf(h->name, sizeof h->name, "%s", name);
    if ((status = kr_load_int(m, path, "n_vocab", true, 0, 1, MAX_VOCAB, &h->n_vocab, err)) ||
        (status = kr_load_int(m, path, "dim", true, 0, 1, MAX_DIM, &h->dim, err)) ||
        (status = kr_load_int(m, path, "n_layers", true, 0, 1, MAX_LAYERS, &h->n_layers, err)) ||
        (status = kr_load_int(m, path, "n_heads", true, 0, 1, MAX_HEADS, &h->n_heads, err)) ||
        (status = kr_load_int(m, path, "n_kv_heads", true, 0, 1, MAX_HEADS, &h->n_kv_heads, err)) ||
        (status = kr_load_int(m, path, "head_dim", true, 0, 2, MAX_HEAD_DIM, &h->head_dim, err)) ||
        (status = kr_load_int(m, path, "ffn_dim", true, 0, 1, MAX_FFN, &h->ffn_dim, err)) ||
        (status = kr_load_int(m, path, "max_seq", true, 0, 1, MAX_SEQ, &h->max_seq, err)))
        return status;
    if (h->n_heads % h->n_kv_heads)
        return kr_fail(err, KR_ERR_FORMAT, "%s: n_heads %d is not a multiple of n_kv_heads %d", path, h->n_heads,
                       h->n_kv_heads);
    if (h->head_dim % 2)
        return kr_fail(err, KR_ERR_FORMAT, "%s: head_dim %d is odd (RoPE rotates pairs)", path, h->head_dim);
    if ((int64_t)h->n_heads * h->head_dim > MAX_FFN)
        return kr_fail(err, KR_ERR_FORMAT, "%s: n_heads * head_dim = %lld is too large", path,
                       (long long)h->n_heads * h->head_dim);
    if ((status = kr_load_int(m, path, "rope_dims", false, h->head_dim, 2, h->head_dim, &h->rope_dims, err)))
        return status;
    if (h->rope_dims % 2) return kr_fail(err, KR_ERR_FORMAT, "%s: rope_dims %d is odd", path, h->rope_dims);
    if ((status = kr_load_int(m, path, "tied_embeddings", false, 0, 0, 1, &h->tied_embeddings, err)) ||
        (status = kr_load_int(m, path, "sliding_window", false, 0, 0, MAX_SEQ, &h->sliding_window, err)))
        return status;
    if ((status = kr_load_float(m, path, "norm_eps", true, 0, 0, true, 1, &h->norm_eps, err)) ||
        (status = kr_load_float(m, path, "rope_theta", true, 0, 0, true, 1e12, &h->rope_theta, err)) ||
        (status = kr_load_float(m, path, "rope_theta_local", false, h->rope_theta, 0, true, 1e12,
                                &h->rope_theta_local, err)) ||
        (status = kr_load_float(m, path, "rope_scale", false, 1, 0, true, 1e6, &h->rope_scale, err)) ||
        (status = kr_load_float(m, path, "embedding_scale", false, 1, 0, true, 1e6, &h->embedding_scale, err)) ||
        (status = kr_load_float(m, path, "attn_scale", false, 1 / sqrt((double)h->head_dim), 0, true, 1e6,
                                &h->attn_scale, err)) ||
        (status = kr_load_float(m, path, "attn_softcap", false, 0, 0, false, 1e6, &h->attn_softcap, err)) ||
        (status = kr_load_float(m, path, "final_softcap", false, 0, 0, false, 1e6, &h->final_softcap, err)))
        return status;
    if ((status = load_string(m, path, "rope_style", &rope_style, err))) return status;
    if (!strcmp(rope_style, "norm")) h->rope_style = KR_ROPE_NORM;
    else if (!strcmp(rope_style, "neox")) h->rope_style = KR_ROPE_NEOX;
    else return kr_fail(err, KR_ERR_UNSUPPORTED, "%s: rope_style '%.64s' is not supported (norm, neox)", path,
                        rope_style);
    if ((status = load_string(m, path, "activation", &activation, err))) return status;
    if (!strcmp(activation, "silu")) h->activation = KR_ACT_SILU;
    else if (!strcmp(activation, "gelu_tanh")) h->activation = KR_ACT_GELU_TANH;
    else return kr_fail(err, KR_ERR_UNSUPPORTED, "%s: activation '%.64s' is not supported (silu, gelu_tanh)",
                        path, activation);
    m->q_dim = h->n_heads * h->head_dim;
    m->kv_dim = h->n_kv_heads * h->head_dim;
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

// After the layers: token_embd, output_norm, output (or the tied embedding); then the weight and
// output types and the file's counts.
static int bind_embeddings(kr_model *m, const char *path, kr_error *err) {
    kr_model_info *h = &m->info;
    int status;
    if ((status = kr_bind_matrix(m, path, "token_embd.weight", h->n_vocab, h->dim, &m->token_embd, err)) ||
        (status = kr_bind_f32(m, path, "output_norm.weight", h->dim, 0, &m->output_norm, err)))
        return status;
    if (h->tied_embeddings) {
        if (kr_file_find_tensor_index(m->file, "output.weight") >= 0)
            return kr_fail(err, KR_ERR_FORMAT, "%s: tied_embeddings is 1 but output.weight is present", path);
        m->output = m->token_embd;
    } else if ((status = kr_bind_matrix(m, path, "output.weight", h->n_vocab, h->dim, &m->output, err))) {
        return status;
    }
    h->weight_type = m->matrices[0]->type;  // the first layer's first matrix
    h->output_type = m->output.type;
    for (int32_t i = 0; i < kr_file_n_tensors(m->file); i++) {
        kr_tensor_info t;
        kr_file_tensor(m->file, i, &t, NULL);
        h->n_params += t.n_elements;
        h->n_bytes += t.n_bytes;
    }
    return KR_OK;
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

// RoPE frequencies theta^(-2i/rope_dims) (full layers divided by rope_scale).
static int rope_frequencies(kr_model *m, const char *path, kr_error *err) {
    const kr_model_info *h = &m->info;
    m->inv_freq_full = calloc((size_t)h->rope_dims / 2, sizeof(float));
    m->inv_freq_local = calloc((size_t)h->rope_dims / 2, sizeof(float));
    if (!m->inv_freq_full || !m->inv_freq_local) return kr_fail(err, KR_ERR_MEMORY, "out of memory opening %s", path);
    // An optional rope_freqs.weight (rope_dims / 2,) divides each pair's frequency (Llama 3.1's
    // scaling, llama.cpp's tensor), in every layer.
    const float *factors = NULL;
    if (kr_file_find_tensor_index(m->file, "rope_freqs.weight") >= 0) {
        int status = kr_bind_f32(m, path, "rope_freqs.weight", h->rope_dims / 2, 0, &factors, err);
        if (status) return status;
        for (int32_t i = 0; i < h->rope_dims / 2; i++)
            if (!isfinite(factors[i]) || factors[i] <= 0)
                return kr_fail(err, KR_ERR_FORMAT, "%s: rope_freqs.weight[%d] = %g, expected a positive number", path,
                               i, (double)factors[i]);
    }
    for (int32_t i = 0; i < h->rope_dims / 2; i++) {
        double exponent = (2.0 * i) / h->rope_dims, divisor = factors ? (double)factors[i] : 1.0;
        m->inv_freq_full[i] = (float)(1.0 / pow(h->rope_theta, exponent) / h->rope_scale / divisor);
        m->inv_freq_local[i] = (float)(1.0 / pow(h->rope_theta_local, exponent) / divisor);
    }
    return KR_OK;
}

// Every matrix of the layers into m->matrices (arch->matrices' order), and the most columns any
// of them has: the width of a prepared activation row.
static int list_matrices(kr_model *m, const char *path, kr_error *err) {
    m->n_matrices = m->arch->matrices(m, NULL);
    m->matrices = calloc((size_t)m->n_matrices + 1, sizeof *m->matrices);
    if (!m->matrices) return kr_fail(err, KR_ERR_MEMORY, "out of memory opening %s", path);
    m->arch->matrices(m, m->matrices);
    m->widest_input = m->info.dim;
    for (int32_t i = 0; i < m->n_matrices; i++)
        if (m->matrices[i]->cols > m->widest_input) m->widest_input = m->matrices[i]->cols;
    return KR_OK;
}

// --- API

kr_model *kr_model_open(const char *path, int32_t n_threads, kr_error *err) {
    if (!path) {
        kr_fail(err, KR_ERR_ARGUMENT, "model path is NULL");
        return NULL;
    }
    if (n_threads < 1 || n_threads > MAX_THREADS) {
        kr_fail(err, KR_ERR_ARGUMENT, "threads = %d, expected 1 to %d", n_threads, MAX_THREADS);
        return NULL;
    }
    kr_model *m = calloc(1, sizeof *m);
    if (!m) {
        kr_fail(err, KR_ERR_MEMORY, "out of memory opening %s", path);
        return NULL;
    }
    m->file = kr_file_open(path, KR_MODEL_MAGIC, err);
    if (!m->file) goto fail;
    const char *arch;
    if (load_string(m, path, "arch", &arch, err)) goto fail;
    for (size_t i = 0; i < sizeof ARCHS / sizeof ARCHS[0]; i++)
        if (!strcmp(arch, ARCHS[i]->name)) m->arch = ARCHS[i];
    if (!m->arch) {
        kr_fail(err, KR_ERR_UNSUPPORTED, "%s: architecture '%.64s' is not supported (" ARCH_NAMES ")", path, arch);
        goto fail;
    }
    snprintf(m->info.arch, sizeof m->info.arch, "%s", m->arch->name);
    if (load_hparams(m, path, err) || m->arch->open(m, path, err) || list_matrices(m, path, err) ||
        bind_embeddings(m, path, err) || rope_frequencies(m, path, err))
        goto fail;
    m->pool = kr_pool_new(n_threads, err);
    if (!m->pool) goto fail;
    m->info.n_threads = n_threads;
    atomic_init(&m->busy, 0);
    kr_ok(err);
    return m;
fail:
    kr_model_close(m);
    return NULL;
}

void kr_model_close(kr_model *m) {
    if (!m) return;
    kr_pool_free(m->pool);
    if (m->arch) m->arch->close(m);
    kr_pack_free(m->pack);
    free(m->matrices);
    for (int32_t i = 0; i < m->n_vectors; i++) free(m->vectors[i]);
    free(m->vectors);
    free(m->inv_freq_full);
    free(m->inv_freq_local);
    kr_file_close(m->file);
    free(m);
}

int kr_model_get_info(const kr_model *m, kr_model_info *info, kr_error *err) {
    if (!m || !info) return kr_fail(err, KR_ERR_ARGUMENT, "kr_model_get_info: NULL argument");
    *info = m->info;
    kr_ok(err);
    return KR_OK;
}

const kr_file *kr_model_file(const kr_model *m) { return m ? m->file : NULL; }
