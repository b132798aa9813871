// forward_qwen35.c: Qwen3.5's hybrid text model (owner: qwen35). Loaded and run through small
// hooks in model.c and forward.c, so the rest of the API (kr_model_*, kr_session_*) is unchanged.
//
// Layers follow `layer_types`: 2 is a gated DeltaNet (linear attention) layer, 0 a gated
// full-attention layer. Each layer is  x += mixer(norm(x));  x += mlp(norm(x))  with SwiGLU.
//
// DeltaNet layer, per token t (transformers' Qwen3_5GatedDeltaNet, recurrent form):
//   mixed = xb Wqkv^T  -> causal depthwise conv1d over the last `kernel` inputs (a rolling state
//   of kernel-1 inputs per channel), then silu -> split into q (key_dim), k (key_dim), v (value_dim)
//   q, k per key head: l2-normalised (eps 1e-6), q also divided by sqrt(k_head_dim)
//   beta = sigmoid(xb Wb^T), g = ssm_a * softplus(xb Wa^T + dt_bias), ssm_a = -exp(A_log)
//   per value head h (key head h / (v_heads / k_heads)), state S (k_dim x v_dim), kept as S^T:
//     S *= exp(g);  delta = (v - S^T k) * beta;  S += k delta^T;  o = S^T q
//   o = rmsnorm(o per head) * ssm_norm * silu(xb Wz^T);  out = o Wout^T
// Full-attention layer: xb Wq^T gives per head [q | gate]; q/k RMSNorm per head (1+w stored),
// RoPE (neox) on the first rope_dims of each head, causal softmax attention over the KV cache,
// times sigmoid(gate), then Wo.
//
// Every value of a token is computed by the same code whatever the batch and thread split (the
// matmul kernels' contract; the recurrence runs token after token in one thread per value
// head), so logits and states are bitwise identical for any batch size and thread count. The
// recurrent state cannot be cut back: a session can only be truncated to 0 or its length.
#include "kernels/kernels.h"
#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ROW_ALIGN 16
// One chunk per thread: each chunk's results do not depend on which thread runs it.
#define CHUNKS(pool) kr_pool_size(pool)
#define MAX_DIM (1 << 16)
#define MAX_LAYERS 1024

typedef struct {
    int32_t linear;
    const float *attn_norm, *ffn_norm;
    kr_matrix wq, wk, wv, wo;            // full attention; wq rows: per head [q (head_dim) | gate (head_dim)]
    const float *q_norm, *k_norm;
    kr_matrix qkv, z, beta, alpha, out;  // DeltaNet
    const float *conv, *dt_bias, *a, *ssm_norm;
    kr_matrix gate, up, down;
    int32_t slot;                        // index among the layers of its kind
} q35_layer;

typedef struct {
    int32_t kernel, nk, nv, dk, dv, key_dim, value_dim, conv_dim;
    int32_t n_linear, n_full;
    q35_layer *layers;
} q35_model;

typedef struct {
    kr_model *m;
    q35_model *q;
    int32_t n_ctx, n_batch, kv_type;
    size_t kv_elem;
    float *conv_state;   // (n_linear, conv_dim, kernel - 1): the last inputs, oldest first
    float *ssm_state;    // (n_linear, nv, dv, dk): S^T per value head
    uint8_t *k_cache;    // (n_full, n_kv_heads, n_ctx, head_dim)
    uint8_t *v_cache;    // (n_full, n_kv_heads, n_ctx, head_dim)
    float *x, *xb, *proj, *qg, *qh, *k, *v, *att, *gate, *up;
    float *mixed, *conv_out, *z, *b, *a, *core;
    float *scores;       // (n_threads, n_ctx)
    float *rope_cos, *rope_sin;  // (n_batch, rope_dims / 2)
    void *prepared[KR_TYPE_COUNT];
} q35_state;

// --- Loading

static int get_int(const kr_file *f, const char *path, const char *key, int64_t low, int64_t high, int32_t *out,
                   kr_error *err) {
    if (kr_file_find_meta(f, key) < 0) return kr_fail(err, KR_ERR_FORMAT, "%s: metadata %s is missing", path, key);
    int64_t value;
    int status = kr_file_get_int(f, key, 0, &value, err);
    if (status) return status;
    if (value < low || value > high)
        return kr_fail(err, KR_ERR_FORMAT, "%s: metadata %s = %lld, expected %lld to %lld", path, key,
                       (long long)value, (long long)low, (long long)high);
    *out = (int32_t)value;
    return KR_OK;
}

static int get_float(const kr_file *f, const char *path, const char *key, double fallback, double low, double high,
                     float *out, kr_error *err) {
    double value;
    int status = kr_file_get_float(f, key, fallback, &value, err);
    if (status) return status;
    if (!isfinite(value) || value <= low || value > high)
        return kr_fail(err, KR_ERR_FORMAT, "%s: metadata %s = %g, expected more than %g to %g", path, key, value, low,
                       high);
    *out = (float)value;
    return KR_OK;
}

