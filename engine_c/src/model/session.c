// session.c: the public kr_session_*: one sequence (kr_seq: KV cache and recurrent state) and one
// step's scratch (kr_scratch), evaluated n_batch tokens per step through the model's architecture.
//
// kr_seq_new and kr_scratch_new are separate so a step can serve several sequences at once
// (kr_batch): a scratch is as wide as a step, a sequence as long as its context. kr_batch_eval
// runs several sessions' tokens in the same steps on one borrowed scratch; kr_session_eval and
// kr_session_eval_all are its one-item case.
#include "kernels/kernels.h"
#include "model/model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_CTX (1 << 24)
#define MAX_BATCH 65536

struct kr_session {
    kr_model *model;
    int32_t n_tokens;
    kr_seq seq;
    kr_scratch scratch;
    // A step's tokens, positions, sequences and where its logits go, (n_batch,) each: this
    // session's own steps, or any kr_batch_eval's that borrows its scratch.
    int32_t *tokens, *pos;
    int32_t *types;                   // an encoder's token types (kr_session_embed)
    kr_seq **seqs;
    float **logits;
};

// Zeroed memory (calloc: pages of a large buffer are only touched when used, so a large context
// costs memory as it fills, and an impossible one fails here instead of at first touch).
void *kr_zalloc(size_t count, size_t size, bool *failed) {
    size_t bytes;
    void *p = NULL;
    if (__builtin_mul_overflow(count, size, &bytes) || !bytes || !(p = calloc(count, size))) *failed = true;
    return p;
}

// --- Sequences

int kr_seq_new(kr_model *m, kr_seq *seq, int32_t n_ctx, int32_t kv_type, kr_error *err) {
    const kr_model_info *h = &m->info;
    memset(seq, 0, sizeof *seq);
    if (kv_type != KR_F32 && kv_type != KR_F16 && kv_type != KR_Q8_0)
        return kr_fail(err, KR_ERR_ARGUMENT, "KV cache type %d is not one of f32 (0), f16 (1), q8_0 (3)", kv_type);
    // speed hook: KV cache q8_0 quantizes each position's head row in blocks of 32
    if (kv_type == KR_Q8_0 && h->head_dim % KR_QK)
        return kr_fail(err, KR_ERR_UNSUPPORTED, "KV cache q8_0 needs head_dim a multiple of %d, not %d (use f32 or f16)",
                       KR_QK, h->head_dim);
    kr_kv_cache *kv = &seq->kv;
    kv->type = kv_type;
    kv->n_ctx = n_ctx;
    kv->row_bytes = kv_type == KR_Q8_0 ? (size_t)(h->head_dim / KR_QK) * sizeof(kr_block_q8_0)
                                       : (size_t)h->head_dim * (kv_type == KR_F32 ? 4 : 2);
    size_t rows = (size_t)m->n_cache_layers * (size_t)h->n_kv_heads * (size_t)n_ctx;
    bool failed = false;
    if (rows) {
        kv->k = kr_zalloc(rows, kv->row_bytes, &failed);
        kv->v = kr_zalloc(rows, kv->row_bytes, &failed);
    }
    if (failed) {
        kr_seq_free(m, seq);
        return kr_fail(err, KR_ERR_MEMORY, "out of memory for a KV cache of context %d (%.1f MiB)", n_ctx,
                       2.0 * (double)rows * (double)kv->row_bytes / (1 << 20));
    }
    int status = m->arch->seq_new ? m->arch->seq_new(m, seq, err) : KR_OK;
    if (status) kr_seq_free(m, seq);
    return status;
}

void kr_seq_free(kr_model *m, kr_seq *seq) {
    if (m->arch->seq_free) m->arch->seq_free(seq);
    free(seq->kv.k), free(seq->kv.v);
    memset(seq, 0, sizeof *seq);
}

// --- Scratch

