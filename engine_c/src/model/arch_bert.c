// arch_bert.c: BERT-family encoders (owner: embed): all-MiniLM, bge and the cross-encoders
// (BertForSequenceClassification) of issue 27. A post-LayerNorm encoder with absolute positions:
//
//   x = LayerNorm(token_embd[t] + position_embd[pos] + token_types[type])
//   per layer: x = LayerNorm(x + (softmax(q k^T / sqrt(head_dim)) v) Wo^T + bo)   q, k, v = x W^T + b
//              x = LayerNorm(x + gelu(x Wup^T + bup) Wdown^T + bdown)            (gelu: the erf form)
//
// nomic-bert (nomic-embed-text) is the same layer with RoPE (neox) on q and k instead of position
// embeddings, no biases, and a SwiGLU MLP:  x = LayerNorm(x + (silu(x Wg^T) * (x Wu^T)) Wdown^T).
//
// Attention sees every token of the token's own sequence, before and after it (model.h: a
// sequence is the run of tokens from a position 0 to the next, whole in the step), reading keys
// and values from the step's rows: an encoder keeps no KV cache. The step leaves each token's
// final hidden state in s->x; session.c's kr_session_embed pools it. A cross-encoder's head
// (classify) is tanh(first_hidden Wcls^T + bcls) Wout^T + bout.
//
// Every value is per token or per (token, head), with the kernels' fixed orders (attention.h,
// kernels.h), so a sequence's outputs are the same bits whichever sequences share its step.
#include "kernels/attention.h"
#include "kernels/kernels.h"
#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_TOKEN_TYPES 16
#define MAX_LABELS 1024

// What sets an architecture of this file apart from bert (kr_arch.variant).
typedef struct {
    bool gated;                       // SwiGLU MLP (ffn_gate, activation silu), else gelu(x Wup^T + b)
    bool biases;                      // every matrix has a bias
} bert_variant;

typedef struct {
    kr_matrix wq, wk, wv, wo, up, down;
    kr_mlp mlp;                       // gated: gate, up, down (up and down not bound above)
    const float *bq, *bk, *bv, *bo, *b_up, *b_down;   // (rows,) biases of each matrix, or NULL
    const float *attn_norm, *attn_norm_bias;          // (dim,) LayerNorm after attention
    const float *out_norm, *out_norm_bias;            // (dim,) LayerNorm after the MLP
} bert_layer;

typedef struct {
    bert_layer *layers;
    const float *position_embd;                       // (max_seq, dim), NULL when rotary
    const float *type_embd;                           // (m->n_token_types, dim)
    const float *embd_norm, *embd_norm_bias;          // (dim,)
    const float *cls, *cls_bias;                      // (dim, dim), (dim,): the pooler, or NULL
    const float *cls_out, *cls_out_bias;              // (n_labels, dim), (n_labels,)
} bert_model;

// --- Loading

// A layer's matrix (rows, cols) and, when the variant has them, its bias (rows,).
static int bind_biased(kr_model *m, const char *path, int32_t layer, const char *part, int64_t rows, int64_t cols,
                       kr_matrix *w, const float **bias, kr_error *err) {
    const bert_variant *v = m->arch->variant;
    char name[96];
    snprintf(name, sizeof name, "blk.%d.%s.weight", layer, part);
    int status = kr_bind_matrix(m, path, name, rows, cols, w, err);
    if (status || !v->biases) return status;
    snprintf(name, sizeof name, "blk.%d.%s.bias", layer, part);
    return kr_bind_f32(m, path, name, rows, 0, bias, err);
}

