// forward.c: sessions (KV cache + scratch) and the transformer forward pass.
//
// One step runs up to n_batch tokens through every layer. Each phase of a layer is one pool
// job; a job splits its work either by tokens or by output rows, never along a reduction, and
// every value is computed by the same code whatever the split. So logits are bitwise identical
// for any batch size, any thread count, and a prompt evaluated in one call or several
// (docs/architecture.md). Per layer:
//
//   xb = norm(x) -> q, k, v = xb W^T (+ bias) -> q/k head norms, RoPE, K/V into the cache
//   -> attention per (KV head, block of queries) -> o = att Wo^T [-> post-norm] -> x += o
//   xb = norm(x) -> h = act(xb Wg^T) * (xb Wu^T) -> d = h Wd^T [-> post-norm] -> x += d
#include "kernels/attention.h"
#include "kernels/kernels.h"
#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_MAX_CTX 4096
#define MAX_BATCH 65536
#define ROW_ALIGN 16  // matmul row chunks per thread: whole multiples, for the kernels' row tiles
// Attention takes at most this many queries of one KV head at a time (fewer when the context is so
// long that their scores would pass ATT_SCORES_BUDGET floats per thread).
#define ATT_MAX_QUERIES 64
#define ATT_SCORES_BUDGET (1 << 22)

struct kr_session {
    kr_model *model;
    int32_t n_ctx, n_batch, kv_type, n_tokens;
    size_t kv_elem;        // bytes per cache element
    uint8_t *k_cache;      // (n_layers, n_kv_heads, n_ctx, head_dim) of kv_type
    uint8_t *v_cache;      // (n_layers, n_kv_heads, n_ctx, head_dim) of kv_type, as the keys
    float *x;              // (n_batch, dim) residual stream
    float *xb;             // (n_batch, dim) normed input of a block
    float *q;              // (n_batch, q_dim)
    float *k, *v;          // (n_batch, kv_dim)
    float *att;            // (n_batch, q_dim) attention output, heads side by side
    float *proj;           // (n_batch, dim) output of Wo or of the MLP
    float *gate, *up;      // (n_batch, ffn_dim)
    int32_t att_queries;   // queries per attention block, at most (attention_plan)
    float *scores;         // (n_threads, att_queries, n_ctx) attention weights of a block's queries
    float *att_q;          // (n_threads, att_queries, head_dim) the block's queries (or q8_0 rows)
    float *rope_cos;       // (2, n_batch, rope_dims / 2): [0] full layers, [1] sliding layers
    float *rope_sin;
    void *prepared[KR_TYPE_COUNT];  // activations prepared for each weight type the model uses
    void *ext;             // qwen35 hook: the hybrid model's own state (forward_qwen35.c)
};

// --- Session lifetime

// Zeroed memory (calloc: pages of a large buffer are only touched when used, so a large context
// costs memory as it fills, and an impossible one fails here instead of at first touch).
static void *alloc_array(size_t count, size_t size, bool *failed) {
    size_t bytes;
    void *p = NULL;
    if (__builtin_mul_overflow(count, size, &bytes) || !bytes || !(p = calloc(count, size))) *failed = true;
    return p;
}

static void note_type(bool *used, const kr_matrix *w) { used[w->type] = true; }

// speed hook: bytes of n cache values (q8_0: blocks of 32 values in 34 bytes).
static size_t kv_bytes(const kr_session *s, int64_t n) {
    return s->kv_type == KR_Q8_0 ? (size_t)(n / KR_QK) * sizeof(kr_block_q8_0) : (size_t)n * s->kv_elem;
}

