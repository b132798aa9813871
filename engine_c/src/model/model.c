// model.c: open a .mlb, read and validate its hyperparameters, bind its tensors.
//
// Every metadata key of docs/formats.md is read here and checked for a sane value; every tensor
// the forward pass reads is looked up by name and checked for type and shape, so forward.c can
// trust the model completely. Anything unsupported is refused with a message naming it.
#include "kernels/kernels.h"
#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// Limits that keep every size computed from them far from overflow.
#define MAX_VOCAB (1 << 24)
#define MAX_DIM (1 << 16)
#define MAX_FFN (1 << 18)
#define MAX_LAYERS 1024
#define MAX_HEADS 1024
#define MAX_HEAD_DIM 1024
#define MAX_SEQ (1 << 24)
#define MAX_THREADS 256

typedef struct {
    const kr_file *file;
    const char *path;
    kr_error *err;
} reader;

// --- Metadata

static int read_required_int(reader *r, const char *key, int64_t low, int64_t high, int32_t *out) {
    if (kr_file_find_meta(r->file, key) < 0)
        return kr_fail(r->err, KR_ERR_FORMAT, "%s: metadata %s is missing", r->path, key);
    int64_t value;
    int status = kr_file_get_int(r->file, key, 0, &value, r->err);
    if (status) return status;
    if (value < low || value > high)
        return kr_fail(r->err, KR_ERR_FORMAT, "%s: metadata %s = %lld, expected %lld to %lld", r->path, key,
                       (long long)value, (long long)low, (long long)high);
    *out = (int32_t)value;
    return KR_OK;
}

static int read_optional_int(reader *r, const char *key, int64_t fallback, int64_t low, int64_t high, int32_t *out) {
    int64_t value;
    int status = kr_file_get_int(r->file, key, fallback, &value, r->err);
    if (status) return status;
    if (value < low || value > high)
        return kr_fail(r->err, KR_ERR_FORMAT, "%s: metadata %s = %lld, expected %lld to %lld", r->path, key,
                       (long long)value, (long long)low, (long long)high);
    *out = (int32_t)value;
    return KR_OK;
}

// A float in [low, high] (strict bounds when `strict_low`), NaN and infinities refused.
static int read_float(reader *r, const char *key, bool required, double fallback, double low, bool strict_low,
                      double high, float *out) {
    if (required && kr_file_find_meta(r->file, key) < 0)
        return kr_fail(r->err, KR_ERR_FORMAT, "%s: metadata %s is missing", r->path, key);
    double value;
    int status = kr_file_get_float(r->file, key, fallback, &value, r->err);
    if (status) return status;
    if (!isfinite(value) || value < low || (strict_low && value == low) || value > high)
        return kr_fail(r->err, KR_ERR_FORMAT, "%s: metadata %s = %g, expected %s%g to %g", r->path, key, value,
                       strict_low ? "more than " : "", low, high);
    *out = (float)value;
    return KR_OK;
}

static int read_string(reader *r, const char *key, bool required, const char *fallback, const char **out) {
    if (required && kr_file_find_meta(r->file, key) < 0)
        return kr_fail(r->err, KR_ERR_FORMAT, "%s: metadata %s is missing", r->path, key);
    return kr_file_get_str(r->file, key, fallback, out, r->err);
}

