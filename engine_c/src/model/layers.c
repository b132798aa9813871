// layers.c: the pieces every architecture's step is built from, over a batch of tokens that may
// belong to several sequences at different positions (model.h, kr_batch).
//
// Each phase is one pool job; a job splits its work either by tokens or by output rows, never
// along a reduction, and every value is computed by the same code whatever the split. A token's
// values read only its own rows, its own sequence's cache and the weights, so logits are bitwise
// identical for any batch size, any thread count, a prompt evaluated in one call or several, and
// whichever other sequences share the step (docs/architecture.md). A llama layer is
//
//   xb = norm(x) -> q, k, v = xb W^T (+ bias) -> q/k head norms, RoPE, K/V into each token's cache
//   -> attention per (KV head, block of queries of one sequence) [* sigmoid(gate)] -> o = att Wo^T
//   [-> post-norm] -> x += o;  xb = norm(x) -> h = act(xb Wg^T) * (xb Wu^T) -> d = h Wd^T
//   [-> post-norm] -> x += d
//
// and other architectures swap the mixer (arch_qwen35.c: DeltaNet layers).
#include "kernels/attention.h"
#include "kernels/deltanet.h"
#include "kernels/kernels.h"
#include "model/model.h"

#include <math.h>
#include <string.h>

#define ROW_ALIGN 16  // matmul row chunks per thread: whole multiples, for the kernels' row tiles

typedef struct {
    kr_model *m;
    kr_scratch *s;
    const kr_batch *b;
    int32_t n;               // tokens (rows) the job covers
    const kr_attention *attn;
    const int32_t *tokens;   // residual job: embed these into x first
    float *add;              // residual job: x += add (after add_norm when set)
    const float *add_norm;
    const float *norm;       // residual job: xb = norm(x)
    const float *input;      // prepare job: rows to prepare (n x input_cols)
    int64_t input_cols;
    const kr_matrix *w[4];   // matmul job: up to four matrices reading the same input
    float *out[4];
    const float *bias[4];
    int32_t n_w;
    bool gated;              // matmul job on gate/up: then gate = act(gate) * up
    const kr_matrix *then;   // one token: also prepare this matrix's input from the job's outputs as
                             // they are made (gated matmul job: its rows of gate, into s->gate_prepared;
                             // attention job: its heads' outputs)
    const void *prepared;    // matmul job: the matrices' prepared input, if not s->prepared[type]
    int64_t n_blocks;        // attention job: blocks of queries (attention_plan), items n_kv_heads x n_blocks
    bool whole_heads;        // attention job: one token, one block per KV head (attention_job)
    const int32_t *out_tokens;  // output job: the batch tokens whose logits are wanted
} job;

// Matmuls are split by rows, in units of whole multiples of an alignment. Those of several tokens,
// bound by arithmetic, go in tapered chunks (threads.h), so no thread waits long for the last. One
// token's stream their weights from memory: each thread takes the runs of a contiguous share
// (kr_pool_run_shares), one stream a matrix (a column slice, kernels.h's kr_slice_blocks), where
// tapered chunks made every thread start a stream at each of its chunks (kernels.h, KR_STREAM_AHEAD).
static void run_rows(kr_pool *pool, kr_pool_range_fn run, void *j, int64_t units, int32_t n) {
    if (n == 1) kr_pool_run_shares(pool, run, j, units);
    else kr_pool_run_tapered(pool, run, j, units);
}

// The first row of unit u of a matrix of `rows` rows, in units of `align` rows (the end, past its last).
static int64_t unit_row(int64_t u, int64_t align, int64_t rows) { return u * align < rows ? u * align : rows; }

// Rows per unit of a matmul job: ROW_ALIGN, or whole prepared blocks of `then`'s input when the job
// prepares it (block sizes and ROW_ALIGN are powers of 2).
static int64_t part_rows(const kr_matrix *then) {
    const int64_t block = then ? kr_activation_block(then->type) : 1;
    return block > ROW_ALIGN ? block : ROW_ALIGN;
}

// The query heads' outputs of one KV head: a run of the attention output row.
static int64_t kv_head_columns(const kr_model *m) { return m->q_dim / m->info.n_kv_heads; }