static int bind_matrix(const kr_file *f, const char *path, const char *name, int64_t rows, int64_t cols,
                       kr_matrix *out, kr_error *err) {
    kr_tensor_info t;
    int status = kr_file_find_tensor(f, name, &t, err);
    if (status) return status;
    if (!kr_kernel_type_supported(t.type))
        return kr_fail(err, KR_ERR_UNSUPPORTED, "%s: tensor %s has type %s; weights must be f32, f16, bf16, q8_0 or q4_0",
                       path, name, kr_type_name(t.type));
    if (t.n_dims != 2 || t.dims[0] != (uint64_t)rows || t.dims[1] != (uint64_t)cols)
        return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %s has the wrong shape, expected (%lld, %lld)", path, name,
                       (long long)rows, (long long)cols);
    out->type = t.type, out->data = t.data, out->rows = rows, out->cols = cols;
    out->row_bytes = kr_type_size(t.type, (uint64_t)cols);
    return KR_OK;
}

// An f32 tensor of `count` elements (shape (count,) or (rows, count / rows) for the conv weights).
static int bind_f32(const kr_file *f, const char *path, const char *name, int64_t d0, int64_t d1, const float **out,
                    kr_error *err) {
    kr_tensor_info t;
    int status = kr_file_find_tensor(f, name, &t, err);
    if (status) return status;
    bool ok = t.type == KR_F32 && (d1 ? (t.n_dims == 2 && t.dims[0] == (uint64_t)d0 && t.dims[1] == (uint64_t)d1)
                                      : (t.n_dims == 1 && t.dims[0] == (uint64_t)d0));
    if (!ok)
        return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %s must be f32 of shape (%lld%s%lld)", path, name, (long long)d0,
                       d1 ? ", " : ",", (long long)(d1 ? d1 : 0));
    *out = (const float *)t.data;
    return KR_OK;
}

int kr_qwen35_is(const kr_file *file) {
    const char *arch = NULL;
    if (kr_file_get_str(file, "arch", "", &arch, NULL)) return 0;
    return arch && !strcmp(arch, "qwen35");
}

static int bind_layers(kr_model *m, q35_model *q, const char *path, kr_error *err) {
    const kr_file *f = m->file;
    const kr_model_info *h = &m->info;
    char name[96];
    int status;
#define NAME(suffix) (snprintf(name, sizeof name, "blk.%d.%s", i, suffix), name)
    for (int32_t i = 0; i < h->n_layers; i++) {
        q35_layer *l = &q->layers[i];
        if ((status = bind_f32(f, path, NAME("attn_norm.weight"), h->dim, 0, &l->attn_norm, err)) ||
            (status = bind_f32(f, path, NAME("ffn_norm.weight"), h->dim, 0, &l->ffn_norm, err)) ||
            (status = bind_matrix(f, path, NAME("ffn_gate.weight"), h->ffn_dim, h->dim, &l->gate, err)) ||
            (status = bind_matrix(f, path, NAME("ffn_up.weight"), h->ffn_dim, h->dim, &l->up, err)) ||
            (status = bind_matrix(f, path, NAME("ffn_down.weight"), h->dim, h->ffn_dim, &l->down, err)))
            return status;
        if (l->linear) {
            if ((status = bind_matrix(f, path, NAME("attn_qkv.weight"), q->conv_dim, h->dim, &l->qkv, err)) ||
                (status = bind_matrix(f, path, NAME("attn_gate.weight"), q->value_dim, h->dim, &l->z, err)) ||
                (status = bind_matrix(f, path, NAME("ssm_beta.weight"), q->nv, h->dim, &l->beta, err)) ||
                (status = bind_matrix(f, path, NAME("ssm_alpha.weight"), q->nv, h->dim, &l->alpha, err)) ||
                (status = bind_matrix(f, path, NAME("ssm_out.weight"), h->dim, q->value_dim, &l->out, err)) ||
                (status = bind_f32(f, path, NAME("ssm_conv1d.weight"), q->conv_dim, q->kernel, &l->conv, err)) ||
                (status = bind_f32(f, path, NAME("ssm_dt.bias"), q->nv, 0, &l->dt_bias, err)) ||
                (status = bind_f32(f, path, NAME("ssm_a"), q->nv, 0, &l->a, err)) ||
                (status = bind_f32(f, path, NAME("ssm_norm.weight"), q->dv, 0, &l->ssm_norm, err)))
                return status;
        } else {
            if ((status = bind_matrix(f, path, NAME("attn_q.weight"), 2 * (int64_t)m->q_dim, h->dim, &l->wq, err)) ||
                (status = bind_matrix(f, path, NAME("attn_k.weight"), m->kv_dim, h->dim, &l->wk, err)) ||
                (status = bind_matrix(f, path, NAME("attn_v.weight"), m->kv_dim, h->dim, &l->wv, err)) ||
                (status = bind_matrix(f, path, NAME("attn_output.weight"), h->dim, m->q_dim, &l->wo, err)) ||
                (status = bind_f32(f, path, NAME("attn_q_norm.weight"), h->head_dim, 0, &l->q_norm, err)) ||
                (status = bind_f32(f, path, NAME("attn_k_norm.weight"), h->head_dim, 0, &l->k_norm, err)))
                return status;
        }
    }
#undef NAME
    return KR_OK;
}