int kr_scratch_new(kr_model *m, kr_scratch *s, int32_t n_batch, int32_t n_ctx, kr_error *err) {
    const kr_model_info *h = &m->info;
    memset(s, 0, sizeof *s);
    s->n_batch = n_batch;
    s->n_ctx = n_ctx;
    size_t b = (size_t)n_batch, half = (size_t)h->rope_dims / 2, group = (size_t)(h->n_heads / h->n_kv_heads);
    bool failed = false;
    s->x = kr_zalloc(b * (size_t)h->dim, sizeof(float), &failed);
    s->xb = kr_zalloc(b * (size_t)h->dim, sizeof(float), &failed);
    s->q = kr_zalloc(b * (size_t)m->q_dim, sizeof(float), &failed);
    s->qg = kr_zalloc(b * 2 * (size_t)m->q_dim, sizeof(float), &failed);  // only touched by gated attention
    s->k = kr_zalloc(b * (size_t)m->kv_dim, sizeof(float), &failed);
    s->v = kr_zalloc(b * (size_t)m->kv_dim, sizeof(float), &failed);
    s->att = kr_zalloc(b * (size_t)m->q_dim, sizeof(float), &failed);
    s->proj = kr_zalloc(b * (size_t)h->dim, sizeof(float), &failed);
    s->gate = kr_zalloc(b * (size_t)h->ffn_dim, sizeof(float), &failed);
    s->up = kr_zalloc(b * (size_t)h->ffn_dim, sizeof(float), &failed);
    s->gate_prepared = kr_zalloc((size_t)h->ffn_dim, sizeof(float), &failed);  // f32 rows are the widest prepared
    s->att_queries = KR_ATT_SCORES_BUDGET / n_ctx < 1 ? 1 : KR_ATT_SCORES_BUDGET / n_ctx;
    if (s->att_queries > KR_ATT_MAX_QUERIES) s->att_queries = KR_ATT_MAX_QUERIES;
    size_t threads = (size_t)kr_pool_size(m->pool), att_q = (size_t)s->att_queries;
    s->scores = kr_zalloc(threads * att_q * (size_t)n_ctx, sizeof(float), &failed);
    s->att_q = kr_zalloc(threads * att_q * (size_t)h->head_dim, sizeof(float), &failed);  // q8_0 rows are smaller
    s->att_blocks = kr_zalloc(2 * b * group, sizeof(int32_t), &failed);
    s->rope_cos = kr_zalloc(2 * b * half, sizeof(float), &failed);
    s->rope_sin = kr_zalloc(2 * b * half, sizeof(float), &failed);
    // One prepared-activation buffer per weight type the model uses, as wide as the widest input.
    bool used[KR_TYPE_COUNT] = {false};
    used[m->output.type] = true;
    for (int32_t i = 0; i < m->n_matrices; i++) used[m->matrices[i]->type] = true;
    for (int32_t t = 0; t < KR_TYPE_COUNT; t++)
        if (used[t]) s->prepared[t] = kr_zalloc(kr_activation_bytes(t, n_batch, m->widest_input), 1, &failed);
    if (!failed && m->arch->scratch_new && m->arch->scratch_new(m, s, err)) failed = true;
    if (failed) {
        kr_scratch_free(m, s);
        return kr_fail(err, KR_ERR_MEMORY, "out of memory for a step of %d tokens", n_batch);
    }
    return KR_OK;
}

void kr_scratch_free(kr_model *m, kr_scratch *s) {
    if (m->arch->scratch_free) m->arch->scratch_free(s);
    free(s->x), free(s->xb), free(s->q), free(s->qg), free(s->k), free(s->v), free(s->att), free(s->proj);
    free(s->gate), free(s->up), free(s->gate_prepared), free(s->scores), free(s->att_q), free(s->att_blocks);
    free(s->rope_cos), free(s->rope_sin);
    for (int32_t t = 0; t < KR_TYPE_COUNT; t++) free(s->prepared[t]);
    memset(s, 0, sizeof *s);
}

// --- Sessions

