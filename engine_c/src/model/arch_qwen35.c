// arch_qwen35.c: Qwen3.5's hybrid text model (owner: qwen35).
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
// The loops are kernels/deltanet.h's. Full-attention layer: layers.c's attention with wq's rows per
// head [q | gate], q/k RMSNorm per head (1+w stored), RoPE (neox) on the first rope_dims, times
// sigmoid(gate), then Wo.
//
// The conv and DeltaNet states belong to each sequence (kr_seq.recurrent); the recurrence runs
// the batch's tokens in order in one thread per channel or value head, each token on its own
// sequence's state, so logits and states are bitwise identical for any batch, thread count or
// mix of sequences. The state cannot be cut back: a sequence is kept whole or started afresh.
#include "kernels/deltanet.h"
#include "kernels/kernels.h"
#include "model/model.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int32_t linear;
    const float *attn_norm, *ffn_norm;
    kr_attention attn;                   // full attention layers
    kr_matrix qkv, z, beta, alpha, out;  // DeltaNet layers
    const float *conv, *dt_bias, *a, *ssm_norm;
    kr_mlp mlp;
    int32_t slot;                        // index among the DeltaNet layers (its states)
} q35_layer;

typedef struct {
    int32_t kernel, nk, nv, dk, dv, key_dim, value_dim, conv_dim;
    int32_t n_linear;
    q35_layer *layers;
} q35_model;

typedef struct {
    float *conv;   // (n_linear, conv_dim, kernel - 1): the last inputs, oldest first
    float *ssm;    // (n_linear, nv, dv, dk): S^T per value head
} q35_seq;

typedef struct {
    float *mixed, *conv_out, *z, *b, *a, *core;  // (n_batch, conv_dim | conv_dim | value_dim | nv | nv | value_dim)
} q35_scratch;

// --- Loading

static int q35_open(kr_model *m, const char *path, kr_error *err) {
    kr_model_info *h = &m->info;
    int status;
    q35_model *q = calloc(1, sizeof *q);
    if (!q) return kr_fail(err, KR_ERR_MEMORY, "out of memory opening %s", path);
    m->layers = q;
    if ((status = kr_load_int(m, path, "linear_conv_kernel", true, 0, 1, 64, &q->kernel, err)) ||
        (status = kr_load_int(m, path, "linear_k_heads", true, 0, 1, 1024, &q->nk, err)) ||
        (status = kr_load_int(m, path, "linear_v_heads", true, 0, 1, 1024, &q->nv, err)) ||
        (status = kr_load_int(m, path, "linear_k_head_dim", true, 0, 1, 1024, &q->dk, err)) ||
        (status = kr_load_int(m, path, "linear_v_head_dim", true, 0, 1, 1024, &q->dv, err)))
        return status;
    if (q->nv % q->nk)
        return kr_fail(err, KR_ERR_FORMAT, "%s: linear heads (%d v, %d k) do not fit", path, q->nv, q->nk);
    if (h->rope_style != KR_ROPE_NEOX || h->activation != KR_ACT_SILU)
        return kr_fail(err, KR_ERR_UNSUPPORTED, "%s: qwen35 needs rope_style neox and activation silu", path);
    q->key_dim = q->nk * q->dk, q->value_dim = q->nv * q->dv, q->conv_dim = 2 * q->key_dim + q->value_dim;
    q->layers = calloc((size_t)h->n_layers, sizeof *q->layers);
    int32_t *types = calloc((size_t)h->n_layers, sizeof *types);
    if (!q->layers || !types) {
        free(types);
        return kr_fail(err, KR_ERR_MEMORY, "out of memory opening %s", path);
    }
    status = kr_load_layer_types(m, path, "02", -1, types, err);
    for (int32_t i = 0; !status && i < h->n_layers; i++) {
        q->layers[i].linear = types[i] == 2;
        if (q->layers[i].linear) q->layers[i].slot = q->n_linear++;
    }
    free(types);
    if (status) return status;
    char name[96];
    for (int32_t i = 0; i < h->n_layers; i++) {
        q35_layer *l = &q->layers[i];
#define NAME(suffix) (snprintf(name, sizeof name, "blk.%d.%s", i, suffix), name)
        if ((status = kr_bind_f32(m, path, NAME("attn_norm.weight"), h->dim, 0, &l->attn_norm, err)) ||
            (status = kr_bind_f32(m, path, NAME("ffn_norm.weight"), h->dim, 0, &l->ffn_norm, err)) ||
            (status = kr_bind_mlp(m, path, i, &l->mlp, err)))
            return status;
        if (!l->linear) {
            if ((status = kr_bind_attention(m, path, i, 2 * (int64_t)m->q_dim, false, true, &l->attn, err)))
                return status;
            continue;
        }
        if ((status = kr_bind_matrix(m, path, NAME("attn_qkv.weight"), q->conv_dim, h->dim, &l->qkv, err)) ||
            (status = kr_bind_matrix(m, path, NAME("attn_gate.weight"), q->value_dim, h->dim, &l->z, err)) ||
            (status = kr_bind_matrix(m, path, NAME("ssm_beta.weight"), q->nv, h->dim, &l->beta, err)) ||
            (status = kr_bind_matrix(m, path, NAME("ssm_alpha.weight"), q->nv, h->dim, &l->alpha, err)) ||
            (status = kr_bind_matrix(m, path, NAME("ssm_out.weight"), h->dim, q->value_dim, &l->out, err)) ||
            (status = kr_bind_f32(m, path, NAME("ssm_conv1d.weight"), q->conv_dim, q->kernel, &l->conv, err)) ||
            (status = kr_bind_f32(m, path, NAME("ssm_dt.bias"), q->nv, 0, &l->dt_bias, err)) ||
            (status = kr_bind_f32(m, path, NAME("ssm_a"), q->nv, 0, &l->a, err)) ||
            (status = kr_bind_f32(m, path, NAME("ssm_norm.weight"), q->dv, 0, &l->ssm_norm, err)))
            return status;
#undef NAME
    }
    return KR_OK;
}