static int bert_open(kr_model *m, const char *path, kr_error *err) {
    kr_model_info *h = &m->info;
    const bert_variant *v = m->arch->variant;
    bert_model *b = calloc(1, sizeof *b);
    m->layers = b;
    if (!b || !(b->layers = calloc((size_t)h->n_layers, sizeof *b->layers)))
        return kr_fail(err, KR_ERR_MEMORY, "out of memory opening %s", path);
    if (h->n_kv_heads != h->n_heads)
        return kr_fail(err, KR_ERR_FORMAT, "%s: %s has n_kv_heads %d != n_heads %d", path, m->arch->name,
                       h->n_kv_heads, h->n_heads);
    const char *activation, *expected = v->gated ? "silu" : "gelu";
    int status = kr_file_get_str(m->file, "activation", expected, &activation, err);
    if (status) return status;
    if (strcmp(activation, expected))
        return kr_fail(err, KR_ERR_UNSUPPORTED, "%s: %s activation '%.64s' is not supported (%s)", path, m->arch->name,
                       activation, expected);
    if ((status = kr_load_int(m, path, "n_token_types", false, 2, 1, MAX_TOKEN_TYPES, &m->n_token_types, err)) ||
        (status = kr_load_int(m, path, "n_labels", false, 0, 0, MAX_LABELS, &m->n_labels, err)))
        return status;
    int64_t dim = h->dim, q = m->q_dim, ffn = h->ffn_dim;
    if ((!m->arch->rotary &&
         (status = kr_bind_f32(m, path, "position_embd.weight", h->max_seq, dim, &b->position_embd, err))) ||
        (status = kr_bind_f32(m, path, "token_types.weight", m->n_token_types, dim, &b->type_embd, err)) ||
        (status = kr_bind_f32(m, path, "token_embd_norm.weight", dim, 0, &b->embd_norm, err)) ||
        (status = kr_bind_f32(m, path, "token_embd_norm.bias", dim, 0, &b->embd_norm_bias, err)))
        return status;
    if (m->n_labels &&
        ((status = kr_bind_f32(m, path, "cls.weight", dim, dim, &b->cls, err)) ||
         (status = kr_bind_f32(m, path, "cls.bias", dim, 0, &b->cls_bias, err)) ||
         (status = kr_bind_f32(m, path, "cls.output.weight", m->n_labels, dim, &b->cls_out, err)) ||
         (status = kr_bind_f32(m, path, "cls.output.bias", m->n_labels, 0, &b->cls_out_bias, err))))
        return status;
    char name[96];
    for (int32_t i = 0; i < h->n_layers; i++) {
        bert_layer *l = &b->layers[i];
        if ((status = bind_biased(m, path, i, "attn_q", q, dim, &l->wq, &l->bq, err)) ||
            (status = bind_biased(m, path, i, "attn_k", q, dim, &l->wk, &l->bk, err)) ||
            (status = bind_biased(m, path, i, "attn_v", q, dim, &l->wv, &l->bv, err)) ||
            (status = bind_biased(m, path, i, "attn_output", dim, q, &l->wo, &l->bo, err)))
            return status;
        if (v->gated) status = kr_bind_mlp(m, path, i, &l->mlp, err);
        else if (!(status = bind_biased(m, path, i, "ffn_up", ffn, dim, &l->up, &l->b_up, err)))
            status = bind_biased(m, path, i, "ffn_down", dim, ffn, &l->down, &l->b_down, err);
        if (status) return status;
#define NAME(suffix) (snprintf(name, sizeof name, "blk.%d.%s", i, suffix), name)
        if ((status = kr_bind_f32(m, path, NAME("attn_output_norm.weight"), dim, 0, &l->attn_norm, err)) ||
            (status = kr_bind_f32(m, path, NAME("attn_output_norm.bias"), dim, 0, &l->attn_norm_bias, err)) ||
            (status = kr_bind_f32(m, path, NAME("layer_output_norm.weight"), dim, 0, &l->out_norm, err)) ||
            (status = kr_bind_f32(m, path, NAME("layer_output_norm.bias"), dim, 0, &l->out_norm_bias, err)))
            return status;
#undef NAME
    }
    return KR_OK;
}

static void bert_close(kr_model *m) {
    bert_model *b = m->layers;
    if (b) free(b->layers);
    free(b);
}

