// arch_llama.c: the llama family (owner: engine): llama, qwen2 (q/k/v biases) and gemma3 (q/k head
// norms, post-norms, sliding-window layers, scaled embedding, soft-caps); issue 17's qwen3 (q/k head
// norms), mistral, phi3 and smollm3 (layer_rope: layers without RoPE). Every layer is
//   x += [post_norm](attention(norm(x)));  x += [post_norm](mlp(norm(x)))
// with layers.c's attention and MLP; the differences are which tensors are bound (each name's
// llama_variant, at the end) and metadata every architecture reads (sliding windows, scales,
// soft-caps, layer_rope).
#include "model/model.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// The optional tensors of one architecture name's layers.
typedef struct {
    bool biases;                      // attn_q/k/v.bias (qwen2)
    bool qk_norms;                    // attn_q_norm/attn_k_norm.weight per head (gemma3, qwen3)
    bool post_norms;                  // post_attention_norm, post_ffw_norm (gemma3)
} llama_variant;

typedef struct {
    const float *attn_norm;           // (dim,)
    kr_attention attn;
    const float *post_attn_norm;      // (dim,) gemma3 or NULL
    const float *ffn_norm;            // (dim,)
    kr_mlp mlp;
    const float *post_ffw_norm;       // (dim,) gemma3 or NULL
} llama_layer;

// layer_rope: absent means every layer rotates q and k; 0 marks a layer without RoPE.
static int layer_rope(kr_model *m, const char *path, llama_layer *layers, kr_error *err) {
    int32_t index;
    int status = kr_find_layer_list(m, path, "layer_rope", &index, err);
    if (status || index < 0) return status;
    for (int32_t i = 0; i < m->info.n_layers; i++) {
        int64_t flag = kr_file_meta_int_at(m->file, index, (uint32_t)i);
        if (flag != 0 && flag != 1)
            return kr_fail(err, KR_ERR_FORMAT, "%s: layer_rope[%d] = %lld, expected 0 or 1", path, i, (long long)flag);
        layers[i].attn.no_rope = flag == 0;
    }
    return KR_OK;
}

static int llama_open(kr_model *m, const char *path, kr_error *err) {
    kr_model_info *h = &m->info;
    const llama_variant *v = m->arch->variant;
    int status;
    llama_layer *layers = calloc((size_t)h->n_layers, sizeof *layers);
    int32_t *types = calloc((size_t)h->n_layers, sizeof *types);
    m->layers = layers;
    if (!layers || !types) {
        free(types);
        return kr_fail(err, KR_ERR_MEMORY, "out of memory opening %s", path);
    }
    status = kr_load_sliding_layers(m, path, types, err);
    for (int32_t i = 0; !status && i < h->n_layers; i++) layers[i].attn.sliding = types[i];
    free(types);
    if (status) return status;
    char name[96];
    for (int32_t i = 0; i < h->n_layers; i++) {
        llama_layer *l = &layers[i];
#define NAME(suffix) (snprintf(name, sizeof name, "blk.%d.%s", i, suffix), name)
        if ((status = kr_bind_f32(m, path, NAME("attn_norm.weight"), h->dim, 0, &l->attn_norm, err)) ||
            (status = kr_bind_attention(m, path, i, m->q_dim, v->biases, v->qk_norms, &l->attn, err)) ||
            (status = kr_bind_f32(m, path, NAME("ffn_norm.weight"), h->dim, 0, &l->ffn_norm, err)) ||
            (status = kr_bind_mlp(m, path, i, &l->mlp, err)))
            return status;
        if (v->post_norms &&
            ((status = kr_bind_f32(m, path, NAME("post_attention_norm.weight"), h->dim, 0, &l->post_attn_norm, err)) ||
             (status = kr_bind_f32(m, path, NAME("post_ffw_norm.weight"), h->dim, 0, &l->post_ffw_norm, err))))
            return status;
#undef NAME
    }
    return layer_rope(m, path, layers, err);
}

static void llama_close(kr_model *m) { free(m->layers); }

static int llama_matrices(kr_model *m, kr_matrix **out) {
    llama_layer *layers = m->layers;
    int n = 0;
    for (int32_t i = 0; i < m->info.n_layers; i++) {
        llama_layer *l = &layers[i];
        kr_matrix *all[] = {&l->attn.wq, &l->attn.wk, &l->attn.wv, &l->attn.wo, &l->mlp.gate, &l->mlp.up, &l->mlp.down};
        for (size_t k = 0; k < sizeof all / sizeof all[0]; k++, n++)
            if (out) out[n] = all[k];
    }
    return n;
}

static void llama_step(kr_model *m, kr_scratch *s, const kr_batch *b) {
    const llama_layer *layers = m->layers;
    kr_rope_tables(m, s, b);
    float *pending = NULL;  // the previous MLP's output, not yet added
    const float *pending_norm = NULL;
    for (int32_t layer = 0; layer < m->info.n_layers; layer++) {
        const llama_layer *l = &layers[layer];
        const kr_matrix *qkv[] = {&l->attn.wq, &l->attn.wk, &l->attn.wv}, *gate_up[] = {&l->mlp.gate, &l->mlp.up};
        kr_residual(m, s, b, layer == 0 ? b->tokens : NULL, pending, pending_norm, l->attn_norm, qkv, 3);
        kr_attention_block(m, s, b, &l->attn);
        kr_residual(m, s, b, NULL, s->proj, l->post_attn_norm, l->ffn_norm, gate_up, 2);
        kr_mlp_block(m, s, b, &l->mlp);
        pending = s->proj, pending_norm = l->post_ffw_norm;
    }
    kr_output(m, s, b, pending, pending_norm);
}

#define LLAMA_FAMILY(arch_name, ...)                                                                \
    {.name = arch_name, .variant = &(const llama_variant){__VA_ARGS__}, .open = llama_open,         \
     .close = llama_close, .matrices = llama_matrices, .step = llama_step}

const kr_arch kr_arch_llama = LLAMA_FAMILY("llama", 0);
const kr_arch kr_arch_qwen2 = LLAMA_FAMILY("qwen2", .biases = true);
const kr_arch kr_arch_gemma3 = LLAMA_FAMILY("gemma3", .qk_norms = true, .post_norms = true);
const kr_arch kr_arch_qwen3 = LLAMA_FAMILY("qwen3", .qk_norms = true);
const kr_arch kr_arch_mistral = LLAMA_FAMILY("mistral", 0);
const kr_arch kr_arch_phi3 = LLAMA_FAMILY("phi3", 0);
const kr_arch kr_arch_smollm3 = LLAMA_FAMILY("smollm3", 0);