static void q35_close(kr_model *m) {
    q35_model *q = m->layers;
    if (!q) return;
    free(q->layers);
    free(q);
}

// Layer by layer: a full-attention layer's q, k, v, o or a DeltaNet layer's qkv, z, beta, alpha,
// out; then gate, up, down (the pack cache's order).
static int q35_matrices(kr_model *m, kr_matrix **out) {
    q35_model *q = m->layers;
    int n = 0;
    for (int32_t i = 0; i < m->info.n_layers; i++) {
        q35_layer *l = &q->layers[i];
        kr_matrix *full[] = {&l->attn.wq, &l->attn.wk, &l->attn.wv, &l->attn.wo, &l->mlp.gate, &l->mlp.up,
                             &l->mlp.down};
        kr_matrix *linear[] = {&l->qkv, &l->z, &l->beta, &l->alpha, &l->out, &l->mlp.gate, &l->mlp.up, &l->mlp.down};
        kr_matrix **all = l->linear ? linear : full;
        size_t count = l->linear ? sizeof linear / sizeof linear[0] : sizeof full / sizeof full[0];
        for (size_t k = 0; k < count; k++, n++)
            if (out) out[n] = all[k];
    }
    return n;
}

// --- Sequence state and scratch

static int q35_seq_new(kr_model *m, kr_seq *seq, kr_error *err) {
    const q35_model *q = m->layers;
    q35_seq *r = calloc(1, sizeof *r);
    if (!r) return kr_fail(err, KR_ERR_MEMORY, "out of memory for a qwen35 sequence");
    seq->recurrent = r;
    bool failed = false;
    if (q->n_linear) {
        if (q->kernel > 1)
            r->conv = kr_zalloc((size_t)q->n_linear * (size_t)q->conv_dim, (size_t)(q->kernel - 1) * sizeof(float), &failed);
        r->ssm = kr_zalloc((size_t)q->n_linear * (size_t)q->nv, (size_t)q->dv * (size_t)q->dk * sizeof(float), &failed);
    }
    if (failed) return kr_fail(err, KR_ERR_MEMORY, "out of memory for the recurrent states of a qwen35 sequence");
    return KR_OK;
}

static void q35_seq_free(kr_seq *seq) {
    q35_seq *r = seq->recurrent;
    if (!r) return;
    free(r->conv), free(r->ssm), free(r);
    seq->recurrent = NULL;
}