int kr_qwen35_open(kr_model *m, const char *path, kr_error *err) {
    const kr_file *f = m->file;
    kr_model_info *h = &m->info;
    const char *name = "";
    int status;
    q35_model *q = calloc(1, sizeof *q);
    if (!q) return kr_fail(err, KR_ERR_MEMORY, "out of memory opening %s", path);
    m->ext = q;
    snprintf(h->arch, sizeof h->arch, "qwen35");
    if ((status = kr_file_get_str(f, "name", "", &name, err))) return status;
    snprintf(h->name, sizeof h->name, "%s", name);
    if ((status = get_int(f, path, "n_vocab", 1, 1 << 24, &h->n_vocab, err)) ||
        (status = get_int(f, path, "dim", 1, MAX_DIM, &h->dim, err)) ||
        (status = get_int(f, path, "n_layers", 1, MAX_LAYERS, &h->n_layers, err)) ||
        (status = get_int(f, path, "n_heads", 1, 1024, &h->n_heads, err)) ||
        (status = get_int(f, path, "n_kv_heads", 1, 1024, &h->n_kv_heads, err)) ||
        (status = get_int(f, path, "head_dim", 2, 1024, &h->head_dim, err)) ||
        (status = get_int(f, path, "ffn_dim", 1, 1 << 18, &h->ffn_dim, err)) ||
        (status = get_int(f, path, "max_seq", 1, 1 << 24, &h->max_seq, err)) ||
        (status = get_int(f, path, "rope_dims", 2, h->head_dim, &h->rope_dims, err)) ||
        (status = get_int(f, path, "tied_embeddings", 0, 1, &h->tied_embeddings, err)) ||
        (status = get_int(f, path, "linear_conv_kernel", 1, 64, &q->kernel, err)) ||
        (status = get_int(f, path, "linear_k_heads", 1, 1024, &q->nk, err)) ||
        (status = get_int(f, path, "linear_v_heads", 1, 1024, &q->nv, err)) ||
        (status = get_int(f, path, "linear_k_head_dim", 1, 1024, &q->dk, err)) ||
        (status = get_int(f, path, "linear_v_head_dim", 1, 1024, &q->dv, err)))
        return status;
    if (h->n_heads % h->n_kv_heads || q->nv % q->nk || h->rope_dims % 2)
        return kr_fail(err, KR_ERR_FORMAT, "%s: heads (%d, %d kv; %d linear v, %d linear k) or rope_dims %d do not fit",
                       path, h->n_heads, h->n_kv_heads, q->nv, q->nk, h->rope_dims);
    if ((status = get_float(f, path, "norm_eps", 1e-6, 0, 1, &h->norm_eps, err)) ||
        (status = get_float(f, path, "rope_theta", 1e7, 0, 1e12, &h->rope_theta, err)) ||
        (status = get_float(f, path, "attn_scale", 1 / sqrt((double)h->head_dim), 0, 1e6, &h->attn_scale, err)))
        return status;
    const char *style = NULL, *activation = NULL;
    if ((status = kr_file_get_str(f, "rope_style", "neox", &style, err)) ||
        (status = kr_file_get_str(f, "activation", "silu", &activation, err)))
        return status;
    if (strcmp(style, "neox") || strcmp(activation, "silu"))
        return kr_fail(err, KR_ERR_UNSUPPORTED, "%s: qwen35 needs rope_style neox and activation silu", path);
    h->rope_style = KR_ROPE_NEOX, h->activation = KR_ACT_SILU;
    h->rope_theta_local = h->rope_theta, h->rope_scale = 1, h->embedding_scale = 1;
    q->key_dim = q->nk * q->dk, q->value_dim = q->nv * q->dv, q->conv_dim = 2 * q->key_dim + q->value_dim;
    m->q_dim = h->n_heads * h->head_dim, m->kv_dim = h->n_kv_heads * h->head_dim;

    q->layers = calloc((size_t)h->n_layers, sizeof *q->layers);
    m->inv_freq_full = calloc((size_t)h->rope_dims / 2, sizeof(float));
    if (!q->layers || !m->inv_freq_full) return kr_fail(err, KR_ERR_MEMORY, "out of memory opening %s", path);
    int32_t index = kr_file_find_meta(f, "layer_types");
    uint32_t count = 0;
    int32_t kind = 0;
    if (index < 0 || kr_file_meta(f, index, NULL, &kind, NULL, NULL, NULL, &count, NULL) || kind != KR_META_INTS ||
        count != (uint32_t)h->n_layers)
        return kr_fail(err, KR_ERR_FORMAT, "%s: qwen35 needs layer_types, one integer per layer", path);
    for (int32_t i = 0; i < h->n_layers; i++) {
        int64_t type = kr_file_meta_int_at(f, index, (uint32_t)i);
        if (type != 0 && type != 2)
            return kr_fail(err, KR_ERR_FORMAT, "%s: layer_types[%d] = %lld, qwen35 has 0 (full) and 2 (linear)", path,
                           i, (long long)type);
        q->layers[i].linear = type == 2;
        q->layers[i].slot = type == 2 ? q->n_linear++ : q->n_full++;
    }
    if ((status = bind_matrix(f, path, "token_embd.weight", h->n_vocab, h->dim, &m->token_embd, err)) ||
        (status = bind_f32(f, path, "output_norm.weight", h->dim, 0, &m->output_norm, err)))
        return status;
    if (h->tied_embeddings) m->output = m->token_embd;
    else if ((status = bind_matrix(f, path, "output.weight", h->n_vocab, h->dim, &m->output, err))) return status;
    if ((status = bind_layers(m, q, path, err))) return status;
    const q35_layer *first = &q->layers[0];
    h->weight_type = first->linear ? first->qkv.type : first->wq.type;
    h->output_type = m->output.type;
    for (int32_t i = 0; i < kr_file_n_tensors(f); i++) {
        kr_tensor_info t;
        kr_file_tensor(f, i, &t, NULL);
        h->n_params += t.n_elements;
        h->n_bytes += t.n_bytes;
    }
    for (int32_t i = 0; i < h->rope_dims / 2; i++)
        m->inv_freq_full[i] = (float)(1.0 / pow(h->rope_theta, (2.0 * i) / h->rope_dims));
    return KR_OK;
}