// out = x / rms(x) * weight over n values; sum of squares in kr_dot_f32's fixed order.
static void rms_norm(const float *x, const float *weight, float *out, int64_t n, float eps) {
    float mean_square = kr_dot_f32(x, x, n) / (float)n;
    float scale = 1.0f / sqrtf(mean_square + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * scale * weight[i];
}

void kr_rope_head(float *head, const float *cos_row, const float *sin_row, int32_t rope_dims, int32_t style) {
    int32_t half = rope_dims / 2;
    for (int32_t i = 0; i < half; i++) {
        int32_t a = style == KR_ROPE_NEOX ? i : 2 * i;
        int32_t b = style == KR_ROPE_NEOX ? i + half : 2 * i + 1;
        float x0 = head[a], x1 = head[b], c = cos_row[i], s = sin_row[i];
        head[a] = x0 * c - x1 * s;
        head[b] = x0 * s + x1 * c;
    }
}

// The (n_ctx, head_dim) keys or values of one cache layer's KV head.
static uint8_t *cache_head(const kr_model *m, const kr_kv_cache *kv, uint8_t *cache, int32_t layer, int32_t kv_head) {
    size_t heads = (size_t)layer * (size_t)m->info.n_kv_heads + (size_t)kv_head;
    return cache + heads * (size_t)kv->n_ctx * kv->row_bytes;
}

void kr_rope_tables(kr_model *m, kr_scratch *s, const kr_batch *b) {
    int32_t half = m->info.rope_dims / 2;
    for (int32_t kind = 0; kind < 2; kind++) {
        const float *inv_freq = kind ? m->inv_freq_local : m->inv_freq_full;
        for (int32_t t = 0; t < b->n; t++) {
            size_t row = ((size_t)kind * (size_t)s->n_batch + (size_t)t) * (size_t)half;
            for (int32_t i = 0; i < half; i++) {
                float angle = (float)b->pos[t] * inv_freq[i];
                s->rope_cos[row + i] = cosf(angle);
                s->rope_sin[row + i] = sinf(angle);
            }
        }
    }
}

// --- Residual, prepare and matmul jobs

static void prepare_rows(kr_scratch *s, const kr_matrix *const *w, int32_t n_w, const float *input, int64_t cols,
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
    job *j = arg;
    kr_scratch *s = j->s;
    const kr_model *m = j->m;
    const kr_model_info *h = &m->info;
    int64_t dim = h->dim, begin, end;
    kr_split(j->n, 1, chunk, n_chunks, &begin, &end);
    for (int64_t t = begin; t < end; t++) {
        float *x = s->x + t * dim;
        if (j->tokens) {
            const kr_matrix *e = &m->token_embd;
            if (e->packed) {
                kr_dequantize_packed_row(e->type, e->data, e->rows, e->cols, j->tokens[t], x);
            } else {
                const uint8_t *row = (const uint8_t *)e->data + (size_t)j->tokens[t] * e->row_bytes;
                kr_dequantize_row(e->type, row, x, dim);
            }
            if (h->embedding_scale != 1.0f)
                for (int64_t i = 0; i < dim; i++) x[i] *= h->embedding_scale;
        }
        if (j->add) {
            float *add = j->add + t * dim;
            if (j->add_norm) rms_norm(add, j->add_norm, add, dim, h->norm_eps);
            for (int64_t i = 0; i < dim; i++) x[i] += add[i];
        }
        rms_norm(x, j->norm, s->xb + t * dim, dim, h->norm_eps);
    }
    if (begin < end) prepare_rows(s, j->w, j->n_w, s->xb, dim, begin, end);
}

// Prepare `input` for the matrices of the job. Split by tokens.
static void prepare_job(void *arg, int chunk, int n_chunks, int thread) {
    job *j = arg;
    int64_t begin, end;
    kr_split(j->n, 1, chunk, n_chunks, &begin, &end);
    if (begin < end) prepare_rows(j->s, j->w, j->n_w, j->input, j->input_cols, begin, end);
}

// A matmul job's units: blocks of part_rows rows of its matrices one after the other, so a run of
// units is rows of one matrix or of consecutive ones; a gated job's are gate's, and each unit also
// covers up's same rows.
static int64_t matmul_units(const job *j) {
    const int64_t align = part_rows(j->then);
    int64_t units = 0;
    for (int32_t i = 0; i < (j->gated ? 1 : j->n_w); i++) units += (j->w[i]->rows + align - 1) / align;
    return units;
}

// out_i = input W_i^T (+ bias_i) on the rows of units [u0, u1). With `gated`, out[0] becomes
// act(out[0]) * out[1] on the same rows.
static void matmul_run(void *arg, int64_t u0, int64_t u1, int thread) {
    job *j = arg;
    kr_scratch *s = j->s;
    const int64_t align = part_rows(j->then);
    int64_t begin[4], end[4], first = 0;  // first: the matrix's first unit
    for (int32_t i = 0; i < j->n_w; i++) {
        const kr_matrix *w = j->w[i];
        const int64_t b0 = u0 - first > 0 ? u0 - first : 0, b1 = u1 - first;
        begin[i] = unit_row(b0, align, w->rows);
        end[i] = unit_row(b1, align, w->rows);
        if (!j->gated) first += (w->rows + align - 1) / align;
        if (begin[i] >= end[i]) continue;
        kr_matrix_matmul(w, j->prepared ? j->prepared : s->prepared[w->type], j->n, j->out[i], begin[i], end[i]);
        if (j->bias[i])
            for (int64_t t = 0; t < j->n; t++)
                for (int64_t r = begin[i]; r < end[i]; r++) j->out[i][t * w->rows + r] += j->bias[i][r];
    }
    if (j->gated && begin[0] < end[0]) {
        int64_t rows = j->w[0]->rows;
        bool gelu = j->m->info.activation == KR_ACT_GELU_TANH;
        for (int64_t t = 0; t < j->n; t++) {
            float *g = j->out[0] + t * rows, *u = j->out[1] + t * rows;
            // speed: the vector kernels (kernels.h), the same bits in every build
            if (gelu) kr_gelu_tanh_mul_f32(g + begin[0], u + begin[0], end[0] - begin[0]);
            else kr_silu_mul_f32(g + begin[0], u + begin[0], end[0] - begin[0]);
        }
        if (j->then) kr_prepare_columns(j->then->type, j->out[0], begin[0], end[0], s->gate_prepared);  // one token
    }
}

void kr_residual(kr_model *m, kr_scratch *s, const kr_batch *b, const int32_t *tokens, float *add,
                 const float *add_norm, const float *norm, const kr_matrix *const *w, int32_t n_w) {
    job j = {.m = m, .s = s, .b = b, .n = b->n, .tokens = tokens, .add = add, .add_norm = add_norm, .norm = norm,
             .n_w = n_w};
    for (int32_t i = 0; i < n_w; i++) j.w[i] = w[i];
    kr_pool_run(m->pool, residual_job, &j, kr_pool_chunks(m->pool, b->n));
}

// What a matmul job does besides multiplying (the job's fields of the same names).
typedef struct {
    bool gated;
    const kr_matrix *then;
    const void *prepared;
} matmul_options;

// Prepare (unless input is NULL) and multiply, with `options` (NULL: none).
static void matmuls(kr_model *m, kr_scratch *s, int32_t n, const float *input, int64_t cols, int32_t n_w,
                    const kr_matrix *const *w, float *const *out, const float *const *bias,
                    const matmul_options *options) {
    const matmul_options none = {0}, *o = options ? options : &none;
    job j = {.m = m, .s = s, .n = n, .input = input, .input_cols = cols, .n_w = n_w, .gated = o->gated,
             .then = o->then, .prepared = o->prepared};
    for (int32_t i = 0; i < n_w; i++) j.w[i] = w[i], j.out[i] = out[i], j.bias[i] = bias ? bias[i] : NULL;
    if (input) kr_pool_run(m->pool, prepare_job, &j, kr_pool_chunks(m->pool, n));
    run_rows(m->pool, matmul_run, &j, matmul_units(&j), n);
}

void kr_matmuls(kr_model *m, kr_scratch *s, int32_t n, const float *input, int64_t cols, int32_t n_w,
                const kr_matrix *const *w, float *const *out, const float *const *bias) {
    matmuls(m, s, n, input, cols, n_w, w, out, bias, NULL);
}

void kr_mlp_rows(kr_model *m, kr_scratch *s, int32_t n, const float *input, const kr_mlp *l) {
    const kr_matrix *gate_up[] = {&l->gate, &l->up}, *down[] = {&l->down};
    float *gate_up_out[] = {s->gate, s->up}, *down_out[] = {s->proj};
    // One token: each thread prepares the down matrix's input from the rows of gate it computed,
    // while they are in its cache, instead of one thread preparing all of them after a join, reading
    // the other threads' rows from their caches (Qwen2.5-Coder-1.5B, two threads: 1.02x). Into a
    // buffer of its own: the gate/up matrices may be of the down matrix's type and still be reading
    // theirs.
    const bool fused = n == 1;
    const matmul_options gate_up_options = {.gated = true, .then = fused ? &l->down : NULL},
                         down_options = {.prepared = fused ? s->gate_prepared : NULL};
    matmuls(m, s, n, input, m->info.dim, 2, gate_up, gate_up_out, NULL, &gate_up_options);
    matmuls(m, s, n, fused ? NULL : s->gate, m->info.ffn_dim, 1, down, down_out, NULL, &down_options);
}

void kr_mlp_block(kr_model *m, kr_scratch *s, const kr_batch *b, const kr_mlp *l) {
    kr_mlp_rows(m, s, b->n, NULL, l);
}

// --- Attention

// Token t's query heads of KV heads [kv_begin, kv_end) and those KV heads: q (from the q | gate rows
// when gated) and k head norms, RoPE, then K and V into the token's sequence cache at its position.
// Each head's operations are its own, so heads may be done in any split.
static void rope_heads(const job *j, int64_t t, int32_t kv_begin, int32_t kv_end) {
    kr_scratch *s = j->s;
    const kr_batch *b = j->b;
    const kr_model *m = j->m;
    const kr_model_info *h = &m->info;
    const kr_attention *l = j->attn;
    int32_t half = h->rope_dims / 2, hd = h->head_dim, group = h->n_heads / h->n_kv_heads;
    size_t table = ((size_t)l->sliding * (size_t)s->n_batch + (size_t)t) * (size_t)half;
    const float *c = s->rope_cos + table, *sn = s->rope_sin + table;
    float *q = s->q + t * m->q_dim, *k = s->k + t * m->kv_dim, *v = s->v + t * m->kv_dim;
    bool head_norms = !l->qk_norm_whole;
    for (int32_t head = kv_begin * group; head < kv_end * group; head++) {
        if (l->gated) memcpy(q + head * hd, s->qg + t * 2 * m->q_dim + head * 2 * hd, (size_t)hd * sizeof(float));
        if (l->q_norm && head_norms) rms_norm(q + head * hd, l->q_norm, q + head * hd, hd, h->norm_eps);
        if (!l->no_rope) kr_rope_head(q + head * hd, c, sn, h->rope_dims, h->rope_style);
    }
    for (int32_t head = kv_begin; head < kv_end; head++) {
        if (l->k_norm && head_norms) rms_norm(k + head * hd, l->k_norm, k + head * hd, hd, h->norm_eps);
        if (!l->no_rope) kr_rope_head(k + head * hd, c, sn, h->rope_dims, h->rope_style);
    }
    kr_kv_cache *kv = &b->seq[t]->kv;
    size_t pos = (size_t)b->pos[t];
    for (int32_t head = kv_begin; head < kv_end; head++) {
        uint8_t *key = cache_head(m, kv, kv->k, l->cache_layer, head) + pos * kv->row_bytes;
        uint8_t *value = cache_head(m, kv, kv->v, l->cache_layer, head) + pos * kv->row_bytes;
        const float *k_head = k + head * hd, *v_head = v + head * hd;
        if (kv->type == KR_Q8_0) {  // speed hook: q8_0 rows, blocks of 32
            kr_quantize_row_q8_0(k_head, (kr_block_q8_0 *)key, hd);
            kr_quantize_row_q8_0(v_head, (kr_block_q8_0 *)value, hd);
        } else if (kv->type == KR_F32) {
            memcpy(key, k_head, (size_t)hd * sizeof(float));
            memcpy(value, v_head, (size_t)hd * sizeof(float));
        } else {
            kr_f32_to_f16_row(k_head, (kr_f16 *)key, hd);
            kr_f32_to_f16_row(v_head, (kr_f16 *)value, hd);
        }
    }
}

// Per token: the norms over all heads first when the layer has them (qk_norm_whole), then
// rope_heads of every head. Split by tokens.
static void rope_job(void *arg, int chunk, int n_chunks, int thread) {
    job *j = arg;
    const kr_model *m = j->m;
    const kr_attention *l = j->attn;
    int64_t begin, end;
    kr_split(j->n, 1, chunk, n_chunks, &begin, &end);
    for (int64_t t = begin; t < end; t++) {
        if (l->qk_norm_whole) {
            float *q = j->s->q + t * m->q_dim, *k = j->s->k + t * m->kv_dim;
            rms_norm(q, l->q_norm, q, m->q_dim, m->info.norm_eps);
            rms_norm(k, l->k_norm, k, m->kv_dim, m->info.norm_eps);
        }
        rope_heads(j, t, 0, m->info.n_kv_heads);
    }
}

// The queries of one KV head in a step are numbered i = t * group + g: token t of the batch, g-th
// query head of the KV head's group (GQA). A block is a run of consecutive queries of one
// sequence's consecutive tokens: their keys' scores are one kr_attend_scores (float keys, 2 queries
// per pass over them) or kr_matmul (q8_0 keys, the keys read once for all), then a softmax per
// query, then their weighted sums of values one kr_attend_values (the values read once per 4
// queries). Each gives every (query, position) the same bits however the queries are grouped, so
// attention does not depend on the batch, the thread count, the split or the other sequences.
//
// Blocks hold whole tokens where the scratch allows; on several threads, blocks small enough that
// each thread gets some even at one token (generation). At one token, no more blocks than threads:
// each block reads its KV head's keys and values whole, so blocks past one per thread read the same
// rows again on another core (Qwen2.5-Coder-1.5B, two threads, 2 KV heads of 6 queries: three
// blocks of 2 per head before, 1.03x faster as one block of 6). Returns the number of blocks.
static int64_t attention_plan(const kr_model *m, kr_scratch *s, const kr_batch *b) {
    const kr_model_info *h = &m->info;
    int64_t group = h->n_heads / h->n_kv_heads, queries = (int64_t)b->n * group, size = s->att_queries;
    if (size >= group) size -= size % group;
    int64_t wanted = b->n == 1 ? kr_pool_size(m->pool) : kr_pool_chunks(m->pool, (int64_t)b->n * h->n_heads);
    int64_t per_head = (wanted + h->n_kv_heads - 1) / h->n_kv_heads;
    if ((queries + size - 1) / size < per_head) size = (queries + per_head - 1) / per_head;
    int64_t n_blocks = 0;
    for (int32_t t = 0; t < b->n;) {
        int32_t run_end = t + 1;
        while (run_end < b->n && b->seq[run_end] == b->seq[t] && b->pos[run_end] == b->pos[run_end - 1] + 1) run_end++;
        for (int64_t i = t * group; i < run_end * group; i += size, n_blocks++) {
            s->att_blocks[2 * n_blocks] = (int32_t)i;
            s->att_blocks[2 * n_blocks + 1] = (int32_t)(i + size < run_end * group ? i + size : run_end * group);
        }
        t = run_end;
    }
    return n_blocks;
}

// First position a query at `pos` sees: a sliding layer sees the last sliding_window positions,
// itself included (as transformers' sliding_window_overlay and llama.cpp's is_masked_swa).
static int32_t first_visible(const kr_model *m, const kr_attention *l, int32_t pos) {
    int32_t window = m->info.sliding_window;
    return l->sliding && pos >= window ? pos - window + 1 : 0;
}

// Queries [i0, i1) of one KV head (one sequence): att = softmax(scale * q K^T [softcap], window
// [, the head's sink]) V [* sigmoid(gate)]. Scores and weights are indexed from `base`, the first position any of them
// sees; positions a query does not see may be scored (for the queries it shares a tile with) but
// are never used.
static void attend_block(const job *j, int32_t kv_head, int64_t i0, int64_t i1, int thread) {
    const kr_model *m = j->m;
    kr_scratch *s = j->s;
    const kr_batch *b = j->b;
    const kr_attention *l = j->attn;
    const kr_model_info *h = &m->info;
    int32_t hd = h->head_dim, group = h->n_heads / h->n_kv_heads;
    int64_t n_queries = i1 - i0;
    int32_t t0 = (int32_t)(i0 / group), t1 = (int32_t)((i1 - 1) / group);
    const kr_kv_cache *kv = &b->seq[t0]->kv;
    int32_t base = first_visible(m, l, b->pos[t0]), span = b->pos[t1] - base + 1;
    float *scores = s->scores + (size_t)thread * (size_t)s->att_queries * (size_t)s->n_ctx;
    uint8_t *queries = (uint8_t *)(s->att_q + (size_t)thread * (size_t)s->att_queries * (size_t)hd);
    int32_t begin[KR_ATT_MAX_QUERIES], end[KR_ATT_MAX_QUERIES];
    float *out[KR_ATT_MAX_QUERIES];
    // Float keys read the f32 queries as they are; speed hook: q8_0 keys take q8_0 queries.
    size_t query_bytes = kr_activation_row_bytes(kv->type, hd);
    for (int64_t i = i0; i < i1; i++) {
        int32_t t = (int32_t)(i / group), head = kv_head * group + (int32_t)(i % group);
        const float *q = s->q + (size_t)t * (size_t)m->q_dim + (size_t)head * (size_t)hd;
        uint8_t *query = queries + (size_t)(i - i0) * query_bytes;
        if (kv->type == KR_Q8_0) kr_quantize_row_q8_0(q, (kr_block_q8_0 *)query, hd);
        else memcpy(query, q, (size_t)hd * sizeof(float));
        begin[i - i0] = first_visible(m, l, b->pos[t]) - base;
        end[i - i0] = b->pos[t] - base + 1;
        out[i - i0] = s->att + (size_t)t * (size_t)m->q_dim + (size_t)head * (size_t)hd;
    }
    const uint8_t *keys = cache_head(m, kv, kv->k, l->cache_layer, kv_head) + (size_t)base * kv->row_bytes;
    if (kv->type == KR_Q8_0)  // speed hook: the integer kernel
        kr_matmul(KR_Q8_0, keys, hd, queries, n_queries, scores, span, 0, span);
    else  // kr_matmul's bits, fewer operations per score, and only up to each query's own position
        kr_attend_scores(kv->type, keys, kv->row_bytes, hd, (const float *)queries, n_queries, end, scores,
                         (size_t)span);
    for (int64_t i = 0; i < n_queries; i++) {
        float sink = l->sinks ? l->sinks[kv_head * group + (int32_t)((i0 + i) % group)] : -INFINITY;
        kr_attention_softmax(scores + (size_t)i * (size_t)span + begin[i], end[i] - begin[i], h->attn_scale,
                             h->attn_softcap, sink);
    }
    const uint8_t *values = cache_head(m, kv, kv->v, l->cache_layer, kv_head) + (size_t)base * kv->row_bytes;
    kr_attend_values(kv->type, values, kv->row_bytes, hd, scores, (size_t)span, begin, end, n_queries, out);
    if (l->gated)
        for (int64_t i = i0; i < i1; i++) {
            int32_t t = (int32_t)(i / group), head = kv_head * group + (int32_t)(i % group);
            kr_sigmoid_mul_f32(out[i - i0], s->qg + (size_t)t * 2 * m->q_dim + (size_t)head * 2 * hd + hd, hd);
        }
}

// Attention for every query of the step. Split by items: (KV head, block). With `whole_heads`
// (one token, one block per KV head) an item first does its KV head's rope_heads, and with
// `then` it prepares its heads' outputs for that matrix (Wo) afterwards.
static void attention_job(void *arg, int chunk, int n_chunks, int thread) {
    job *j = arg;
    const kr_model *m = j->m;
    const int64_t columns = kv_head_columns(m);
    int64_t begin, end;
    kr_split(m->info.n_kv_heads * j->n_blocks, 1, chunk, n_chunks, &begin, &end);
    for (int64_t item = begin; item < end; item++) {
        const int32_t *block = j->s->att_blocks + 2 * (item % j->n_blocks);
        const int32_t kv_head = (int32_t)(item / j->n_blocks);
        if (j->whole_heads) rope_heads(j, 0, kv_head, kv_head + 1);
        attend_block(j, kv_head, block[0], block[1], thread);
        if (j->then)
            kr_prepare_columns(j->then->type, j->s->att, kv_head * columns, (kv_head + 1) * columns,
                               j->s->prepared[j->then->type]);
    }
}

void kr_attention_block(kr_model *m, kr_scratch *s, const kr_batch *b, const kr_attention *l) {
    kr_pool *pool = m->pool;
    const kr_matrix *qkv[] = {&l->wq, &l->wk, &l->wv}, *wo[] = {&l->wo};
    float *qkv_out[] = {l->gated ? s->qg : s->q, s->k, s->v}, *wo_out[] = {s->proj};
    const float *bias[] = {l->bq, l->bk, l->bv}, *wo_bias[] = {l->bo};
    matmuls(m, s, b->n, NULL, m->info.dim, 3, qkv, qkv_out, bias, NULL);
    job j = {.m = m, .s = s, .b = b, .n = b->n, .attn = l};
    j.n_blocks = attention_plan(m, s, b);
    // One token whose KV heads are one block each: each thread does its heads' RoPE, attention and
    // Wo's prepared input, so their rows stay in its cache and no thread waits for another in
    // between (Qwen2.5-Coder-1.5B, two threads: 1.01x, 14 rounds). Wo's input is prepared so when a
    // KV head's outputs are whole prepared blocks.
    j.whole_heads = b->n == 1 && j.n_blocks == 1 && !l->qk_norm_whole;
    j.then = j.whole_heads && kv_head_columns(m) % kr_activation_block(l->wo.type) == 0 ? &l->wo : NULL;
    if (!j.whole_heads) kr_pool_run(pool, rope_job, &j, kr_pool_chunks(pool, b->n));
    kr_pool_run(pool, attention_job, &j, kr_pool_chunks(pool, m->info.n_kv_heads * j.n_blocks));
    matmuls(m, s, b->n, j.then ? NULL : s->att, m->q_dim, 1, wo, wo_out, wo_bias, NULL);
}

// --- Output head

// Logits of the tokens asked for from prepared rows 0..n-1: out = xb W_out^T, soft-capped. Split
// by rows; tokens whose logits lie one after the other (kr_session_eval_all) go in one matmul.
static void output_run(void *arg, int64_t u0, int64_t u1, int thread) {
    job *j = arg;
    const kr_model *m = j->m;
    const kr_matrix *w = &m->output;
    const int64_t begin = unit_row(u0, ROW_ALIGN, w->rows), end = unit_row(u1, ROW_ALIGN, w->rows);
    if (begin >= end) return;
    size_t row = kr_activation_row_bytes(w->type, m->info.dim);
    float cap = m->info.final_softcap;
    for (int32_t k = 0, run; k < j->n; k += run) {
        float *logits = j->b->logits[j->out_tokens[k]];
        for (run = 1; k + run < j->n && j->b->logits[j->out_tokens[k + run]] == logits + run * w->rows;) run++;
        kr_matrix_matmul(w, (const char *)j->s->prepared[w->type] + (size_t)k * row, run, logits, begin, end);
        if (cap > 0)
            for (int64_t t = 0; t < run; t++)
                for (int64_t r = begin; r < end; r++)
                    logits[t * w->rows + r] = cap * tanhf(logits[t * w->rows + r] / cap);
    }
}

void kr_output(kr_model *m, kr_scratch *s, const kr_batch *b, float *add, const float *add_norm) {
    int64_t dim = m->info.dim;
    if (b->hidden) {  // kr_session_embed: hidden states, no head
        for (int32_t t = 0; t < b->n; t++) {
            if (!b->hidden[t]) continue;
            float *x = s->x + (int64_t)t * dim, *last = add + (int64_t)t * dim;
            if (add_norm) rms_norm(last, add_norm, last, dim, m->info.norm_eps);
            for (int64_t i = 0; i < dim; i++) x[i] += last[i];
            rms_norm(x, m->output_norm, b->hidden[t], dim, m->info.norm_eps);
        }
        return;
    }
    if (!b->logits) return;
    int32_t n_out = 0;
    int32_t *wanted = s->att_blocks;  // free again after the last layer's attention
    for (int32_t t = 0; t < b->n; t++) {
        if (!b->logits[t]) continue;
        // x += the last block's output, then xb[n_out] = final_norm(x)
        float *x = s->x + (int64_t)t * dim, *last = add + (int64_t)t * dim;
        if (add_norm) rms_norm(last, add_norm, last, dim, m->info.norm_eps);
        for (int64_t i = 0; i < dim; i++) x[i] += last[i];
        rms_norm(x, m->output_norm, s->xb + (int64_t)n_out * dim, dim, m->info.norm_eps);
        wanted[n_out++] = t;
    }
    if (!n_out) return;
    kr_prepare_activations(m->output.type, s->xb, dim, s->prepared[m->output.type], 0, n_out);
    job j = {.m = m, .s = s, .b = b, .n = n_out, .out_tokens = wanted};
    run_rows(m->pool, output_run, &j, (m->output.rows + ROW_ALIGN - 1) / ROW_ALIGN, n_out);
}