static int read_hparams(reader *r, kr_model *m) {
    kr_model_info *h = &m->info;
    const char *arch, *name, *rope_style, *activation;
    int status;
    if ((status = read_string(r, "arch", true, NULL, &arch))) return status;
    if (!strcmp(arch, "qwen35"))
        return kr_fail(r->err, KR_ERR_UNSUPPORTED, "%s: architecture qwen35 (linear attention) is not supported yet",
                       r->path);
    if (strcmp(arch, "llama") && strcmp(arch, "qwen2") && strcmp(arch, "gemma3"))
        return kr_fail(r->err, KR_ERR_UNSUPPORTED, "%s: architecture '%.64s' is not supported (llama, qwen2, gemma3)",
                       r->path, arch);
    snprintf(h->arch, sizeof h->arch, "%s", arch);
    if ((status = read_string(r, "name", false, "", &name))) return status;
    snprintf(h->name, sizeof h->name, "%s", name);

    if ((status = read_required_int(r, "n_vocab", 1, MAX_VOCAB, &h->n_vocab)) ||
        (status = read_required_int(r, "dim", 1, MAX_DIM, &h->dim)) ||
        (status = read_required_int(r, "n_layers", 1, MAX_LAYERS, &h->n_layers)) ||
        (status = read_required_int(r, "n_heads", 1, MAX_HEADS, &h->n_heads)) ||
        (status = read_required_int(r, "n_kv_heads", 1, MAX_HEADS, &h->n_kv_heads)) ||
        (status = read_required_int(r, "head_dim", 2, MAX_HEAD_DIM, &h->head_dim)) ||
        (status = read_required_int(r, "ffn_dim", 1, MAX_FFN, &h->ffn_dim)) ||
        (status = read_required_int(r, "max_seq", 1, MAX_SEQ, &h->max_seq)))
        return status;
    if (h->n_heads % h->n_kv_heads)
        return kr_fail(r->err, KR_ERR_FORMAT, "%s: n_heads %d is not a multiple of n_kv_heads %d", r->path, h->n_heads,
                       h->n_kv_heads);
    if (h->head_dim % 2)
        return kr_fail(r->err, KR_ERR_FORMAT, "%s: head_dim %d is odd (RoPE rotates pairs)", r->path, h->head_dim);
    if ((int64_t)h->n_heads * h->head_dim > MAX_FFN)
        return kr_fail(r->err, KR_ERR_FORMAT, "%s: n_heads * head_dim = %lld is too large", r->path,
                       (long long)h->n_heads * h->head_dim);
    if ((status = read_optional_int(r, "rope_dims", h->head_dim, 2, h->head_dim, &h->rope_dims))) return status;
    if (h->rope_dims % 2)
        return kr_fail(r->err, KR_ERR_FORMAT, "%s: rope_dims %d is odd", r->path, h->rope_dims);
    if ((status = read_optional_int(r, "tied_embeddings", 0, 0, 1, &h->tied_embeddings)) ||
        (status = read_optional_int(r, "sliding_window", 0, 0, MAX_SEQ, &h->sliding_window)))
        return status;

    if ((status = read_float(r, "norm_eps", true, 0, 0, true, 1, &h->norm_eps)) ||
        (status = read_float(r, "rope_theta", true, 0, 0, true, 1e12, &h->rope_theta)) ||
        (status = read_float(r, "rope_theta_local", false, h->rope_theta, 0, true, 1e12, &h->rope_theta_local)) ||
        (status = read_float(r, "rope_scale", false, 1, 0, true, 1e6, &h->rope_scale)) ||
        (status = read_float(r, "embedding_scale", false, 1, 0, true, 1e6, &h->embedding_scale)) ||
        (status = read_float(r, "attn_scale", false, 1 / sqrt((double)h->head_dim), 0, true, 1e6, &h->attn_scale)) ||
        (status = read_float(r, "attn_softcap", false, 0, 0, false, 1e6, &h->attn_softcap)) ||
        (status = read_float(r, "final_softcap", false, 0, 0, false, 1e6, &h->final_softcap)))
        return status;

    if ((status = read_string(r, "rope_style", true, NULL, &rope_style))) return status;
    if (!strcmp(rope_style, "norm")) h->rope_style = KR_ROPE_NORM;
    else if (!strcmp(rope_style, "neox")) h->rope_style = KR_ROPE_NEOX;
    else return kr_fail(r->err, KR_ERR_UNSUPPORTED, "%s: rope_style '%.64s' is not supported (norm, neox)", r->path,
                        rope_style);
    if ((status = read_string(r, "activation", true, NULL, &activation))) return status;
    if (!strcmp(activation, "silu")) h->activation = KR_ACT_SILU;
    else if (!strcmp(activation, "gelu_tanh")) h->activation = KR_ACT_GELU_TANH;
    else return kr_fail(r->err, KR_ERR_UNSUPPORTED, "%s: activation '%.64s' is not supported (silu, gelu_tanh)",
                        r->path, activation);

    m->q_dim = h->n_heads * h->head_dim;
    m->kv_dim = h->n_kv_heads * h->head_dim;
    return KR_OK;
}