int kr_qwen35_matrices(kr_model *m, kr_matrix **out) {
    q35_model *q = m->ext;
    int n = 0;
    for (int32_t i = 0; i < m->info.n_layers; i++) {
        q35_layer *l = &q->layers[i];
        kr_matrix *all[] = {&l->wq, &l->wk, &l->wv, &l->wo, &l->qkv, &l->z, &l->beta, &l->alpha, &l->out,
                            &l->gate, &l->up, &l->down};
        for (size_t k = 0; k < sizeof all / sizeof all[0]; k++)
            if (all[k]->data && kr_packable(all[k]->type)) {  // a layer has either attention or DeltaNet matrices
                if (out) out[n] = all[k];
                n++;
            }
    }
    return n;
}

void kr_qwen35_free(void *ext) {
    q35_model *q = ext;
    if (!q) return;
    free(q->layers);
    free(q);
}

// --- Session state

static void *zalloc(size_t count, size_t size, bool *failed) {
    size_t bytes;
    if (__builtin_mul_overflow(count, size, &bytes)) {
        *failed = true;
        return NULL;
    }
    if (!bytes) bytes = 64;
    void *p = NULL;
    if (posix_memalign(&p, 64, bytes)) {
        *failed = true;
        return NULL;
    }
    memset(p, 0, bytes);
    return p;
}

void kr_qwen35_state_free(void *state) {
    q35_state *s = state;
    if (!s) return;
    free(s->conv_state), free(s->ssm_state), free(s->k_cache), free(s->v_cache), free(s->x), free(s->xb);
    free(s->proj), free(s->qg), free(s->qh), free(s->k), free(s->v), free(s->att), free(s->gate), free(s->up);
    free(s->mixed), free(s->conv_out), free(s->z), free(s->b), free(s->a), free(s->core), free(s->scores);
    free(s->rope_cos), free(s->rope_sin);
    for (int32_t t = 0; t < KR_TYPE_COUNT; t++) free(s->prepared[t]);
    free(s);
}

void *kr_qwen35_state_new(kr_model *m, int32_t n_ctx, int32_t kv_type, int32_t n_batch, kr_error *err) {
    q35_model *q = m->ext;
    const kr_model_info *h = &m->info;
    q35_state *s = calloc(1, sizeof *s);
    if (!s) {
        kr_fail(err, KR_ERR_MEMORY, "out of memory for a session");
        return NULL;
    }
    s->m = m, s->q = q, s->n_ctx = n_ctx, s->n_batch = n_batch, s->kv_type = kv_type;
    s->kv_elem = kv_type == KR_F32 ? 4 : 2;
    size_t b = (size_t)n_batch;
    bool failed = false;
    s->conv_state = zalloc((size_t)q->n_linear * (size_t)q->conv_dim, (size_t)(q->kernel - 1) * sizeof(float), &failed);
    s->ssm_state = zalloc((size_t)q->n_linear * (size_t)q->nv, (size_t)q->dv * (size_t)q->dk * sizeof(float), &failed);
    s->k_cache = zalloc((size_t)q->n_full * (size_t)n_ctx, (size_t)m->kv_dim * s->kv_elem, &failed);
    s->v_cache = zalloc((size_t)q->n_full * (size_t)n_ctx, (size_t)m->kv_dim * s->kv_elem, &failed);
    s->x = zalloc(b * (size_t)h->dim, sizeof(float), &failed);
    s->xb = zalloc(b * (size_t)h->dim, sizeof(float), &failed);
    s->proj = zalloc(b * (size_t)h->dim, sizeof(float), &failed);
    s->qg = zalloc(b * 2 * (size_t)m->q_dim, sizeof(float), &failed);
    s->qh = zalloc(b * (size_t)m->q_dim, sizeof(float), &failed);
    s->k = zalloc(b * (size_t)m->kv_dim, sizeof(float), &failed);
    s->v = zalloc(b * (size_t)m->kv_dim, sizeof(float), &failed);
    s->att = zalloc(b * (size_t)m->q_dim, sizeof(float), &failed);
    s->gate = zalloc(b * (size_t)h->ffn_dim, sizeof(float), &failed);
    s->up = zalloc(b * (size_t)h->ffn_dim, sizeof(float), &failed);
    s->mixed = zalloc(b * (size_t)q->conv_dim, sizeof(float), &failed);
    s->conv_out = zalloc(b * (size_t)q->conv_dim, sizeof(float), &failed);
    s->z = zalloc(b * (size_t)q->value_dim, sizeof(float), &failed);
    s->b = zalloc(b * (size_t)q->nv, sizeof(float), &failed);
    s->a = zalloc(b * (size_t)q->nv, sizeof(float), &failed);
    s->core = zalloc(b * (size_t)q->value_dim, sizeof(float), &failed);
    s->scores = zalloc((size_t)kr_pool_size(m->pool), (size_t)n_ctx * sizeof(float), &failed);
    s->rope_cos = zalloc(b * (size_t)(h->rope_dims / 2), sizeof(float), &failed);
    s->rope_sin = zalloc(b * (size_t)(h->rope_dims / 2), sizeof(float), &failed);
    int64_t widest = h->dim;
    if (m->q_dim > widest) widest = m->q_dim;
    if (h->ffn_dim > widest) widest = h->ffn_dim;
    if (q->value_dim > widest) widest = q->value_dim;
    for (int32_t t = 0; t < KR_TYPE_COUNT; t++)
        if (kr_kernel_type_supported(t)) s->prepared[t] = zalloc(kr_activation_bytes(t, n_batch, widest), 1, &failed);
    if (failed) {
        kr_fail(err, KR_ERR_MEMORY, "out of memory for a qwen35 session of context %d, batch %d", n_ctx, n_batch);
        kr_qwen35_state_free(s);
        return NULL;
    }
    kr_ok(err);
    return s;
}