static int bert_matrices(kr_model *m, kr_matrix **out) {
    const bert_variant *v = m->arch->variant;
    bert_model *b = m->layers;
    int n = 0;
    for (int32_t i = 0; i < m->info.n_layers; i++) {
        bert_layer *l = &b->layers[i];
        kr_matrix *plain[] = {&l->wq, &l->wk, &l->wv, &l->wo, &l->up, &l->down};
        kr_matrix *gated[] = {&l->wq, &l->wk, &l->wv, &l->wo, &l->mlp.gate, &l->mlp.up, &l->mlp.down};
        kr_matrix **all = v->gated ? gated : plain;
        size_t count = v->gated ? sizeof gated / sizeof gated[0] : sizeof plain / sizeof plain[0];
        for (size_t k = 0; k < count; k++, n++)
            if (out) out[n] = all[k];
    }
    return n;
}

// --- The step's jobs

typedef struct {
    kr_model *m;
    kr_scratch *s;
    const kr_batch *b;
    const float *add;                 // norm job: x = LayerNorm(x + add)
    const float *norm, *norm_bias;
    int64_t n_blocks;                 // attention job: query_blocks' count
} bert_job;

// out = (x - mean) / sqrt(variance + eps) * weight + bias over n values, sums in index order.
static void layer_norm(float *x, const float *weight, const float *bias, int64_t n, float eps) {
    float sum = 0, squares = 0;
    for (int64_t i = 0; i < n; i++) sum += x[i];
    float mean = sum / (float)n;
    for (int64_t i = 0; i < n; i++) squares += (x[i] - mean) * (x[i] - mean);
    float scale = 1.0f / sqrtf(squares / (float)n + eps);
    for (int64_t i = 0; i < n; i++) x[i] = (x[i] - mean) * scale * weight[i] + bias[i];
}

// x = LayerNorm(token + position + type embeddings) (no position embedding when rotary). Split by tokens.
static void embed_job(void *arg, int chunk, int n_chunks, int thread) {
    bert_job *j = arg;
    const kr_model *m = j->m;
    const bert_model *bm = m->layers;
    int64_t dim = m->info.dim, begin, end;
    kr_split(j->b->n, 1, chunk, n_chunks, &begin, &end);
    for (int64_t t = begin; t < end; t++) {
        float *x = j->s->x + t * dim;
        const kr_matrix *e = &m->token_embd;
        if (e->packed) kr_dequantize_packed_row(e->type, e->data, e->rows, e->cols, j->b->tokens[t], x);
        else kr_dequantize_row(e->type, (const uint8_t *)e->data + (size_t)j->b->tokens[t] * e->row_bytes, x, dim);
        const float *type = bm->type_embd + (size_t)(j->b->token_types ? j->b->token_types[t] : 0) * (size_t)dim;
        if (bm->position_embd) {
            const float *position = bm->position_embd + (size_t)j->b->pos[t] * (size_t)dim;
            for (int64_t i = 0; i < dim; i++) x[i] = x[i] + type[i] + position[i];  // transformers' order
        } else {
            for (int64_t i = 0; i < dim; i++) x[i] += type[i];
        }
        layer_norm(x, bm->embd_norm, bm->embd_norm_bias, dim, m->info.norm_eps);
    }
}

// x = LayerNorm(x + add). Split by tokens.
static void norm_job(void *arg, int chunk, int n_chunks, int thread) {
    bert_job *j = arg;
    int64_t dim = j->m->info.dim, begin, end;
    kr_split(j->b->n, 1, chunk, n_chunks, &begin, &end);
    for (int64_t t = begin; t < end; t++) {
        float *x = j->s->x + t * dim;
        const float *add = j->add + t * dim;
        for (int64_t i = 0; i < dim; i++) x[i] += add[i];
        layer_norm(x, j->norm, j->norm_bias, dim, j->m->info.norm_eps);
    }
}

// gelu(x) = x / 2 * (1 + erf(x / sqrt 2)) on the up projection, in place. Split by tokens.
static void gelu_job(void *arg, int chunk, int n_chunks, int thread) {
    bert_job *j = arg;
    int64_t ffn = j->m->info.ffn_dim, begin, end;
    kr_split(j->b->n, 1, chunk, n_chunks, &begin, &end);
    for (int64_t i = begin * ffn; i < end * ffn; i++) {
        float v = j->s->gate[i];
        j->s->gate[i] = 0.5f * v * (1.0f + erff(v * (float)M_SQRT1_2));
    }
}