static int q35_scratch_new(kr_model *m, kr_scratch *s, kr_error *err) {
    const q35_model *q = m->layers;
    q35_scratch *own = calloc(1, sizeof *own);
    if (!own) return kr_fail(err, KR_ERR_MEMORY, "out of memory");
    s->own = own;
    float **buffers[] = {&own->mixed, &own->conv_out, &own->z, &own->b, &own->a, &own->core};
    const int32_t widths[] = {q->conv_dim, q->conv_dim, q->value_dim, q->nv, q->nv, q->value_dim};
    bool failed = false;
    for (size_t i = 0; i < sizeof widths / sizeof widths[0]; i++)
        *buffers[i] = kr_zalloc((size_t)s->n_batch * (size_t)widths[i], sizeof(float), &failed);
    return failed ? kr_fail(err, KR_ERR_MEMORY, "out of memory") : KR_OK;
}

static void q35_scratch_free(kr_scratch *s) {
    q35_scratch *own = s->own;
    if (!own) return;
    free(own->mixed), free(own->conv_out), free(own->z), free(own->b), free(own->a), free(own->core), free(own);
    s->own = NULL;
}

static int q35_truncate(const kr_model *m, int32_t keep, int32_t held, kr_error *err) {
    if (keep != 0 && keep != held)
        return kr_fail(err, KR_ERR_STATE, "cannot truncate a qwen35 session to %d tokens: its recurrent state "
                       "can only be kept (%d) or dropped (0)", keep, held);
    return KR_OK;
}

// --- DeltaNet jobs

typedef struct {
    kr_model *m;
    kr_scratch *s;
    const kr_batch *b;
    const q35_layer *l;
} job;

// Causal depthwise conv1d + silu, token after token on each token's sequence state. Split by channels.
static void conv_job(void *arg, int chunk, int n_chunks, int thread) {
    job *j = arg;
    const q35_model *q = j->m->layers;
    const q35_scratch *own = j->s->own;
    int32_t K = q->kernel, C = q->conv_dim;
    int64_t begin, end;
    kr_split(C, 1, chunk, n_chunks, &begin, &end);
    if (begin >= end) return;
    for (int32_t t = 0; t < j->b->n; t++) {
        q35_seq *r = j->b->seq[t]->recurrent;
        float *state = r->conv + ((size_t)j->l->slot * (size_t)C + (size_t)begin) * (size_t)(K - 1);
        kr_conv_silu_f32(j->l->conv + begin * K, K, state, own->mixed + (size_t)t * C + begin,
                         own->conv_out + (size_t)t * C + begin, end - begin);
    }
}

// l2-normalise q and k of every key head (q also / sqrt(dk)); in place in conv_out. Split by tokens.
static void qk_norm_job(void *arg, int chunk, int n_chunks, int thread) {
    job *j = arg;
    const q35_model *q = j->m->layers;
    const q35_scratch *own = j->s->own;
    int64_t begin, end;
    kr_split(j->b->n, 1, chunk, n_chunks, &begin, &end);
    float q_scale = 1.0f / sqrtf((float)q->dk);
    for (int64_t t = begin; t < end; t++)
        for (int32_t part = 0; part < 2; part++)
            for (int32_t head = 0; head < q->nk; head++)
                kr_l2_normalize_f32(own->conv_out + t * q->conv_dim + (size_t)part * q->key_dim + (size_t)head * q->dk,
                                    q->dk, 1e-6f, part == 0 ? q_scale : 1.0f);
}

static float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
static float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }  // torch's threshold 20