// --- Pool jobs

typedef struct {
    q35_state *s;
    int32_t n, pos, layer;
    const float *input;
    int64_t cols;
    const kr_matrix *w[4];
    float *out[4];
    int32_t n_w;
} job;

static void prepare_job(void *arg, int thread, int n_threads, int worker) {
    job *j = arg;
    int64_t begin, end;
    kr_split(j->n, 1, thread, n_threads, &begin, &end);
    if (begin >= end) return;
    bool done[KR_TYPE_COUNT] = {false};
    for (int32_t i = 0; i < j->n_w; i++) {
        int32_t type = j->w[i]->type;
        if (done[type]) continue;
        done[type] = true;
        kr_prepare_activations(type, j->input, j->cols, j->s->prepared[type], begin, end);
    }
}

static void matmul_job(void *arg, int thread, int n_threads, int worker) {
    job *j = arg;
    for (int32_t i = 0; i < j->n_w; i++) {
        const kr_matrix *w = j->w[i];
        int64_t begin, end;
        kr_split(w->rows, ROW_ALIGN, thread, n_threads, &begin, &end);
        if (begin < end) kr_matrix_matmul(w, j->s->prepared[w->type], j->n, j->out[i], begin, end);
    }
}

// out_i = input W_i^T for up to four matrices reading the same (n x cols) input.
static void matmuls(q35_state *s, int32_t n, const float *input, int64_t cols, int32_t n_w, const kr_matrix *w0,
                    float *o0, const kr_matrix *w1, float *o1, const kr_matrix *w2, float *o2, const kr_matrix *w3,
                    float *o3) {
    job j = {.s = s, .n = n, .input = input, .cols = cols, .n_w = n_w};
    j.w[0] = w0, j.w[1] = w1, j.w[2] = w2, j.w[3] = w3;
    j.out[0] = o0, j.out[1] = o1, j.out[2] = o2, j.out[3] = o3;
    kr_pool_run(s->m->pool, prepare_job, &j, CHUNKS(s->m->pool));
    kr_pool_run(s->m->pool, matmul_job, &j, CHUNKS(s->m->pool));
}

static void rms_norm(const float *x, const float *weight, float *out, int64_t n, float eps) {
    float mean_square = kr_dot_f32(x, x, n) / (float)n;
    float scale = 1.0f / sqrtf(mean_square + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * scale * weight[i];
}

static float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
static float silu(float x) { return x / (1.0f + expf(-x)); }
static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }  // torch's threshold 20

// Embed (layer 0) or add proj to x; then xb = norm(x). Split by tokens.
typedef struct {
    q35_state *s;
    int32_t n;
    const int32_t *tokens;
    const float *add, *norm;
} residual;

static void residual_job(void *arg, int thread, int n_threads, int worker) {
    residual *r = arg;
    q35_state *s = r->s;
    const kr_model *m = s->m;
    int64_t dim = m->info.dim, begin, end;
    kr_split(r->n, 1, thread, n_threads, &begin, &end);
    for (int64_t t = begin; t < end; t++) {
        float *x = s->x + t * dim;
        if (r->tokens) {
            const uint8_t *row = (const uint8_t *)m->token_embd.data + (size_t)r->tokens[t] * m->token_embd.row_bytes;
            kr_dequantize_row(m->token_embd.type, row, x, dim);
        }
        if (r->add)
            for (int64_t i = 0; i < dim; i++) x[i] += r->add[t * dim + i];
        rms_norm(x, r->norm, s->xb + t * dim, dim, m->info.norm_eps);
    }
}

static void residual_step(q35_state *s, int32_t n, const int32_t *tokens, const float *add, const float *norm) {
    residual r = {s, n, tokens, add, norm};
    kr_pool_run(s->m->pool, residual_job, &r, CHUNKS(s->m->pool));
}