// RoPE on every head of q and k, token t by row t of kr_rope_tables' full-layer angles. Split by tokens.
static void rope_job(void *arg, int chunk, int n_chunks, int thread) {
    bert_job *j = arg;
    const kr_model_info *h = &j->m->info;
    kr_scratch *s = j->s;
    int32_t half = h->rope_dims / 2, hd = h->head_dim;
    int64_t begin, end;
    kr_split(j->b->n, 1, chunk, n_chunks, &begin, &end);
    for (int64_t t = begin; t < end; t++) {
        const float *c = s->rope_cos + t * half, *sn = s->rope_sin + t * half;
        for (int32_t head = 0; head < h->n_heads; head++) {
            kr_rope_head(s->q + t * j->m->q_dim + head * hd, c, sn, h->rope_dims, h->rope_style);
            kr_rope_head(s->k + t * j->m->q_dim + head * hd, c, sn, h->rope_dims, h->rope_style);
        }
    }
}

// Attention of one head for a block of consecutive queries of one sequence, over the sequence's
// rows [first, end) of the step: the keys and values are read once for the whole block. The
// kernels give every (query, position) the same bits however the queries are grouped
// (attention.h), so the block size never changes a value. Split by (block, head) items.
static void attention_job(void *arg, int chunk, int n_chunks, int thread) {
    bert_job *j = arg;
    const kr_model *m = j->m;
    kr_scratch *s = j->s;
    const kr_batch *b = j->b;
    int32_t hd = m->info.head_dim, n_heads = m->info.n_heads;
    size_t row_stride = (size_t)m->q_dim * sizeof(float);
    float *scores = s->scores + (size_t)thread * (size_t)s->att_queries * (size_t)s->n_ctx;
    float *queries = s->att_q + (size_t)thread * (size_t)s->att_queries * (size_t)hd;
    int32_t begin_rows[KR_ATT_MAX_QUERIES] = {0}, end_rows[KR_ATT_MAX_QUERIES];
    float *out[KR_ATT_MAX_QUERIES];
    int64_t begin, end;
    kr_split(j->n_blocks * n_heads, 1, chunk, n_chunks, &begin, &end);
    for (int64_t item = begin; item < end; item++) {
        const int32_t *block = s->att_blocks + 2 * (item / n_heads);
        int32_t head = (int32_t)(item % n_heads), t0 = block[0], n = block[1] - block[0];
        int32_t first = t0 - b->pos[t0], last = t0 + n;  // the sequence's rows: from its position 0 ...
        while (last < b->n && b->pos[last] != 0) last++;  // ... to the next sequence
        int32_t span = last - first;
        for (int32_t i = 0; i < n; i++) {
            size_t at = (size_t)(t0 + i) * (size_t)m->q_dim + (size_t)head * (size_t)hd;
            memcpy(queries + (size_t)i * (size_t)hd, s->q + at, (size_t)hd * sizeof(float));
            end_rows[i] = span;
            out[i] = s->att + at;
        }
        const float *keys = s->k + (size_t)first * (size_t)m->q_dim + (size_t)head * (size_t)hd;
        const float *values = s->v + (size_t)first * (size_t)m->q_dim + (size_t)head * (size_t)hd;
        kr_attend_scores(KR_F32, keys, row_stride, hd, queries, n, end_rows, scores, (size_t)span);
        for (int32_t i = 0; i < n; i++) kr_attention_softmax(scores + (size_t)i * (size_t)span, span, m->info.attn_scale, 0, -INFINITY);
        kr_attend_values(KR_F32, values, row_stride, hd, scores, (size_t)span, begin_rows, end_rows, n, out);
    }
}

// The step's blocks of queries into s->att_blocks ([first, end) rows, 2 per block): each
// sequence (the run of tokens from a position 0 to the next) cut into blocks of at most
// s->att_queries tokens. Returns the number of blocks (at most b->n).
static int64_t query_blocks(kr_scratch *s, const kr_batch *b) {
    int64_t n_blocks = 0;
    for (int32_t t = 0; t < b->n;) {
        int32_t end = t + 1;
        while (end < b->n && b->pos[end] != 0) end++;
        for (int32_t i = t; i < end; i += s->att_queries, n_blocks++) {
            s->att_blocks[2 * n_blocks] = i;
            s->att_blocks[2 * n_blocks + 1] = i + s->att_queries < end ? i + s->att_queries : end;
        }
        t = end;
    }
    return n_blocks;
}