kr_session *kr_session_new(kr_model *m, int32_t n_ctx, int32_t kv_type, int32_t n_batch, kr_error *err) {
    if (!m) {
        kr_fail(err, KR_ERR_ARGUMENT, "kr_session_new: model is NULL");
        return NULL;
    }
    const kr_model_info *h = &m->info;
    if (n_ctx == 0) n_ctx = h->max_seq < DEFAULT_MAX_CTX ? h->max_seq : DEFAULT_MAX_CTX;
    if (n_ctx < 1 || n_ctx > (1 << 24)) {
        kr_fail(err, KR_ERR_ARGUMENT, "context %d is out of range (1 to %d)", n_ctx, 1 << 24);
        return NULL;
    }
    // speed hook: KV cache q8_0 quantizes each position's head row in blocks of 32
    if (kv_type == KR_Q8_0 && m->ext) {
        kr_fail(err, KR_ERR_UNSUPPORTED, "KV cache q8_0 is not supported for qwen35 models (f32, f16)");
        return NULL;
    }
    if (kv_type == KR_Q8_0 && h->head_dim % KR_QK) {
        kr_fail(err, KR_ERR_UNSUPPORTED, "KV cache q8_0 needs head_dim a multiple of %d, not %d (use f32 or f16)",
                KR_QK, h->head_dim);
        return NULL;
    }
    if (kv_type != KR_F32 && kv_type != KR_F16 && kv_type != KR_Q8_0) {
        kr_fail(err, KR_ERR_ARGUMENT, "KV cache type %d is not one of f32 (0), f16 (1), q8_0 (3)", kv_type);
        return NULL;
    }
    if (n_batch < 1 || n_batch > MAX_BATCH) {
        kr_fail(err, KR_ERR_ARGUMENT, "batch %d is out of range (1 to %d)", n_batch, MAX_BATCH);
        return NULL;
    }
    if (n_batch > n_ctx) n_batch = n_ctx;

    kr_session *s = calloc(1, sizeof *s);
    if (!s) {
        kr_fail(err, KR_ERR_MEMORY, "out of memory for a session");
        return NULL;
    }
    s->model = m;
    s->n_ctx = n_ctx;
    s->n_batch = n_batch;
    s->kv_type = kv_type;
    s->kv_elem = kv_type == KR_F32 ? 4 : 2;
    // --- qwen35 hook: recurrent states and caches live in forward_qwen35.c
    if (m->ext) {
        s->ext = kr_qwen35_state_new(m, n_ctx, kv_type, n_batch, err);
        if (!s->ext) {
            free(s);
            return NULL;
        }
        return s;
    }
    // --- end qwen35 hook
    size_t b = (size_t)n_batch, half = (size_t)h->rope_dims / 2;
    size_t kv_rows = (size_t)h->n_layers * (size_t)n_ctx;
    bool failed = false;
    s->k_cache = alloc_array(kv_rows, kv_bytes(s, m->kv_dim), &failed);  // speed hook: kv_bytes (q8_0)
    s->v_cache = alloc_array(kv_rows, kv_bytes(s, m->kv_dim), &failed);
    s->x = alloc_array(b * (size_t)h->dim, sizeof(float), &failed);
    s->xb = alloc_array(b * (size_t)h->dim, sizeof(float), &failed);
    s->q = alloc_array(b * (size_t)m->q_dim, sizeof(float), &failed);
    s->k = alloc_array(b * (size_t)m->kv_dim, sizeof(float), &failed);
    s->v = alloc_array(b * (size_t)m->kv_dim, sizeof(float), &failed);
    s->att = alloc_array(b * (size_t)m->q_dim, sizeof(float), &failed);
    s->proj = alloc_array(b * (size_t)h->dim, sizeof(float), &failed);
    s->gate = alloc_array(b * (size_t)h->ffn_dim, sizeof(float), &failed);
    s->up = alloc_array(b * (size_t)h->ffn_dim, sizeof(float), &failed);
    s->att_queries = ATT_SCORES_BUDGET / n_ctx < 1 ? 1 : ATT_SCORES_BUDGET / n_ctx;
    if (s->att_queries > ATT_MAX_QUERIES) s->att_queries = ATT_MAX_QUERIES;
    size_t threads = (size_t)kr_pool_size(m->pool), att_q = (size_t)s->att_queries;
    s->scores = alloc_array(threads * att_q * (size_t)n_ctx, sizeof(float), &failed);
    s->att_q = alloc_array(threads * att_q * (size_t)h->head_dim, sizeof(float), &failed);  // q8_0 rows are smaller
    s->rope_cos = alloc_array(2 * b * half, sizeof(float), &failed);
    s->rope_sin = alloc_array(2 * b * half, sizeof(float), &failed);
    // One prepared-activation buffer per weight type, wide enough for the widest input.
    bool used[KR_TYPE_COUNT] = {false};
    note_type(used, &m->output);
    for (int32_t i = 0; i < h->n_layers; i++) {
        const kr_layer *l = &m->layers[i];
        note_type(used, &l->wq), note_type(used, &l->wk), note_type(used, &l->wv), note_type(used, &l->wo);
        note_type(used, &l->gate), note_type(used, &l->up), note_type(used, &l->down);
    }
    int64_t widest = h->dim > m->q_dim ? h->dim : m->q_dim;
    if (h->ffn_dim > widest) widest = h->ffn_dim;
    for (int32_t t = 0; t < KR_TYPE_COUNT; t++)
        if (used[t]) s->prepared[t] = alloc_array(kr_activation_bytes(t, n_batch, widest), 1, &failed);
    if (failed) {
        kr_fail(err, KR_ERR_MEMORY, "out of memory for a session of context %d, batch %d (KV cache %.1f MiB)", n_ctx,
                n_batch, 2.0 * (double)kv_rows * (double)kv_bytes(s, m->kv_dim) / (1 << 20));
        kr_session_free(s);
        return NULL;
    }
    kr_ok(err);
    return s;
}