// Causal depthwise conv1d + silu, per channel over the step's tokens, then the rolling state
// keeps the last kernel - 1 inputs. Split by channels.
static void conv_job(void *arg, int thread, int n_threads, int worker) {
    job *j = arg;
    q35_state *s = j->s;
    const q35_model *q = s->q;
    const q35_layer *l = &q->layers[j->layer];
    int32_t K = q->kernel, C = q->conv_dim, n = j->n;
    int64_t begin, end;
    kr_split(C, 1, thread, n_threads, &begin, &end);
    float window[64 + 1];
    for (int64_t c = begin; c < end; c++) {
        float *state = s->conv_state + ((size_t)l->slot * (size_t)C + (size_t)c) * (size_t)(K - 1);
        const float *w = l->conv + c * K;
        for (int32_t t = 0; t < n; t++) {
            for (int32_t i = 0; i < K - 1; i++) window[i] = state[i];
            window[K - 1] = s->mixed[(size_t)t * C + c];
            float sum = 0;
            for (int32_t i = 0; i < K; i++) sum += w[i] * window[i];
            s->conv_out[(size_t)t * C + c] = silu(sum);
            for (int32_t i = 0; i < K - 1; i++) state[i] = window[i + 1];
        }
    }
}

// l2-normalise q and k of every key head (q also / sqrt(dk)); in place in conv_out. Split by tokens.
static void qk_norm_job(void *arg, int thread, int n_threads, int worker) {
    job *j = arg;
    q35_state *s = j->s;
    const q35_model *q = s->q;
    int64_t begin, end;
    kr_split(j->n, 1, thread, n_threads, &begin, &end);
    float q_scale = 1.0f / sqrtf((float)q->dk);
    for (int64_t t = begin; t < end; t++) {
        float *row = s->conv_out + t * q->conv_dim;
        for (int32_t part = 0; part < 2; part++)
            for (int32_t head = 0; head < q->nk; head++) {
                float *x = row + (size_t)part * q->key_dim + (size_t)head * q->dk;
                float inv = 1.0f / sqrtf(kr_dot_f32(x, x, q->dk) + 1e-6f);
                if (part == 0) inv *= q_scale;
                for (int32_t i = 0; i < q->dk; i++) x[i] *= inv;
            }
    }
}

// The two passes over one row of a value head's state per token (dk values), fused so the state
// is read twice instead of four times:
//   decay_dot:  row *= decay, returns dot(row, k)
//   update_dot: row += delta * k, returns dot(row, q)
// AVX2 with 8 lanes summed in a fixed order, or plain C; either way the same for any batch.
#if defined(KR_HAVE_AVX2)
#include <immintrin.h>
static float lanes_total(__m256 v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    return ((lanes[0] + lanes[4]) + (lanes[1] + lanes[5])) + ((lanes[2] + lanes[6]) + (lanes[3] + lanes[7]));
}

static float decay_dot(float *row, const float *k, float decay, int32_t n) {
    __m256 d = _mm256_set1_ps(decay), acc = _mm256_setzero_ps();
    int32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 r = _mm256_mul_ps(_mm256_loadu_ps(row + i), d);
        _mm256_storeu_ps(row + i, r);
        acc = _mm256_fmadd_ps(r, _mm256_loadu_ps(k + i), acc);
    }
    float sum = lanes_total(acc);
    for (; i < n; i++) {
        row[i] *= decay;
        sum += row[i] * k[i];
    }
    return sum;
}

static float update_dot(float *row, const float *k, const float *q, float delta, int32_t n) {
    __m256 d = _mm256_set1_ps(delta), acc = _mm256_setzero_ps();
    int32_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 r = _mm256_fmadd_ps(d, _mm256_loadu_ps(k + i), _mm256_loadu_ps(row + i));
        _mm256_storeu_ps(row + i, r);
        acc = _mm256_fmadd_ps(r, _mm256_loadu_ps(q + i), acc);
    }
    float sum = lanes_total(acc);
    for (; i < n; i++) {
        row[i] += delta * k[i];
        sum += row[i] * q[i];
    }
    return sum;
}
#else
static float decay_dot(float *row, const float *k, float decay, int32_t n) {
    float sum = 0;
    for (int32_t i = 0; i < n; i++) {
        row[i] *= decay;
        sum += row[i] * k[i];
    }
    return sum;
}

static float update_dot(float *row, const float *k, const float *q, float delta, int32_t n) {
    float sum = 0;
    for (int32_t i = 0; i < n; i++) {
        row[i] += delta * k[i];
        sum += row[i] * q[i];
    }
    return sum;
}
#endif