static void bert_step(kr_model *m, kr_scratch *s, const kr_batch *b) {
    const bert_variant *v = m->arch->variant;
    const bert_model *bm = m->layers;
    kr_pool *pool = m->pool;
    int64_t dim = m->info.dim;
    int chunks = kr_pool_chunks(pool, b->n);
    bert_job j = {.m = m, .s = s, .b = b};
    j.n_blocks = query_blocks(s, b);
    kr_pool_run(pool, embed_job, &j, chunks);
    if (m->arch->rotary) kr_rope_tables(m, s, b);
    for (int32_t layer = 0; layer < m->info.n_layers; layer++) {
        const bert_layer *l = &bm->layers[layer];
        const kr_matrix *qkv[] = {&l->wq, &l->wk, &l->wv}, *wo[] = {&l->wo}, *up[] = {&l->up}, *down[] = {&l->down};
        float *qkv_out[] = {s->q, s->k, s->v}, *proj[] = {s->proj}, *gate[] = {s->gate};
        const float *qkv_bias[] = {l->bq, l->bk, l->bv}, *bo[] = {l->bo}, *b_up[] = {l->b_up}, *b_down[] = {l->b_down};
        kr_matmuls(m, s, b->n, s->x, dim, 3, qkv, qkv_out, qkv_bias);
        if (m->arch->rotary) kr_pool_run(pool, rope_job, &j, chunks);
        kr_pool_run(pool, attention_job, &j, kr_pool_chunks(pool, j.n_blocks * m->info.n_heads));
        kr_matmuls(m, s, b->n, s->att, m->q_dim, 1, wo, proj, bo);
        j.add = s->proj, j.norm = l->attn_norm, j.norm_bias = l->attn_norm_bias;
        kr_pool_run(pool, norm_job, &j, chunks);
        if (v->gated) {
            kr_mlp_rows(m, s, b->n, s->x, &l->mlp);
        } else {
            kr_matmuls(m, s, b->n, s->x, dim, 1, up, gate, b_up);
            kr_pool_run(pool, gelu_job, &j, chunks);
            kr_matmuls(m, s, b->n, s->gate, m->info.ffn_dim, 1, down, proj, b_down);
        }
        j.add = s->proj, j.norm = l->out_norm, j.norm_bias = l->out_norm_bias;
        kr_pool_run(pool, norm_job, &j, chunks);
    }
}

// The cross-encoder's head: pooled = tanh(first Wcls^T + b), out = pooled Wout^T + b, each
// output a kr_dot_f32 (one fixed order in every build). `pooled` is dim floats of scratch.
static void bert_classify(const kr_model *m, const float *first_hidden, float *pooled, float *out) {
    const bert_model *bm = m->layers;
    int64_t dim = m->info.dim;
    for (int64_t r = 0; r < dim; r++)
        pooled[r] = tanhf(kr_dot_f32(bm->cls + r * dim, first_hidden, dim) + bm->cls_bias[r]);
    for (int32_t r = 0; r < m->n_labels; r++)
        out[r] = kr_dot_f32(bm->cls_out + (int64_t)r * dim, pooled, dim) + bm->cls_out_bias[r];
}

static const bert_variant BERT = {.gated = false, .biases = true}, NOMIC_BERT = {.gated = true, .biases = false};

const kr_arch kr_arch_bert = {.name = "bert", .variant = &BERT, .open = bert_open, .close = bert_close,
                              .matrices = bert_matrices, .step = bert_step, .encoder = true,
                              .classify = bert_classify};
const kr_arch kr_arch_nomic_bert = {.name = "nomic-bert", .variant = &NOMIC_BERT, .open = bert_open,
                                    .close = bert_close, .matrices = bert_matrices, .step = bert_step,
                                    .encoder = true, .rotary = true, .classify = bert_classify};
