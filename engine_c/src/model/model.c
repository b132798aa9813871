// model.c: open a .mlb with its architecture's implementation (the loader helpers they share are
// loader.c's): the common hyperparameters, the embeddings and output head, the RoPE frequencies.
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

static const kr_arch *const ARCHS[] = {&kr_arch_llama, &kr_arch_qwen2, &kr_arch_gemma3, &kr_arch_qwen3,
                                       &kr_arch_mistral, &kr_arch_phi3, &kr_arch_smollm3, &kr_arch_qwen35,
                                       &kr_arch_bert, &kr_arch_nomic_bert, &kr_arch_qwen3moe, &kr_arch_mixtral,
                                       &kr_arch_olmoe, &kr_arch_gpt_oss};
#define ARCH_NAMES \
    "llama, qwen2, gemma3, qwen3, mistral, phi3, smollm3, qwen35, bert, nomic-bert, qwen3moe, mixtral, olmoe, gpt-oss"

// --- Metadata

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
    bool rope = !m->arch->encoder || m->arch->rotary;  // bert has absolute positions (model.h)
    if ((status = kr_load_float(m, path, "norm_eps", true, 0, 0, true, 1, &h->norm_eps, err)) ||
        (status = kr_load_float(m, path, "rope_theta", rope, 10000, 0, true, 1e12, &h->rope_theta, err)) ||
        (status = kr_load_float(m, path, "rope_theta_local", false, h->rope_theta, 0, true, 1e12,
                                &h->rope_theta_local, err)) ||
        (status = kr_load_float(m, path, "rope_scale", false, 1, 0, true, 1e6, &h->rope_scale, err)) ||
        (status = kr_load_float(m, path, "embedding_scale", false, 1, 0, true, 1e6, &h->embedding_scale, err)) ||
        (status = kr_load_float(m, path, "attn_scale", false, 1 / sqrt((double)h->head_dim), 0, true, 1e6,
                                &h->attn_scale, err)) ||
        (status = kr_load_float(m, path, "attn_softcap", false, 0, 0, false, 1e6, &h->attn_softcap, err)) ||
        (status = kr_load_float(m, path, "final_softcap", false, 0, 0, false, 1e6, &h->final_softcap, err)))
        return status;
    m->q_dim = h->n_heads * h->head_dim;
    m->kv_dim = h->n_kv_heads * h->head_dim;
    if (!rope) return KR_OK;  // the encoder reads its activation itself
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

// --- Tensors

// After the layers: token_embd, output_norm, output (or the tied embedding); then the weight and
// output types and the file's counts.
static int bind_embeddings(kr_model *m, const char *path, kr_error *err) {
    kr_model_info *h = &m->info;
    int status;
    if ((status = kr_bind_matrix(m, path, "token_embd.weight", h->n_vocab, h->dim, &m->token_embd, err)))
        return status;
    if (m->arch->encoder) {  // no head: the output type is the embedding's
        m->output.type = m->token_embd.type;
    } else if ((status = kr_bind_f32(m, path, "output_norm.weight", h->dim, 0, &m->output_norm, err))) {
        return status;
    } else if (h->tied_embeddings) {
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
    if (m->pack) m->pack_free(m->pack);
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