// The delta rule, token after token, for the value heads of this thread; then the gated norm.
static void delta_job(void *arg, int thread, int n_threads, int worker) {
    job *j = arg;
    q35_state *s = j->s;
    const q35_model *q = s->q;
    const q35_layer *l = &q->layers[j->layer];
    int64_t begin, end;
    kr_split(q->nv, 1, thread, n_threads, &begin, &end);
    int32_t ratio = q->nv / q->nk, dk = q->dk, dv = q->dv;
    float eps = s->m->info.norm_eps;
    for (int64_t h = begin; h < end; h++) {
        float *S = s->ssm_state + ((size_t)l->slot * (size_t)q->nv + (size_t)h) * (size_t)dv * (size_t)dk;
        int32_t kh = (int32_t)h / ratio;
        for (int32_t t = 0; t < j->n; t++) {
            const float *row = s->conv_out + (size_t)t * q->conv_dim;
            const float *qv = row + (size_t)kh * dk, *kv = row + q->key_dim + (size_t)kh * dk;
            const float *vv = row + 2 * (size_t)q->key_dim + (size_t)h * dv;
            float beta = sigmoid(s->b[(size_t)t * q->nv + h]);
            float decay = expf(l->a[h] * softplus(s->a[(size_t)t * q->nv + h] + l->dt_bias[h]));
            float *o = s->core + (size_t)t * q->value_dim + (size_t)h * dv;
            for (int32_t d = 0; d < dv; d++) {
                float *Sd = S + (size_t)d * dk;
                float delta = (vv[d] - decay_dot(Sd, kv, decay, dk)) * beta;
                o[d] = update_dot(Sd, kv, qv, delta, dk);
            }
            // gated RMSNorm: norm(o) * w * silu(z)
            const float *z = s->z + (size_t)t * q->value_dim + (size_t)h * dv;
            float inv = 1.0f / sqrtf(kr_dot_f32(o, o, dv) / (float)dv + eps);
            for (int32_t d = 0; d < dv; d++) o[d] = o[d] * inv * l->ssm_norm[d] * silu(z[d]);
        }
    }
}

// Full attention: split q/gate, q/k norms, RoPE, K/V into the cache. Split by tokens.
static void rope_job(void *arg, int thread, int n_threads, int worker) {
    job *j = arg;
    q35_state *s = j->s;
    const kr_model *m = s->m;
    const kr_model_info *h = &m->info;
    const q35_layer *l = &s->q->layers[j->layer];
    int32_t hd = h->head_dim, half = h->rope_dims / 2;
    int64_t begin, end;
    kr_split(j->n, 1, thread, n_threads, &begin, &end);
    for (int64_t t = begin; t < end; t++) {
        const float *c = s->rope_cos + t * half, *sn = s->rope_sin + t * half;
        for (int32_t head = 0; head < h->n_heads + h->n_kv_heads; head++) {
            float *x;
            if (head < h->n_heads) {
                x = s->qh + t * m->q_dim + (size_t)head * hd;
                memcpy(x, s->qg + t * 2 * m->q_dim + (size_t)head * 2 * hd, (size_t)hd * sizeof(float));
                rms_norm(x, l->q_norm, x, hd, h->norm_eps);
            } else {
                x = s->k + t * m->kv_dim + (size_t)(head - h->n_heads) * hd;
                rms_norm(x, l->k_norm, x, hd, h->norm_eps);
            }
            for (int32_t i = 0; i < half; i++) {
                float x0 = x[i], x1 = x[i + half];
                x[i] = x0 * c[i] - x1 * sn[i];
                x[i + half] = x0 * sn[i] + x1 * c[i];
            }
        }
        size_t pos = (size_t)j->pos + (size_t)t;
        for (int32_t head = 0; head < h->n_kv_heads; head++) {
            size_t at = (((size_t)l->slot * h->n_kv_heads + head) * (size_t)s->n_ctx + pos) * (size_t)hd;
            const float *k = s->k + t * m->kv_dim + (size_t)head * hd, *v = s->v + t * m->kv_dim + (size_t)head * hd;
            if (s->kv_type == KR_F32) {
                memcpy((float *)s->k_cache + at, k, (size_t)hd * sizeof(float));
                memcpy((float *)s->v_cache + at, v, (size_t)hd * sizeof(float));
            } else {
                kr_f32_to_f16_row(k, (kr_f16 *)s->k_cache + at, hd);
                kr_f32_to_f16_row(v, (kr_f16 *)s->v_cache + at, hd);
            }
        }
    }
}

// Attention of every (token, head), times sigmoid(gate). Split by pairs.
static void attention_job(void *arg, int thread, int n_threads, int worker) {
    job *j = arg;
    q35_state *s = j->s;
    const kr_model *m = s->m;
    const kr_model_info *h = &m->info;
    const q35_layer *l = &s->q->layers[j->layer];
    int32_t hd = h->head_dim, group = h->n_heads / h->n_kv_heads;
    int64_t begin, end;
    kr_split((int64_t)j->n * h->n_heads, 1, thread, n_threads, &begin, &end);
    float *scores = s->scores + (size_t)worker * (size_t)s->n_ctx;
    for (int64_t item = begin; item < end; item++) {
        int32_t t = (int32_t)(item / h->n_heads), head = (int32_t)(item % h->n_heads), pos = j->pos + t;
        size_t base = ((size_t)l->slot * h->n_kv_heads + (size_t)(head / group)) * (size_t)s->n_ctx * (size_t)hd;
        const float *qv = s->qh + (size_t)t * m->q_dim + (size_t)head * hd;
        kr_dot_rows(s->kv_type, s->k_cache + base * s->kv_elem, (size_t)hd * s->kv_elem, pos + 1, qv, hd, scores);
        float max_score = -INFINITY;
        for (int32_t p = 0; p <= pos; p++) {
            scores[p] *= h->attn_scale;
            if (scores[p] > max_score) max_score = scores[p];
        }
        float sum = 0;
        for (int32_t p = 0; p <= pos; p++) {
            scores[p] = expf(scores[p] - max_score);
            sum += scores[p];
        }
        for (int32_t p = 0; p <= pos; p++) scores[p] /= sum;
        float *out = s->att + (size_t)t * m->q_dim + (size_t)head * hd;
        memset(out, 0, (size_t)hd * sizeof(float));
        kr_axpy_rows(s->kv_type, scores, s->v_cache + base * s->kv_elem, (size_t)hd * s->kv_elem, pos + 1, out, hd);
        const float *gate = s->qg + (size_t)t * 2 * m->q_dim + (size_t)head * 2 * hd + hd;
        for (int32_t d = 0; d < hd; d++) out[d] *= sigmoid(gate[d]);
    }
}