// The delta rule, token after token on each token's sequence state, for the value heads of this
// chunk; then the gated norm.
static void delta_job(void *arg, int chunk, int n_chunks, int thread) {
    job *j = arg;
    const q35_model *q = j->m->layers;
    const q35_scratch *own = j->s->own;
    const q35_layer *l = j->l;
    int64_t begin, end;
    kr_split(q->nv, 1, chunk, n_chunks, &begin, &end);
    int32_t ratio = q->nv / q->nk, dk = q->dk, dv = q->dv;
    float eps = j->m->info.norm_eps;
    for (int32_t t = 0; t < j->b->n; t++) {
        q35_seq *r = j->b->seq[t]->recurrent;
        const float *row = own->conv_out + (size_t)t * q->conv_dim;
        for (int64_t h = begin; h < end; h++) {
            float *S = r->ssm + ((size_t)l->slot * (size_t)q->nv + (size_t)h) * (size_t)dv * (size_t)dk;
            int32_t kh = (int32_t)h / ratio;
            const float *qv = row + (size_t)kh * dk, *kv = row + q->key_dim + (size_t)kh * dk;
            const float *vv = row + 2 * (size_t)q->key_dim + (size_t)h * dv;
            float beta = sigmoid(own->b[(size_t)t * q->nv + h]);
            float decay = expf(l->a[h] * softplus(own->a[(size_t)t * q->nv + h] + l->dt_bias[h]));
            float *o = own->core + (size_t)t * q->value_dim + (size_t)h * dv;
            kr_delta_rule_f32(S, dk, dv, qv, kv, vv, beta, decay, o);
            kr_gated_rms_norm_f32(o, own->z + (size_t)t * q->value_dim + (size_t)h * dv, l->ssm_norm, dv, eps);
        }
    }
}

static void deltanet_block(kr_model *m, kr_scratch *s, const kr_batch *b, const q35_layer *l) {
    const q35_model *q = m->layers;
    q35_scratch *own = s->own;
    const kr_matrix *in[] = {&l->qkv, &l->z, &l->beta, &l->alpha}, *out[] = {&l->out};
    float *in_out[] = {own->mixed, own->z, own->b, own->a}, *out_out[] = {s->proj};
    kr_matmuls(m, s, b->n, NULL, m->info.dim, 4, in, in_out, NULL);
    job j = {m, s, b, l};
    int chunks = kr_pool_size(m->pool);
    kr_pool_run(m->pool, conv_job, &j, chunks);
    kr_pool_run(m->pool, qk_norm_job, &j, chunks);
    kr_pool_run(m->pool, delta_job, &j, chunks);
    kr_matmuls(m, s, b->n, own->core, q->value_dim, 1, out, out_out, NULL);
}

static void q35_step(kr_model *m, kr_scratch *s, const kr_batch *b) {
    const q35_model *q = m->layers;
    for (int32_t t = 0; t < b->n; t++) {  // a sequence starting afresh: empty recurrent states
        q35_seq *r = b->seq[t]->recurrent;
        if (b->pos[t] || !q->n_linear) continue;
        if (r->conv) memset(r->conv, 0, (size_t)q->n_linear * q->conv_dim * (size_t)(q->kernel - 1) * sizeof(float));
        memset(r->ssm, 0, (size_t)q->n_linear * q->nv * (size_t)q->dv * (size_t)q->dk * sizeof(float));
    }
    kr_rope_tables(m, s, b);
    float *pending = NULL;
    for (int32_t layer = 0; layer < m->info.n_layers; layer++) {
        const q35_layer *l = &q->layers[layer];
        const kr_matrix *qkv[] = {&l->attn.wq, &l->attn.wk, &l->attn.wv};
        const kr_matrix *linear[] = {&l->qkv, &l->z, &l->beta, &l->alpha}, *gate_up[] = {&l->mlp.gate, &l->mlp.up};
        kr_residual(m, s, b, layer == 0 ? b->tokens : NULL, pending, NULL, l->attn_norm, l->linear ? linear : qkv,
                    l->linear ? 4 : 3);
        if (l->linear) deltanet_block(m, s, b, l);
        else kr_attention_block(m, s, b, &l->attn);
        kr_residual(m, s, b, NULL, s->proj, NULL, l->ffn_norm, gate_up, 2);
        kr_mlp_block(m, s, b, &l->mlp);
        pending = s->proj;
    }
    kr_output(m, s, b, pending, NULL);
}

const kr_arch kr_arch_qwen35 = {
    .name = "qwen35", .open = q35_open, .close = q35_close, .matrices = q35_matrices,
    .seq_new = q35_seq_new, .seq_free = q35_seq_free, .scratch_new = q35_scratch_new,
    .scratch_free = q35_scratch_free, .truncate = q35_truncate, .step = q35_step,
};