kr_session *kr_session_new(kr_model *m, int32_t n_ctx, int32_t kv_type, int32_t n_batch, kr_error *err) {
    if (!m) {
        kr_fail(err, KR_ERR_ARGUMENT, "kr_session_new: model is NULL");
        return NULL;
    }
    const kr_model_info *h = &m->info;
    if (n_ctx == 0) n_ctx = h->max_seq < KR_DEFAULT_MAX_CTX ? h->max_seq : KR_DEFAULT_MAX_CTX;
    if (n_ctx < 1 || n_ctx > MAX_CTX) {
        kr_fail(err, KR_ERR_ARGUMENT, "context %d is out of range (1 to %d)", n_ctx, MAX_CTX);
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
    if (kr_seq_new(m, &s->seq, n_ctx, kv_type, err)) {
        free(s);
        return NULL;
    }
    bool failed = false;
    s->tokens = kr_zalloc((size_t)n_batch, sizeof *s->tokens, &failed);
    s->pos = kr_zalloc((size_t)n_batch, sizeof *s->pos, &failed);
    s->types = kr_zalloc((size_t)n_batch, sizeof *s->types, &failed);
    s->seqs = kr_zalloc((size_t)n_batch, sizeof *s->seqs, &failed);
    s->logits = kr_zalloc((size_t)n_batch, sizeof *s->logits, &failed);
    if (failed || kr_scratch_new(m, &s->scratch, n_batch, n_ctx, err)) {
        if (failed) kr_fail(err, KR_ERR_MEMORY, "out of memory for a session");
        kr_session_free(s);
        return NULL;
    }
    kr_ok(err);
    return s;
}

void kr_session_free(kr_session *s) {
    if (!s) return;
    kr_seq_free(s->model, &s->seq);
    if (s->scratch.n_batch) kr_scratch_free(s->model, &s->scratch);
    free(s->tokens), free(s->pos), free(s->types), free(s->seqs), free(s->logits);
    free(s);
}

int32_t kr_session_n_tokens(const kr_session *s) { return s ? s->n_tokens : 0; }
int32_t kr_session_n_ctx(const kr_session *s) { return s ? s->seq.kv.n_ctx : 0; }
int32_t kr_session_n_batch(const kr_session *s) { return s ? s->scratch.n_batch : 0; }
int32_t kr_session_kv_type(const kr_session *s) { return s ? s->seq.kv.type : -1; }

int kr_session_truncate(kr_session *s, int32_t n_tokens, kr_error *err) {
    if (!s) return kr_fail(err, KR_ERR_ARGUMENT, "kr_session_truncate: session is NULL");
    if (n_tokens < 0 || n_tokens > s->n_tokens)
        return kr_fail(err, KR_ERR_ARGUMENT, "cannot truncate to %d tokens: the session holds %d", n_tokens,
                       s->n_tokens);
    const kr_arch *arch = s->model->arch;
    int status = arch->truncate ? arch->truncate(s->model, n_tokens, s->n_tokens, err) : KR_OK;
    if (status) return status;
    s->n_tokens = n_tokens;
    kr_ok(err);
    return KR_OK;
}

// Copy the keys and values of src's first n_tokens positions into dst, for every cached layer and
// KV head: dst then holds those positions and nothing after them, as if it had evaluated them.
// A (layer, head) lane holds its positions' rows in order from its start, so this is the first
// n_tokens rows of each lane (the lanes' strides differ when the contexts do).
int kr_session_copy_prefix(kr_session *dst, const kr_session *src, int32_t n_tokens, kr_error *err) {
    if (!dst || !src) return kr_fail(err, KR_ERR_ARGUMENT, "kr_session_copy_prefix: session is NULL");
    if (dst == src) return kr_fail(err, KR_ERR_ARGUMENT, "kr_session_copy_prefix: a session cannot copy from itself");
    kr_model *m = dst->model;
    if (src->model != m) return kr_fail(err, KR_ERR_ARGUMENT, "kr_session_copy_prefix: the sessions belong to different models");
    if (m->arch->seq_new)  // a recurrent state holds only its last position: no prefix of it can be taken
        return kr_fail(err, KR_ERR_UNSUPPORTED, "a %s session keeps a recurrent state: its prefix cannot be copied",
                       m->arch->name);
    const kr_kv_cache *from = &src->seq.kv;
    kr_kv_cache *to = &dst->seq.kv;
    if (from->type != to->type)
        return kr_fail(err, KR_ERR_ARGUMENT, "kr_session_copy_prefix: the KV caches are of different types (%s, %s)",
                       kr_type_name(from->type), kr_type_name(to->type));
    if (n_tokens < 0 || n_tokens > src->n_tokens)
        return kr_fail(err, KR_ERR_ARGUMENT, "cannot copy %d tokens: the source session holds %d", n_tokens, src->n_tokens);
    if (n_tokens > to->n_ctx)
        return kr_fail(err, KR_ERR_CONTEXT, "%d tokens do not fit in the context of %d", n_tokens, to->n_ctx);
    const size_t lanes = (size_t)m->n_cache_layers * (size_t)m->info.n_kv_heads, bytes = (size_t)n_tokens * from->row_bytes;
    for (size_t lane = 0; lane < lanes && bytes; lane++) {
        memcpy(to->k + lane * (size_t)to->n_ctx * to->row_bytes, from->k + lane * (size_t)from->n_ctx * from->row_bytes, bytes);
        memcpy(to->v + lane * (size_t)to->n_ctx * to->row_bytes, from->v + lane * (size_t)from->n_ctx * from->row_bytes, bytes);
    }
    dst->n_tokens = n_tokens;
    kr_ok(err);
    return KR_OK;
}

// --- Evaluation: one session (kr_session_eval*) or several in the same steps (kr_batch_eval)

// Check one item before any work; `prefix` names it in the error ("" for kr_session_eval*).
static int check_item(kr_model *m, const kr_batch_item *item, const char *prefix, kr_error *err) {
    kr_session *s = item->session;
    if (!s) return kr_fail(err, KR_ERR_ARGUMENT, "%ssession is NULL", prefix);
    if (s->model != m) return kr_fail(err, KR_ERR_ARGUMENT, "%sthe session belongs to another model", prefix);
    if (m->arch->encoder)
        return kr_fail(err, KR_ERR_UNSUPPORTED, "%sa %s model is an encoder: it has no logits (kr_session_embed)", prefix,
                       m->arch->name);
    if (!item->tokens || item->n_tokens < 1) return kr_fail(err, KR_ERR_ARGUMENT, "%sno tokens to evaluate", prefix);
    if (item->logits < KR_LOGITS_NONE || item->logits > KR_LOGITS_ALL)
        return kr_fail(err, KR_ERR_ARGUMENT, "%slogits mode %d is not one of none (0), last (1), all (2)", prefix,
                       item->logits);
    if (item->logits != KR_LOGITS_NONE && !item->logits_out)
        return kr_fail(err, KR_ERR_ARGUMENT, "%slogits_out is NULL", prefix);
    if (item->n_tokens > s->seq.kv.n_ctx - s->n_tokens)
        return kr_fail(err, KR_ERR_CONTEXT, "%s%d tokens after %d do not fit in the context of %d", prefix,
                       item->n_tokens, s->n_tokens, s->seq.kv.n_ctx);
    for (int32_t i = 0; i < item->n_tokens; i++)
        if (item->tokens[i] < 0 || item->tokens[i] >= m->info.n_vocab)
            return kr_fail(err, KR_ERR_ARGUMENT, "%stoken id %d at index %d is outside [0, %d)", prefix,
                           item->tokens[i], i, m->info.n_vocab);
    return KR_OK;
}

// Check every item (named when `named`), then run them item after item in steps of the scratch
// of the session with the longest context (its attention scores fit every session's positions).
static int evaluate(kr_model *m, const kr_batch_item *items, int32_t n_items, bool named, kr_error *err) {
    kr_session *owner = NULL;
    char prefix[32] = "";
    for (int32_t k = 0; k < n_items; k++) {
        if (named) snprintf(prefix, sizeof prefix, "item %d: ", k);
        int status = check_item(m, &items[k], prefix, err);
        if (status) return status;
        for (int32_t other = 0; other < k; other++)
            if (items[other].session == items[k].session)
                return kr_fail(err, KR_ERR_ARGUMENT, "%sthe session of item %d is listed again", prefix, other);
        if (!owner || items[k].session->seq.kv.n_ctx > owner->seq.kv.n_ctx) owner = items[k].session;
    }
    int expected = 0;
    if (!atomic_compare_exchange_strong(&m->busy, &expected, 1))
        return kr_fail(err, KR_ERR_STATE, "the model is busy: another session is evaluating");
    int32_t n_batch = owner->scratch.n_batch, n = 0, n_vocab = m->info.n_vocab;
    bool any_logits = false;
    for (int32_t k = 0; k < n_items; k++) {
        const kr_batch_item *item = &items[k];
        kr_session *s = item->session;
        for (int32_t i = 0; i < item->n_tokens; i++) {
            float *row = NULL;
            if (item->logits == KR_LOGITS_ALL) row = item->logits_out + (size_t)i * (size_t)n_vocab;
            else if (item->logits == KR_LOGITS_LAST && i == item->n_tokens - 1) row = item->logits_out;
            owner->tokens[n] = item->tokens[i];
            owner->pos[n] = s->n_tokens + i;
            owner->seqs[n] = &s->seq;
            owner->logits[n] = row;
            any_logits |= row != NULL;
            if (++n < n_batch && !(k == n_items - 1 && i == item->n_tokens - 1)) continue;
            kr_batch batch = {.n = n, .tokens = owner->tokens, .pos = owner->pos, .seq = owner->seqs,
                              .logits = any_logits ? owner->logits : NULL};
            m->arch->step(m, &owner->scratch, &batch);
            n = 0, any_logits = false;
        }
    }
    for (int32_t k = 0; k < n_items; k++) items[k].session->n_tokens += items[k].n_tokens;
    atomic_store(&m->busy, 0);
    kr_ok(err);
    return KR_OK;
}

int kr_batch_eval(kr_model *m, const kr_batch_item *items, int32_t n_items, kr_error *err) {
    if (!m) return kr_fail(err, KR_ERR_ARGUMENT, "kr_batch_eval: model is NULL");
    if (!items || n_items < 1) return kr_fail(err, KR_ERR_ARGUMENT, "kr_batch_eval: no items (%d)", n_items);
    return evaluate(m, items, n_items, true, err);
}

int kr_session_eval(kr_session *s, const int32_t *tokens, int32_t n, float *logits, kr_error *err) {
    if (!s) return kr_fail(err, KR_ERR_ARGUMENT, "kr_session_eval: session is NULL");
    kr_batch_item item = {s, tokens, n, logits ? KR_LOGITS_LAST : KR_LOGITS_NONE, logits};
    return evaluate(s->model, &item, 1, false, err);
}

// Every token's logits; each row the bits kr_session_eval gives for that position.
int kr_session_eval_all(kr_session *s, const int32_t *tokens, int32_t n, float *logits, kr_error *err) {
    if (!s) return kr_fail(err, KR_ERR_ARGUMENT, "kr_session_eval_all: session is NULL");
    kr_batch_item item = {s, tokens, n, KR_LOGITS_ALL, logits};
    return evaluate(s->model, &item, 1, false, err);
}

int kr_test_eval_mixed(kr_session *const *sessions, int32_t n_sessions, const int32_t *tokens, const int32_t *which,
                       int32_t n, float *logits, kr_error *err) {
    if (!sessions || n_sessions < 1 || !tokens || !which || n < 1)
        return kr_fail(err, KR_ERR_ARGUMENT, "kr_test_eval_mixed: no sessions or no tokens");
    for (int32_t k = 0; k < n_sessions; k++) {
        if (!sessions[k] || sessions[k]->model != sessions[0]->model)
            return kr_fail(err, KR_ERR_ARGUMENT, "session %d is NULL or of another model", k);
        if (sessions[k]->seq.kv.n_ctx > sessions[0]->scratch.n_ctx)  // the scratch scores up to its n_ctx
            return kr_fail(err, KR_ERR_ARGUMENT, "session %d's context is longer than session 0's", k);
        for (int32_t other = 0; other < k; other++)
            if (sessions[other] == sessions[k]) return kr_fail(err, KR_ERR_ARGUMENT, "session %d is listed twice", k);
    }
    kr_model *m = sessions[0]->model;
    if (m->arch->encoder) return kr_fail(err, KR_ERR_UNSUPPORTED, "kr_test_eval_mixed: an encoder has no logits");
    kr_scratch *scratch = &sessions[0]->scratch;
    if (n > scratch->n_batch)
        return kr_fail(err, KR_ERR_ARGUMENT, "%d tokens do not fit in a step of %d", n, scratch->n_batch);
    int32_t *count = calloc((size_t)n_sessions, sizeof *count), *pos = calloc((size_t)n, sizeof *pos);
    kr_seq **seqs = calloc((size_t)n, sizeof *seqs);
    float **rows = calloc((size_t)n, sizeof *rows);
    int status = count && pos && seqs && rows ? KR_OK : kr_fail(err, KR_ERR_MEMORY, "out of memory");
    for (int32_t i = 0; !status && i < n; i++) {
        int32_t k = which[i];
        if (k < 0 || k >= n_sessions || tokens[i] < 0 || tokens[i] >= m->info.n_vocab)
            status = kr_fail(err, KR_ERR_ARGUMENT, "token %d (id %d) names session %d", i, tokens[i], k);
        else if ((pos[i] = sessions[k]->n_tokens + count[k]++) >= sessions[k]->seq.kv.n_ctx)
            status = kr_fail(err, KR_ERR_CONTEXT, "session %d's context of %d is full", k, sessions[k]->seq.kv.n_ctx);
        else {
            seqs[i] = &sessions[k]->seq;
            rows[i] = logits ? logits + (size_t)i * (size_t)m->info.n_vocab : NULL;
        }
    }
    int expected = 0;
    if (!status && !atomic_compare_exchange_strong(&m->busy, &expected, 1))
        status = kr_fail(err, KR_ERR_STATE, "the model is busy: another session is evaluating");
    if (!status) {
        kr_batch batch = {.n = n, .tokens = tokens, .pos = pos, .seq = seqs, .logits = logits ? rows : NULL};
        m->arch->step(m, scratch, &batch);
        for (int32_t k = 0; k < n_sessions; k++) sessions[k]->n_tokens += count[k];
        atomic_store(&m->busy, 0);
        kr_ok(err);
    }
    free(count), free(pos), free(seqs), free(rows);
    return status;
}

// --- Embeddings: an encoder's or a decoder's pooled hidden states (krafla.h, kr_session_embed)

int32_t kr_model_pooled_size(const kr_model *m, int32_t pooling) {
    if (!m) return 0;
    if (pooling == KR_POOLING_RANK) return m->arch->encoder ? m->n_labels : 0;
    return pooling >= KR_POOLING_NONE && pooling <= KR_POOLING_LAST ? m->info.dim : 0;
}

static int check_sequences(kr_session *s, const int32_t *tokens, const int32_t *types, const int32_t *lengths,
                           int32_t n_sequences, int32_t pooling, const float *out, kr_error *err) {
    kr_model *m = s->model;
    if (pooling < KR_POOLING_NONE || pooling > KR_POOLING_RANK)
        return kr_fail(err, KR_ERR_ARGUMENT, "pooling %d is not one of none (0), mean (1), cls (2), last (3), rank (4)",
                       pooling);
    if (pooling == KR_POOLING_RANK && !kr_model_pooled_size(m, pooling))
        return kr_fail(err, KR_ERR_UNSUPPORTED, "rank pooling needs a classifier head; this model has none");
    if (!m->arch->encoder && types)
        return kr_fail(err, KR_ERR_ARGUMENT, "a %s model has no token types", m->arch->name);
    if (!tokens || !lengths || !out || n_sequences < 1)
        return kr_fail(err, KR_ERR_ARGUMENT, "kr_session_embed: no sequences, or tokens, lengths or out is NULL");
    int32_t longest = m->arch->encoder ? s->scratch.n_batch : s->seq.kv.n_ctx;  // a decoder takes several steps
    if (s->seq.kv.n_ctx < longest) longest = s->seq.kv.n_ctx;
    if (m->info.max_seq < longest) longest = m->info.max_seq;
    for (int64_t k = 0, at = 0; k < n_sequences; at += lengths[k], k++) {
        if (lengths[k] < 1) return kr_fail(err, KR_ERR_ARGUMENT, "sequence %lld has %d tokens", (long long)k, lengths[k]);
        if (lengths[k] > longest)
            return kr_fail(err, KR_ERR_CONTEXT, "sequence %lld has %d tokens; at most %d fit (the model's %d positions, "
                           "the session's context %d and batch %d)", (long long)k, lengths[k], longest,
                           m->info.max_seq, s->seq.kv.n_ctx, s->scratch.n_batch);
        for (int64_t i = at; i < at + lengths[k]; i++) {
            if (tokens[i] < 0 || tokens[i] >= m->info.n_vocab)
                return kr_fail(err, KR_ERR_ARGUMENT, "sequence %lld: token id %d at index %lld is outside [0, %d)",
                               (long long)k, tokens[i], (long long)(i - at), m->info.n_vocab);
            if (types && (types[i] < 0 || types[i] >= m->n_token_types))
                return kr_fail(err, KR_ERR_ARGUMENT, "sequence %lld: token type %d at index %lld is outside [0, %d)",
                               (long long)k, types[i], (long long)(i - at), m->n_token_types);
        }
    }
    return KR_OK;
}

// Sequence k's rows [first, first + n) of the step's s->x into out, pooled.
static float *pool_rows(kr_session *s, int32_t first, int32_t n, int32_t pooling, float *out) {
    kr_model *m = s->model;
    int64_t dim = m->info.dim;
    const float *x = s->scratch.x + (int64_t)first * dim;
    switch (pooling) {
    case KR_POOLING_NONE:
        memcpy(out, x, (size_t)n * (size_t)dim * sizeof(float));
        return out + (int64_t)n * dim;
    case KR_POOLING_MEAN:
        for (int64_t i = 0; i < dim; i++) {
            float sum = 0;
            for (int32_t t = 0; t < n; t++) sum += x[t * dim + i];
            out[i] = sum / (float)n;
        }
        return out + dim;
    case KR_POOLING_CLS:
    case KR_POOLING_LAST:
        memcpy(out, x + (pooling == KR_POOLING_LAST ? (int64_t)(n - 1) * dim : 0), (size_t)dim * sizeof(float));
        return out + dim;
    default:  // KR_POOLING_RANK; the step's xb is free scratch now
        m->arch->classify(m, x, s->scratch.xb, out);
        return out + m->n_labels;
    }
}

// A decoder's sequences one after the other, each from position 0 of the session's own cache in
// steps of n_batch tokens: the tokens the pooling reads get their final hidden state written in
// place of their residual row (kr_batch.hidden), pooled into out after each step (a mean sums
// the rows in order across steps, then divides: the encoder's arithmetic). The session holds no
// tokens afterwards.
static void embed_causal(kr_session *s, const int32_t *tokens, const int32_t *lengths, int32_t n_sequences,
                         int32_t pooling, float *out) {
    kr_model *m = s->model;
    int64_t dim = m->info.dim;
    int32_t n_batch = s->scratch.n_batch;
    for (int32_t k = 0, at = 0; k < n_sequences; at += lengths[k], k++) {
        int32_t n = lengths[k];
        if (pooling == KR_POOLING_MEAN) memset(out, 0, (size_t)dim * sizeof(float));
        for (int32_t first = 0; first < n; first += n_batch) {
            int32_t count = n - first < n_batch ? n - first : n_batch;
            for (int32_t j = 0; j < count; j++) {
                int32_t i = first + j;
                bool wanted = pooling == KR_POOLING_NONE || pooling == KR_POOLING_MEAN ||
                              (pooling == KR_POOLING_CLS && i == 0) || (pooling == KR_POOLING_LAST && i == n - 1);
                s->tokens[j] = tokens[at + i];
                s->pos[j] = i;
                s->seqs[j] = &s->seq;
                s->logits[j] = wanted ? s->scratch.x + (int64_t)j * dim : NULL;
            }
            kr_batch batch = {.n = count, .tokens = s->tokens, .pos = s->pos, .seq = s->seqs, .hidden = s->logits};
            m->arch->step(m, &s->scratch, &batch);
            for (int32_t j = 0; j < count; j++) {
                if (!s->logits[j]) continue;
                const float *row = s->logits[j];
                if (pooling == KR_POOLING_MEAN)
                    for (int64_t d = 0; d < dim; d++) out[d] += row[d];
                else if (pooling == KR_POOLING_NONE)
                    memcpy(out + (int64_t)(first + j) * dim, row, (size_t)dim * sizeof(float));
                else
                    memcpy(out, row, (size_t)dim * sizeof(float));
            }
        }
        if (pooling == KR_POOLING_MEAN)
            for (int64_t d = 0; d < dim; d++) out[d] /= (float)n;
        out += pooling == KR_POOLING_NONE ? (int64_t)n * dim : dim;
    }
    s->n_tokens = 0;
}

int kr_session_embed(kr_session *s, const int32_t *tokens, const int32_t *token_types, const int32_t *lengths,
                     int32_t n_sequences, int32_t pooling, float *out, kr_error *err) {
    if (!s) return kr_fail(err, KR_ERR_ARGUMENT, "kr_session_embed: session is NULL");
    int status = check_sequences(s, tokens, token_types, lengths, n_sequences, pooling, out, err);
    if (status) return status;
    kr_model *m = s->model;
    if (!m->arch->encoder && m->arch->truncate && (status = m->arch->truncate(m, 0, s->n_tokens, err))) return status;
    int expected = 0;
    if (!atomic_compare_exchange_strong(&m->busy, &expected, 1))
        return kr_fail(err, KR_ERR_STATE, "the model is busy: another session is evaluating");
    if (!m->arch->encoder) {
        embed_causal(s, tokens, lengths, n_sequences, pooling, out);
        atomic_store(&m->busy, 0);
        kr_ok(err);
        return KR_OK;
    }
    // Whole sequences into steps of at most n_batch tokens, in order.
    for (int32_t k = 0, at = 0; k < n_sequences;) {
        int32_t n = 0, first = k;
        for (; k < n_sequences && n + lengths[k] <= s->scratch.n_batch; at += lengths[k], k++)
            for (int32_t i = 0; i < lengths[k]; i++, n++) {
                s->tokens[n] = tokens[at + i];
                s->types[n] = token_types ? token_types[at + i] : 0;
                s->pos[n] = i;
                s->seqs[n] = &s->seq;
            }
        kr_batch batch = {.n = n, .tokens = s->tokens, .pos = s->pos, .seq = s->seqs, .token_types = s->types};
        m->arch->step(m, &s->scratch, &batch);
        for (int32_t q = first, row = 0; q < k; row += lengths[q], q++) out = pool_rows(s, row, lengths[q], pooling, out);
    }
    atomic_store(&m->busy, 0);
    kr_ok(err);
    return KR_OK;
}