static void run(q35_state *s, kr_pool_fn fn, int32_t n, int32_t pos, int32_t layer) {
    job j = {.s = s, .n = n, .pos = pos, .layer = layer};
    kr_pool_run(s->m->pool, fn, &j, CHUNKS(s->m->pool));
}

// SwiGLU in place: gate = silu(gate) * up, split by tokens.
static void swiglu_job(void *arg, int thread, int n_threads, int worker) {
    job *j = arg;
    int64_t ffn = j->s->m->info.ffn_dim, begin, end;
    kr_split(j->n, 1, thread, n_threads, &begin, &end);
    for (int64_t t = begin; t < end; t++) kr_silu_mul_f32(j->s->gate + t * ffn, j->s->up + t * ffn, ffn);
}

static void output_job(void *arg, int thread, int n_threads, int worker) {
    job *j = arg;
    const kr_matrix *w = &j->s->m->output;
    int64_t begin, end;
    kr_split(w->rows, ROW_ALIGN, thread, n_threads, &begin, &end);
    if (begin < end) kr_matrix_matmul(w, j->s->prepared[w->type], 1, j->out[0], begin, end);
}

void kr_qwen35_step(void *state, const int32_t *tokens, int32_t n, int32_t pos, float *logits, bool all_logits) {
    q35_state *s = state;
    kr_model *m = s->m;
    const kr_model_info *h = &m->info;
    const q35_model *q = s->q;
    if (pos == 0) {  // a fresh sequence: empty recurrent states
        memset(s->conv_state, 0, (size_t)q->n_linear * q->conv_dim * (size_t)(q->kernel - 1) * sizeof(float));
        memset(s->ssm_state, 0, (size_t)q->n_linear * q->nv * (size_t)q->dv * (size_t)q->dk * sizeof(float));
    }
    int32_t half = h->rope_dims / 2;
    for (int32_t t = 0; t < n; t++)
        for (int32_t i = 0; i < half; i++) {
            float angle = (float)(pos + t) * m->inv_freq_full[i];
            s->rope_cos[(size_t)t * half + i] = cosf(angle);
            s->rope_sin[(size_t)t * half + i] = sinf(angle);
        }
    const float *pending = NULL;
    for (int32_t layer = 0; layer < h->n_layers; layer++) {
        const q35_layer *l = &q->layers[layer];
        residual_step(s, n, layer == 0 ? tokens : NULL, pending, l->attn_norm);
        if (l->linear) {
            matmuls(s, n, s->xb, h->dim, 4, &l->qkv, s->mixed, &l->z, s->z, &l->beta, s->b, &l->alpha, s->a);
            run(s, conv_job, n, pos, layer);
            run(s, qk_norm_job, n, pos, layer);
            run(s, delta_job, n, pos, layer);
            matmuls(s, n, s->core, q->value_dim, 1, &l->out, s->proj, NULL, NULL, NULL, NULL, NULL, NULL);
        } else {
            matmuls(s, n, s->xb, h->dim, 3, &l->wq, s->qg, &l->wk, s->k, &l->wv, s->v, NULL, NULL);
            run(s, rope_job, n, pos, layer);
            run(s, attention_job, n, pos, layer);
            matmuls(s, n, s->att, m->q_dim, 1, &l->wo, s->proj, NULL, NULL, NULL, NULL, NULL, NULL);
        }
        residual_step(s, n, NULL, s->proj, l->ffn_norm);
        matmuls(s, n, s->xb, h->dim, 2, &l->gate, s->gate, &l->up, s->up, NULL, NULL, NULL, NULL);
        run(s, swiglu_job, n, pos, layer);
        matmuls(s, n, s->gate, h->ffn_dim, 1, &l->down, s->proj, NULL, NULL, NULL, NULL, NULL, NULL);
        pending = s->proj;
    }
    if (!logits) return;  // the states and the KV cache hold everything the next step needs
    if (all_logits) {  // every token: the same add and norm row by row, then one matmul of n rows
        residual_step(s, n, NULL, pending, m->output_norm);
        matmuls(s, n, s->xb, h->dim, 1, &m->output, logits, NULL, NULL, NULL, NULL, NULL, NULL);
        return;
    }
    int64_t dim = h->dim;
    float *x = s->x + (int64_t)(n - 1) * dim;
    for (int64_t i = 0; i < dim; i++) x[i] += pending[(int64_t)(n - 1) * dim + i];
    rms_norm(x, m->output_norm, s->xb, dim, h->norm_eps);
    kr_prepare_activations(m->output.type, s->xb, dim, s->prepared[m->output.type], 0, 1);
    job o = {.s = s, .n = 1};
    o.out[0] = logits;
    kr_pool_run(m->pool, output_job, &o, CHUNKS(m->pool));
}
