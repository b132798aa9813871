// arch_moe.c: the mixture-of-experts transformers (owner: moe): qwen3moe (Qwen3-30B-A3B: q/k head
// norms, renormalised top-k weights), mixtral (llama's attention, renormalised top-k weights), olmoe
// (q/k norms over the whole projection, top-k weights as the softmax gave them) and gpt-oss
// (biases on q/k/v/o, the router and the experts; a learned sink logit per head; sliding-window
// layers by layer_types; the clamped SwiGLU; the top-k's softmax). Every layer is
//   x += attention(norm(x));  x += experts(norm(x))
// with layers.c's attention and experts.c's expert layer in place of the MLP. Extra metadata:
// n_experts, n_experts_used, expert_weights_norm, and gpt-oss's swiglu_alpha, swiglu_limit
// (docs/formats.md). gpt-oss's YaRN RoPE needs nothing here: the converter writes its frequencies
// as rope_freqs.weight and folds its attention factor into attn_scale.
#include "model/experts.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    bool qk_norms;                    // attn_q_norm/attn_k_norm.weight, (head_dim,) per head (qwen3moe)
    bool qk_norms_whole;              // the same over the whole q and k projections (olmoe)
    bool gpt_oss;                     // biases everywhere, attn_sinks.weight, the clamped SwiGLU
} moe_variant;

typedef struct {
    const float *attn_norm;           // (dim,)
    kr_attention attn;
    const float *ffn_norm;            // (dim,)
    kr_experts experts;
} moe_layer;

typedef struct {
    moe_layer *layers;                // (n_layers,)
} moe_model;

// layer_types: 1 marks a sliding-window layer (gpt-oss's every other one); absent: none.
static int sliding_layers(kr_model *m, const char *path, moe_layer *layers, kr_error *err) {
    int32_t *types = calloc((size_t)m->info.n_layers, sizeof *types);
    if (!types) return kr_fail(err, KR_ERR_MEMORY, "out of memory opening %s", path);
    int status = kr_load_sliding_layers(m, path, types, err);
    for (int32_t i = 0; !status && i < m->info.n_layers; i++) layers[i].attn.sliding = types[i];
    free(types);
    return status;
}

static int moe_open(kr_model *m, const char *path, kr_error *err) {
    kr_model_info *h = &m->info;
    const moe_variant *v = m->arch->variant;
    moe_model *model = calloc(1, sizeof *model);
    if (!model) return kr_fail(err, KR_ERR_MEMORY, "out of memory opening %s", path);
    m->layers = model;
    model->layers = calloc((size_t)h->n_layers, sizeof *model->layers);
    if (!model->layers) return kr_fail(err, KR_ERR_MEMORY, "out of memory opening %s", path);
    int32_t n_experts, n_used, normalize;
    int status;
    float swiglu_alpha = 0, swiglu_limit = 0;
    if ((status = kr_load_int(m, path, "n_experts", true, 0, 1, KR_MAX_EXPERTS, &n_experts, err)) ||
        (status = kr_load_int(m, path, "n_experts_used", true, 0, 1, n_experts, &n_used, err)) ||
        (status = kr_load_int(m, path, "expert_weights_norm", true, 0, 0, 1, &normalize, err)))
        return status;
    if (v->gpt_oss &&
        ((status = kr_load_float(m, path, "swiglu_alpha", true, 0, 0, true, 1e6, &swiglu_alpha, err)) ||
         (status = kr_load_float(m, path, "swiglu_limit", true, 0, 0, true, 1e6, &swiglu_limit, err))))
        return status;
    if ((status = sliding_layers(m, path, model->layers, err))) return status;
    char name[96];
    for (int32_t i = 0; i < h->n_layers; i++) {
        moe_layer *l = &model->layers[i];
#define NAME(suffix) (snprintf(name, sizeof name, "blk.%d.%s", i, suffix), name)
        if ((status = kr_bind_f32(m, path, NAME("attn_norm.weight"), h->dim, 0, &l->attn_norm, err)) ||
            (status = kr_bind_attention(m, path, i, m->q_dim, v->gpt_oss, v->qk_norms, &l->attn, err)) ||
            (status = kr_bind_f32(m, path, NAME("ffn_norm.weight"), h->dim, 0, &l->ffn_norm, err)) ||
            (status = kr_bind_experts(m, path, i, n_experts, n_used, normalize, &l->experts, err)))
            return status;
        if (v->gpt_oss) {
            l->experts.swiglu_alpha = swiglu_alpha, l->experts.swiglu_limit = swiglu_limit;
            if ((status = kr_bind_f32(m, path, NAME("attn_output.bias"), h->dim, 0, &l->attn.bo, err)) ||
                (status = kr_bind_f32(m, path, NAME("attn_sinks.weight"), h->n_heads, 0, &l->attn.sinks, err)) ||
                (status = kr_bind_expert_biases(m, path, i, &l->experts, err)))
                return status;
            for (int32_t head = 0; head < h->n_heads; head++)
                if (!isfinite(l->attn.sinks[head]))
                    return kr_fail(err, KR_ERR_FORMAT, "%s: %s[%d] = %g, expected a finite logit", path, name, head,
                                   (double)l->attn.sinks[head]);
        }
        if (v->qk_norms_whole) {
            l->attn.qk_norm_whole = 1;
            if ((status = kr_bind_f32(m, path, NAME("attn_q_norm.weight"), m->q_dim, 0, &l->attn.q_norm, err)) ||
                (status = kr_bind_f32(m, path, NAME("attn_k_norm.weight"), m->kv_dim, 0, &l->attn.k_norm, err)))
                return status;
        }
#undef NAME
    }
    return KR_OK;
}