void kr_session_free(kr_session *s) {
    if (!s) return;
    kr_qwen35_state_free(s->ext);  // qwen35 hook
    free(s->k_cache), free(s->v_cache), free(s->x), free(s->xb), free(s->q), free(s->k), free(s->v);
    free(s->att), free(s->proj), free(s->gate), free(s->up), free(s->scores), free(s->att_q), free(s->rope_cos), free(s->rope_sin);
    for (int32_t t = 0; t < KR_TYPE_COUNT; t++) free(s->prepared[t]);
    free(s);
}

int32_t kr_session_n_tokens(const kr_session *s) { return s ? s->n_tokens : 0; }
int32_t kr_session_n_ctx(const kr_session *s) { return s ? s->n_ctx : 0; }
int32_t kr_session_n_batch(const kr_session *s) { return s ? s->n_batch : 0; }
int32_t kr_session_kv_type(const kr_session *s) { return s ? s->kv_type : -1; }

int kr_session_truncate(kr_session *s, int32_t n_tokens, kr_error *err) {
    if (!s) return kr_fail(err, KR_ERR_ARGUMENT, "kr_session_truncate: session is NULL");
    if (n_tokens < 0 || n_tokens > s->n_tokens)
        return kr_fail(err, KR_ERR_ARGUMENT, "cannot truncate to %d tokens: the session holds %d", n_tokens,
                       s->n_tokens);
    // --- qwen35 hook: a recurrent state cannot be cut back, only dropped
    if (s->ext && n_tokens != 0 && n_tokens != s->n_tokens)
        return kr_fail(err, KR_ERR_STATE, "cannot truncate a qwen35 session to %d tokens: its recurrent state "
                       "can only be kept (%d) or dropped (0)", n_tokens, s->n_tokens);
    s->n_tokens = n_tokens;
    kr_ok(err);
    return KR_OK;
}

// --- Small per-row operations