// layer_types: absent means every layer is full attention.
static int read_layer_types(reader *r, kr_model *m) {
    kr_model_info *h = &m->info;
    int32_t index = kr_file_find_meta(r->file, "layer_types");
    if (index < 0) return KR_OK;
    int32_t kind;
    uint32_t count;
    int status = kr_file_meta(r->file, index, NULL, &kind, NULL, NULL, NULL, &count, r->err);
    if (status) return status;
    if (kind != KR_META_INTS)
        return kr_fail(r->err, KR_ERR_FORMAT, "%s: metadata layer_types should be a list of integers", r->path);
    if (count != (uint32_t)h->n_layers)
        return kr_fail(r->err, KR_ERR_FORMAT, "%s: layer_types has %u entries for %d layers", r->path, count,
                       h->n_layers);
    for (int32_t i = 0; i < h->n_layers; i++) {
        int64_t type = kr_file_meta_int_at(r->file, index, (uint32_t)i);
        if (type == 2)
            return kr_fail(r->err, KR_ERR_UNSUPPORTED, "%s: layer %d is linear attention, not supported yet", r->path, i);
        if (type != 0 && type != 1)
            return kr_fail(r->err, KR_ERR_FORMAT, "%s: layer_types[%d] = %lld, expected 0, 1 or 2", r->path, i,
                           (long long)type);
        m->layers[i].sliding = (int32_t)type;
        h->n_sliding_layers += (int32_t)type;
    }
    if (h->n_sliding_layers && !h->sliding_window)
        return kr_fail(r->err, KR_ERR_FORMAT, "%s: %d sliding-window layers but sliding_window is 0", r->path,
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

static bool is_matrix_type(int32_t type) { return kr_kernel_type_supported(type); }

static int bind_matrix(reader *r, const char *name, int64_t rows, int64_t cols, kr_matrix *out) {
    kr_tensor_info t;
    int status = kr_file_find_tensor(r->file, name, &t, r->err);
    if (status) return status;
    if (!is_matrix_type(t.type))
        return kr_fail(r->err, KR_ERR_UNSUPPORTED, "%s: tensor %s has type %s; weights must be f32, f16, bf16, q8_0, q4_0, q4_K, q5_K or q6_K",
                       r->path, name, kr_type_name(t.type));
    if (t.n_dims != 2 || t.dims[0] != (uint64_t)rows || t.dims[1] != (uint64_t)cols) {
        char shape[128];
        return kr_fail(r->err, KR_ERR_FORMAT, "%s: tensor %s has shape %s, expected (%lld, %lld)", r->path, name,
                       format_shape(&t, shape, sizeof shape), (long long)rows, (long long)cols);
    }
    out->type = t.type;
    out->data = t.data;
    out->rows = rows;
    out->cols = cols;
    out->row_bytes = kr_type_size(t.type, (uint64_t)cols);
    return KR_OK;
}

// An f32 vector of `length`: a norm weight or a bias.
static int bind_vector(reader *r, const char *name, int64_t length, const float **out) {
    kr_tensor_info t;
    int status = kr_file_find_tensor(r->file, name, &t, r->err);
    if (status) return status;
    if (t.type != KR_F32)
        return kr_fail(r->err, KR_ERR_FORMAT, "%s: tensor %s has type %s, expected f32", r->path, name,
                       kr_type_name(t.type));
    if (t.n_dims != 1 || t.dims[0] != (uint64_t)length) {
        char shape[128];
        return kr_fail(r->err, KR_ERR_FORMAT, "%s: tensor %s has shape %s, expected (%lld,)", r->path, name,
                       format_shape(&t, shape, sizeof shape), (long long)length);
    }
    *out = (const float *)t.data;
    return KR_OK;
}

static int bind_layer(reader *r, kr_model *m, int32_t i) {
    const kr_model_info *h = &m->info;
    kr_layer *l = &m->layers[i];
    bool qwen2 = !strcmp(h->arch, "qwen2"), gemma3 = !strcmp(h->arch, "gemma3");
    char name[96];
    int status;
#define NAME(suffix) (snprintf(name, sizeof name, "blk.%d.%s", i, suffix), name)
    if ((status = bind_vector(r, NAME("attn_norm.weight"), h->dim, &l->attn_norm)) ||
        (status = bind_matrix(r, NAME("attn_q.weight"), m->q_dim, h->dim, &l->wq)) ||
        (status = bind_matrix(r, NAME("attn_k.weight"), m->kv_dim, h->dim, &l->wk)) ||
        (status = bind_matrix(r, NAME("attn_v.weight"), m->kv_dim, h->dim, &l->wv)) ||
        (status = bind_matrix(r, NAME("attn_output.weight"), h->dim, m->q_dim, &l->wo)) ||
        (status = bind_vector(r, NAME("ffn_norm.weight"), h->dim, &l->ffn_norm)) ||
        (status = bind_matrix(r, NAME("ffn_gate.weight"), h->ffn_dim, h->dim, &l->gate)) ||
        (status = bind_matrix(r, NAME("ffn_up.weight"), h->ffn_dim, h->dim, &l->up)) ||
        (status = bind_matrix(r, NAME("ffn_down.weight"), h->dim, h->ffn_dim, &l->down)))
        return status;
    if (qwen2 && ((status = bind_vector(r, NAME("attn_q.bias"), m->q_dim, &l->bq)) ||
                  (status = bind_vector(r, NAME("attn_k.bias"), m->kv_dim, &l->bk)) ||
                  (status = bind_vector(r, NAME("attn_v.bias"), m->kv_dim, &l->bv))))
        return status;
    if (gemma3 && ((status = bind_vector(r, NAME("attn_q_norm.weight"), h->head_dim, &l->q_norm)) ||
                   (status = bind_vector(r, NAME("attn_k_norm.weight"), h->head_dim, &l->k_norm)) ||
                   (status = bind_vector(r, NAME("post_attention_norm.weight"), h->dim, &l->post_attn_norm)) ||
                   (status = bind_vector(r, NAME("post_ffw_norm.weight"), h->dim, &l->post_ffw_norm))))
        return status;
#undef NAME
    return KR_OK;
}

static int bind_tensors(reader *r, kr_model *m) {
    kr_model_info *h = &m->info;
    int status;
    if ((status = bind_matrix(r, "token_embd.weight", h->n_vocab, h->dim, &m->token_embd)) ||
        (status = bind_vector(r, "output_norm.weight", h->dim, &m->output_norm)))
        return status;
    if (h->tied_embeddings) {
        if (kr_file_find_tensor_index(r->file, "output.weight") >= 0)
            return kr_fail(r->err, KR_ERR_FORMAT, "%s: tied_embeddings is 1 but output.weight is present", r->path);
        m->output = m->token_embd;
    } else if ((status = bind_matrix(r, "output.weight", h->n_vocab, h->dim, &m->output))) {
        return status;
    }
    for (int32_t i = 0; i < h->n_layers; i++)
        if ((status = bind_layer(r, m, i))) return status;
    h->weight_type = m->layers[0].wq.type;
    h->output_type = m->output.type;
    for (int32_t i = 0; i < kr_file_n_tensors(r->file); i++) {
        kr_tensor_info t;
        kr_file_tensor(r->file, i, &t, NULL);
        h->n_params += t.n_elements;
        h->n_bytes += t.n_bytes;
    }
    return KR_OK;
}

// RoPE frequencies theta^(-2i/rope_dims); full-attention layers divide positions by rope_scale.
static void rope_frequencies(kr_model *m) {
    const kr_model_info *h = &m->info;
    for (int32_t i = 0; i < h->rope_dims / 2; i++) {
        double exponent = (2.0 * i) / h->rope_dims;
        m->inv_freq_full[i] = (float)(1.0 / pow(h->rope_theta, exponent) / h->rope_scale);
        m->inv_freq_local[i] = (float)(1.0 / pow(h->rope_theta_local, exponent));
    }
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
    // --- qwen35 hook: the hybrid model binds its own layers (forward_qwen35.c)
    if (kr_qwen35_is(m->file)) {
        if (kr_qwen35_open(m, path, err)) goto fail;
        goto pool;
    }
    // --- end qwen35 hook
    reader r = {m->file, path, err};
    if (read_hparams(&r, m)) goto fail;
    m->layers = calloc((size_t)m->info.n_layers, sizeof *m->layers);
    m->inv_freq_full = calloc((size_t)m->info.rope_dims / 2, sizeof(float));
    m->inv_freq_local = calloc((size_t)m->info.rope_dims / 2, sizeof(float));
    if (!m->layers || !m->inv_freq_full || !m->inv_freq_local) {
        kr_fail(err, KR_ERR_MEMORY, "out of memory opening %s", path);
        goto fail;
    }
    if (read_layer_types(&r, m) || bind_tensors(&r, m)) goto fail;
    rope_frequencies(m);
pool:
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
    kr_qwen35_free(m->ext);  // qwen35 hook
    kr_pack_free(m->pack);   // speed hook: packed weights
    free(m->layers);
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