static void moe_close(kr_model *m) {
    moe_model *model = m->layers;
    if (!model) return;
    if (model->layers)
        for (int32_t i = 0; i < m->info.n_layers; i++) kr_experts_free(&model->layers[i].experts);
    free(model->layers);
    free(model);
}

static int moe_matrices(kr_model *m, kr_matrix **out) {
    moe_model *model = m->layers;
    int n = 0;
    for (int32_t i = 0; i < m->info.n_layers; i++) {
        moe_layer *l = &model->layers[i];
        kr_matrix *attention[] = {&l->attn.wq, &l->attn.wk, &l->attn.wv, &l->attn.wo};
        for (size_t k = 0; k < sizeof attention / sizeof attention[0]; k++, n++)
            if (out) out[n] = attention[k];
        n += kr_experts_matrices(&l->experts, out ? out + n : NULL);
    }
    return n;
}

static int moe_scratch_new(kr_model *m, kr_scratch *s, kr_error *err) {
    moe_model *model = m->layers;
    kr_experts_scratch *x = calloc(1, sizeof *x);
    const kr_experts **layers = calloc((size_t)m->info.n_layers, sizeof *layers);
    if (!x || !layers) {
        free(x), free(layers);
        return kr_fail(err, KR_ERR_MEMORY, "out of memory");
    }
    for (int32_t i = 0; i < m->info.n_layers; i++) layers[i] = &model->layers[i].experts;
    int status = kr_experts_scratch_new(m, layers, m->info.n_layers, s->n_batch, x, err);
    free(layers);
    if (status) {
        free(x);
        return status;
    }
    s->own = x;
    return KR_OK;
}

static void moe_scratch_free(kr_scratch *s) {
    if (!s->own) return;
    kr_experts_scratch_free(s->own);
    free(s->own);
    s->own = NULL;
}

static void moe_step(kr_model *m, kr_scratch *s, const kr_batch *b) {
    const moe_model *model = m->layers;
    kr_rope_tables(m, s, b);
    float *pending = NULL;  // the previous expert layer's output, not yet added
    for (int32_t layer = 0; layer < m->info.n_layers; layer++) {
        const moe_layer *l = &model->layers[layer];
        const kr_experts *e = &l->experts;
        const kr_matrix *qkv[] = {&l->attn.wq, &l->attn.wk, &l->attn.wv}, *ffn[] = {&e->router, &e->gate[0], &e->up[0]};
        kr_residual(m, s, b, layer == 0 ? b->tokens : NULL, pending, NULL, l->attn_norm, qkv, 3);
        kr_attention_block(m, s, b, &l->attn);
        kr_residual(m, s, b, NULL, s->proj, NULL, l->ffn_norm, ffn, 3);
        kr_experts_block(m, s, s->own, b, e);
        pending = s->proj;
    }
    kr_output(m, s, b, pending, NULL);
}

#define MOE_FAMILY(arch_name, ...)                                                                      \
    {.name = arch_name, .variant = &(const moe_variant){__VA_ARGS__}, .open = moe_open, .close = moe_close, \
     .matrices = moe_matrices, .scratch_new = moe_scratch_new, .scratch_free = moe_scratch_free,        \
     .step = moe_step}

const kr_arch kr_arch_qwen3moe = MOE_FAMILY("qwen3moe", .qk_norms = true);
const kr_arch kr_arch_mixtral = MOE_FAMILY("mixtral", 0);
const kr_arch kr_arch_olmoe = MOE_FAMILY("olmoe", .qk_norms_whole = true);
const kr_arch kr_arch_gpt_oss = MOE_FAMILY("gpt-oss", .gpt_oss = true);