// out = x / rms(x) * weight over n values; sum of squares in kr_dot_f32's fixed order.
static void rms_norm(const float *x, const float *weight, float *out, int64_t n, float eps) {
    float mean_square = kr_dot_f32(x, x, n) / (float)n;
    float scale = 1.0f / sqrtf(mean_square + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * scale * weight[i];
}

// Rotate the first rope_dims values of one head by the angles whose cos/sin are given.
static void rope(float *head, const float *cos_row, const float *sin_row, int32_t rope_dims, int32_t style) {
    int32_t half = rope_dims / 2;
    for (int32_t i = 0; i < half; i++) {
        int32_t a = style == KR_ROPE_NEOX ? i : 2 * i;
        int32_t b = style == KR_ROPE_NEOX ? i + half : 2 * i + 1;
        float x0 = head[a], x1 = head[b], c = cos_row[i], s = sin_row[i];
        head[a] = x0 * c - x1 * s;
        head[b] = x0 * s + x1 * c;
    }
}

// The (n_ctx, head_dim) keys or values of one layer's KV head.
static uint8_t *cache_head(const kr_session *s, uint8_t *cache, int32_t layer, int32_t kv_head) {
    size_t heads = (size_t)layer * (size_t)s->model->info.n_kv_heads + (size_t)kv_head;
    return cache + heads * (size_t)s->n_ctx * kv_bytes(s, s->model->info.head_dim);  // speed hook: kv_bytes
}

// --- Pool jobs

typedef struct {
    kr_session *s;
    int32_t n;               // tokens in this step
    int32_t pos;             // position of the first one
    int32_t layer;
    const int32_t *tokens;   // residual job: embed these into x first
    const float *add;        // residual job: x += add (after add_norm when set)
    const float *add_norm;
    const float *norm;       // residual job: xb = norm(x)
    const float *input;      // prepare job: rows to prepare (n x input_cols)
    int64_t input_cols;
    const kr_matrix *w[3];   // matmul job: up to three matrices reading the same input
    float *out[3];
    const float *bias[3];
    int32_t n_w;
    bool gated;              // matmul job on gate/up: then gate = act(gate) * up
    float *logits;           // output job
    int64_t att_items;       // attention job: KV heads x blocks of queries (attention_plan)
    int64_t att_per_item;    // queries per block
} step;

static void prepare_rows(kr_session *s, const kr_matrix *const *w, int32_t n_w, const float *input, int64_t cols,
                         int64_t begin, int64_t end) {
    bool done[KR_TYPE_COUNT] = {false};
    for (int32_t i = 0; i < n_w; i++) {
        int32_t type = w[i]->type;
        if (done[type]) continue;
        done[type] = true;
        kr_prepare_activations(type, input, cols, s->prepared[type], begin, end);
    }
}

// Embed (first layer), add the previous block's output (with its post-norm), normalize into xb
// and prepare xb for the matrices that read it. Split by tokens.
static void residual_job(void *arg, int chunk, int n_chunks, int thread) {
    step *j = arg;
    kr_session *s = j->s;
    const kr_model *m = s->model;
    const kr_model_info *h = &m->info;
    int64_t dim = h->dim, begin, end;
    kr_split(j->n, 1, chunk, n_chunks, &begin, &end);
    for (int64_t t = begin; t < end; t++) {
        float *x = s->x + t * dim;
        if (j->tokens) {
            const uint8_t *row = (const uint8_t *)m->token_embd.data + (size_t)j->tokens[t] * m->token_embd.row_bytes;
            kr_dequantize_row(m->token_embd.type, row, x, dim);
            if (h->embedding_scale != 1.0f)
                for (int64_t i = 0; i < dim; i++) x[i] *= h->embedding_scale;
        }
        if (j->add) {
            float *add = (float *)j->add + t * dim;
            if (j->add_norm) rms_norm(add, j->add_norm, add, dim, h->norm_eps);
            for (int64_t i = 0; i < dim; i++) x[i] += add[i];
        }
        rms_norm(x, j->norm, s->xb + t * dim, dim, h->norm_eps);
    }
    if (begin < end) prepare_rows(s, j->w, j->n_w, s->xb, dim, begin, end);
}

// Prepare `input` for the matrices of the job. Split by tokens.
static void prepare_job(void *arg, int chunk, int n_chunks, int thread) {
    step *j = arg;
    int64_t begin, end;
    kr_split(j->n, 1, chunk, n_chunks, &begin, &end);
    if (begin < end) prepare_rows(j->s, j->w, j->n_w, j->input, j->input_cols, begin, end);
}

// out_i = input W_i^T (+ bias_i) for each matrix; split by output rows. With `gated`, out[0]
// becomes act(out[0]) * out[1] on the same rows.
static void matmul_job(void *arg, int chunk, int n_chunks, int thread) {
    step *j = arg;
    kr_session *s = j->s;
    int64_t begin[3], end[3];
    for (int32_t i = 0; i < j->n_w; i++) {
        const kr_matrix *w = j->w[i];
        kr_split(w->rows, ROW_ALIGN, chunk, n_chunks, &begin[i], &end[i]);
        if (begin[i] >= end[i]) continue;
        kr_matrix_matmul(w, s->prepared[w->type], j->n, j->out[i], begin[i], end[i]);
        if (j->bias[i])
            for (int64_t t = 0; t < j->n; t++)
                for (int64_t r = begin[i]; r < end[i]; r++) j->out[i][t * w->rows + r] += j->bias[i][r];
    }
    if (j->gated && begin[0] < end[0]) {
        int64_t rows = j->w[0]->rows;
        bool gelu = s->model->info.activation == KR_ACT_GELU_TANH;
        for (int64_t t = 0; t < j->n; t++) {
            float *g = j->out[0] + t * rows, *u = j->out[1] + t * rows;
            // speed: the vector kernels (kernels.h), the same bits in every build
            if (gelu) kr_gelu_tanh_mul_f32(g + begin[0], u + begin[0], end[0] - begin[0]);
            else kr_silu_mul_f32(g + begin[0], u + begin[0], end[0] - begin[0]);
        }
    }
}

// Per token: q/k head norms, RoPE, then K and V into the cache. Split by tokens.
static void rope_job(void *arg, int chunk, int n_chunks, int thread) {
    step *j = arg;
    kr_session *s = j->s;
    const kr_model *m = s->model;
    const kr_model_info *h = &m->info;
    const kr_layer *l = &m->layers[j->layer];
    int32_t half = h->rope_dims / 2, hd = h->head_dim;
    int64_t begin, end;
    kr_split(j->n, 1, chunk, n_chunks, &begin, &end);
    for (int64_t t = begin; t < end; t++) {
        size_t table = ((size_t)l->sliding * (size_t)s->n_batch + (size_t)t) * (size_t)half;
        const float *c = s->rope_cos + table, *sn = s->rope_sin + table;
        float *q = s->q + t * m->q_dim, *k = s->k + t * m->kv_dim, *v = s->v + t * m->kv_dim;
        for (int32_t head = 0; head < h->n_heads; head++) {
            if (l->q_norm) rms_norm(q + head * hd, l->q_norm, q + head * hd, hd, h->norm_eps);
            rope(q + head * hd, c, sn, h->rope_dims, h->rope_style);
        }
        for (int32_t head = 0; head < h->n_kv_heads; head++) {
            if (l->k_norm) rms_norm(k + head * hd, l->k_norm, k + head * hd, hd, h->norm_eps);
            rope(k + head * hd, c, sn, h->rope_dims, h->rope_style);
        }
        size_t pos = (size_t)j->pos + (size_t)t, row = kv_bytes(s, hd);
        for (int32_t head = 0; head < h->n_kv_heads; head++) {
            uint8_t *key = cache_head(s, s->k_cache, j->layer, head) + pos * row;
            uint8_t *value = cache_head(s, s->v_cache, j->layer, head) + pos * row;
            const float *k_head = k + head * hd, *v_head = v + head * hd;
            if (s->kv_type == KR_Q8_0) {  // speed hook: q8_0 rows, blocks of 32
                kr_quantize_row_q8_0(k_head, (kr_block_q8_0 *)key, hd);
                kr_quantize_row_q8_0(v_head, (kr_block_q8_0 *)value, hd);
            } else if (s->kv_type == KR_F32) {
                memcpy(key, k_head, (size_t)hd * sizeof(float));
                memcpy(value, v_head, (size_t)hd * sizeof(float));
            } else {
                kr_f32_to_f16_row(k_head, (kr_f16 *)key, hd);
                kr_f32_to_f16_row(v_head, (kr_f16 *)value, hd);
            }
        }
    }
}

// --- Attention over blocks of queries
//
// The queries of one KV head in a step are numbered i = t * group + g: token t of the step, g-th
// query head of the KV head's group (GQA). A work item is one KV head and a run of consecutive
// queries: their keys' scores are one kr_attend_scores (float keys, 2 queries per pass over
// them) or kr_matmul (q8_0 keys, the keys read once for all), then a softmax per query, then
// their weighted sums of values one kr_attend_values (the values read once per 4 queries). Each
// gives every (query, position) the same bits however the queries are grouped, so attention does
// not depend on the batch, the thread count or the split (attention.h).

// Items of a step of n tokens, and *per_item queries in each (the last of a KV head may have
// fewer). Whole tokens per item where the scratch allows; on several threads, items small enough
// that each thread gets some even at one token (generation).
static int64_t attention_plan(const kr_session *s, int32_t n, int64_t *per_item) {
    const kr_model_info *h = &s->model->info;
    int64_t group = h->n_heads / h->n_kv_heads, queries = (int64_t)n * group, size = s->att_queries;
    if (size >= group) size -= size % group;
    int64_t wanted = kr_pool_chunks(s->model->pool, (int64_t)n * h->n_heads);
    int64_t per_head = (wanted + h->n_kv_heads - 1) / h->n_kv_heads;
    if ((queries + size - 1) / size < per_head) size = (queries + per_head - 1) / per_head;
    *per_item = size;
    return (int64_t)h->n_kv_heads * ((queries + size - 1) / size);
}

// First position a query at `pos` sees: a sliding layer sees the last sliding_window positions,
// itself included (as transformers' sliding_window_overlay and llama.cpp's is_masked_swa).
static int32_t first_visible(const kr_model *m, int32_t layer, int32_t pos) {
    int32_t window = m->info.sliding_window;
    return m->layers[layer].sliding && pos >= window ? pos - window + 1 : 0;
}

// Queries [i0, i1) of one KV head: att = softmax(scale * q K^T [softcap], window) V for each.
// Scores and weights are indexed from `base`, the first position any of them sees; positions a
// query does not see may be scored (for the queries it shares a tile with) but are never used.
static void attend_block(kr_session *s, const step *j, int32_t kv_head, int64_t i0, int64_t i1, int thread) {
    const kr_model *m = s->model;
    const kr_model_info *h = &m->info;
    int32_t hd = h->head_dim, group = h->n_heads / h->n_kv_heads;
    int64_t n_queries = i1 - i0;
    int32_t base = first_visible(m, j->layer, j->pos + (int32_t)(i0 / group));
    int32_t span = j->pos + (int32_t)((i1 - 1) / group) - base + 1;
    float *scores = s->scores + (size_t)thread * (size_t)s->att_queries * (size_t)s->n_ctx;
    uint8_t *queries = (uint8_t *)(s->att_q + (size_t)thread * (size_t)s->att_queries * (size_t)hd);
    int32_t begin[ATT_MAX_QUERIES], end[ATT_MAX_QUERIES];
    float *out[ATT_MAX_QUERIES];
    // Float keys read the f32 queries as they are; speed hook: q8_0 keys take q8_0 queries.
    size_t query_bytes = kr_activation_row_bytes(s->kv_type, hd);
    for (int64_t i = i0; i < i1; i++) {
        int32_t t = (int32_t)(i / group), head = kv_head * group + (int32_t)(i % group);
        const float *q = s->q + (size_t)t * (size_t)m->q_dim + (size_t)head * (size_t)hd;
        uint8_t *query = queries + (size_t)(i - i0) * query_bytes;
        if (s->kv_type == KR_Q8_0) kr_quantize_row_q8_0(q, (kr_block_q8_0 *)query, hd);
        else memcpy(query, q, (size_t)hd * sizeof(float));
        begin[i - i0] = first_visible(m, j->layer, j->pos + t) - base;
        end[i - i0] = j->pos + t - base + 1;
        out[i - i0] = s->att + (size_t)t * (size_t)m->q_dim + (size_t)head * (size_t)hd;
    }
    size_t row = kv_bytes(s, hd);
    const uint8_t *keys = cache_head(s, s->k_cache, j->layer, kv_head) + (size_t)base * row;
    if (s->kv_type == KR_Q8_0)  // speed hook: the integer kernel
        kr_matmul(KR_Q8_0, keys, hd, queries, n_queries, scores, span, 0, span);
    else  // kr_matmul's bits, fewer operations per score, and only up to each query's own position
        kr_attend_scores(s->kv_type, keys, row, hd, (const float *)queries, n_queries, end, scores, (size_t)span);
    for (int64_t i = 0; i < n_queries; i++)
        kr_attention_softmax(scores + (size_t)i * (size_t)span + begin[i], end[i] - begin[i], h->attn_scale,
                             h->attn_softcap);
    const uint8_t *values = cache_head(s, s->v_cache, j->layer, kv_head) + (size_t)base * row;
    kr_attend_values(s->kv_type, values, row, hd, scores, (size_t)span, begin, end, n_queries, out);
}

// Attention for every query of the step. Split by items (attention_plan).
static void attention_job(void *arg, int chunk, int n_chunks, int thread) {
    step *j = arg;
    kr_session *s = j->s;
    int64_t group = s->model->info.n_heads / s->model->info.n_kv_heads, queries = (int64_t)j->n * group;
    int64_t per_head = (queries + j->att_per_item - 1) / j->att_per_item, begin, end;
    kr_split(j->att_items, 1, chunk, n_chunks, &begin, &end);
    for (int64_t item = begin; item < end; item++) {
        int64_t first = (item % per_head) * j->att_per_item;
        int64_t last = first + j->att_per_item < queries ? first + j->att_per_item : queries;
        attend_block(s, j, (int32_t)(item / per_head), first, last, thread);
    }
}

// The last token only: x += the last MLP's output, then xb[0] = final_norm(x), prepared as row 0.
static void final_norm(kr_session *s, int32_t n, const float *add, const float *add_norm) {
    const kr_model *m = s->model;
    int64_t dim = m->info.dim;
    float *x = s->x + (int64_t)(n - 1) * dim, *last_add = (float *)add + (int64_t)(n - 1) * dim;
    if (add_norm) rms_norm(last_add, add_norm, last_add, dim, m->info.norm_eps);
    for (int64_t i = 0; i < dim; i++) x[i] += last_add[i];
    rms_norm(x, m->output_norm, s->xb, dim, m->info.norm_eps);
    kr_prepare_activations(m->output.type, s->xb, dim, s->prepared[m->output.type], 0, 1);
}

// Logits of j->n tokens from prepared rows 0..n: out (n, n_vocab) = xb W_out^T, soft-capped.
// Split by rows.
static void output_job(void *arg, int chunk, int n_chunks, int thread) {
    step *j = arg;
    kr_session *s = j->s;
    const kr_model *m = s->model;
    const kr_matrix *w = &m->output;
    int64_t begin, end;
    kr_split(w->rows, ROW_ALIGN, chunk, n_chunks, &begin, &end);
    if (begin >= end) return;
    kr_matrix_matmul(w, s->prepared[w->type], j->n, j->logits, begin, end);
    float cap = m->info.final_softcap;
    if (cap > 0)
        for (int64_t t = 0; t < j->n; t++)
            for (int64_t r = begin; r < end; r++) j->logits[t * w->rows + r] = cap * tanhf(j->logits[t * w->rows + r] / cap);
}

// --- One step of up to n_batch tokens

static void rope_tables(kr_session *s, int32_t n, int32_t pos) {
    const kr_model *m = s->model;
    int32_t half = m->info.rope_dims / 2;
    for (int32_t kind = 0; kind < 2; kind++) {
        const float *inv_freq = kind ? m->inv_freq_local : m->inv_freq_full;
        for (int32_t t = 0; t < n; t++) {
            size_t row = ((size_t)kind * (size_t)s->n_batch + (size_t)t) * (size_t)half;
            for (int32_t i = 0; i < half; i++) {
                float angle = (float)(pos + t) * inv_freq[i];
                s->rope_cos[row + i] = cosf(angle);
                s->rope_sin[row + i] = sinf(angle);
            }
        }
    }
}

static int row_chunks(const kr_pool *pool, int64_t rows) {
    return kr_pool_chunks(pool, (rows + ROW_ALIGN - 1) / ROW_ALIGN);
}

// logits: NULL, the last token's (n_vocab,), or with all_logits every token's (n, n_vocab).
static void forward_step(kr_session *s, const int32_t *tokens, int32_t n, float *logits, bool all_logits) {
    kr_model *m = s->model;
    const kr_model_info *h = &m->info;
    kr_pool *pool = m->pool;
    rope_tables(s, n, s->n_tokens);
    int token_chunks = kr_pool_chunks(pool, n);
    const float *pending_add = NULL, *pending_norm = NULL;  // the previous MLP's output, not yet added
    for (int32_t layer = 0; layer < h->n_layers; layer++) {
        const kr_layer *l = &m->layers[layer];
        step j = {.s = s, .n = n, .pos = s->n_tokens, .layer = layer};

        j.tokens = layer == 0 ? tokens : NULL;
        j.add = pending_add, j.add_norm = pending_norm, j.norm = l->attn_norm;
        j.w[0] = &l->wq, j.w[1] = &l->wk, j.w[2] = &l->wv, j.n_w = 3;
        kr_pool_run(pool, residual_job, &j, token_chunks);

        j.out[0] = s->q, j.out[1] = s->k, j.out[2] = s->v;
        j.bias[0] = l->bq, j.bias[1] = l->bk, j.bias[2] = l->bv;
        kr_pool_run(pool, matmul_job, &j, row_chunks(pool, l->wq.rows));
        kr_pool_run(pool, rope_job, &j, token_chunks);
        j.att_items = attention_plan(s, n, &j.att_per_item);
        kr_pool_run(pool, attention_job, &j, kr_pool_chunks(pool, j.att_items));

        step o = {.s = s, .n = n, .layer = layer, .input = s->att, .input_cols = m->q_dim, .n_w = 1};
        o.w[0] = &l->wo, o.out[0] = s->proj;
        kr_pool_run(pool, prepare_job, &o, token_chunks);
        kr_pool_run(pool, matmul_job, &o, row_chunks(pool, l->wo.rows));

        step f = {.s = s, .n = n, .layer = layer, .add = s->proj, .add_norm = l->post_attn_norm, .norm = l->ffn_norm};
        f.w[0] = &l->gate, f.w[1] = &l->up, f.n_w = 2;
        f.out[0] = s->gate, f.out[1] = s->up, f.gated = true;
        kr_pool_run(pool, residual_job, &f, token_chunks);
        kr_pool_run(pool, matmul_job, &f, row_chunks(pool, l->gate.rows));

        step d = {.s = s, .n = n, .layer = layer, .input = s->gate, .input_cols = h->ffn_dim, .n_w = 1};
        d.w[0] = &l->down, d.out[0] = s->proj;
        kr_pool_run(pool, prepare_job, &d, token_chunks);
        kr_pool_run(pool, matmul_job, &d, row_chunks(pool, l->down.rows));
        pending_add = s->proj, pending_norm = l->post_ffw_norm;
    }
    s->n_tokens += n;
    if (!logits) return;
    if (all_logits) {  // every token: final_norm's add and norm row by row, then one matmul of n rows
        step f = {.s = s, .n = n, .add = pending_add, .add_norm = pending_norm, .norm = m->output_norm, .n_w = 1};
        f.w[0] = &m->output;
        kr_pool_run(pool, residual_job, &f, token_chunks);
        step out = {.s = s, .n = n, .logits = logits};
        kr_pool_run(pool, output_job, &out, row_chunks(pool, m->output.rows));
        return;
    }
    // Only the last token needs the final residual add and the output head.
    final_norm(s, n, pending_add, pending_norm);
    step out = {.s = s, .n = 1, .logits = logits};
    kr_pool_run(pool, output_job, &out, row_chunks(pool, m->output.rows));
}

// kr_session_eval and kr_session_eval_all: logits of the last token, or of every token (all_logits).
static int session_eval(kr_session *s, const int32_t *tokens, int32_t n, float *logits, bool all_logits,
                        kr_error *err) {
    if (!s) return kr_fail(err, KR_ERR_ARGUMENT, "kr_session_eval: session is NULL");
    if (!tokens || n < 1) return kr_fail(err, KR_ERR_ARGUMENT, "no tokens to evaluate");
    if (all_logits && !logits) return kr_fail(err, KR_ERR_ARGUMENT, "kr_session_eval_all: logits_out is NULL");
    kr_model *m = s->model;
    if (n > s->n_ctx - s->n_tokens)
        return kr_fail(err, KR_ERR_CONTEXT, "%d tokens after %d do not fit in the context of %d", n, s->n_tokens,
                       s->n_ctx);
    for (int32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= m->info.n_vocab)
            return kr_fail(err, KR_ERR_ARGUMENT, "token id %d at index %d is outside [0, %d)", tokens[i], i,
                           m->info.n_vocab);
    int expected = 0;
    if (!atomic_compare_exchange_strong(&m->busy, &expected, 1))
        return kr_fail(err, KR_ERR_STATE, "the model is busy: another session is evaluating");
    for (int32_t done = 0; done < n; done += s->n_batch) {
        int32_t count = n - done < s->n_batch ? n - done : s->n_batch;
        float *step_logits = all_logits ? logits + (size_t)done * (size_t)m->info.n_vocab
                                        : done + count == n ? logits : NULL;
        if (s->ext) {  // qwen35 hook
            kr_qwen35_step(s->ext, tokens + done, count, s->n_tokens, step_logits, all_logits);
            s->n_tokens += count;
            continue;
        }
        forward_step(s, tokens + done, count, step_logits, all_logits);
    }
    atomic_store(&m->busy, 0);
    kr_ok(err);
    return KR_OK;
}

int kr_session_eval(kr_session *s, const int32_t *tokens, int32_t n, float *logits, kr_error *err) {
    return session_eval(s, tokens, n, logits, false, err);
}

int kr_session_eval_all(kr_session *s, const int32_t *tokens, int32_t n, float *logits, kr_error *err) {
    return session_eval(s, tokens, n, logits, true, err);
}
