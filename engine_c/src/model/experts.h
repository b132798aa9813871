// experts.h: a mixture-of-experts feed-forward layer for CPUs (experts.c), the MoE architectures'
// (arch_moe.c) replacement for layers.c's MLP. Internal to the library.
//
// A router picks n_used of n_experts SwiGLU experts per token and weighs their outputs:
//   p = softmax(xb Wr^T [+ br]) over all experts; the n_used largest (ties: the lower expert) in rank
//   order; weight_r = p_r, or p_r / (p_0 + ... + p_{n_used-1}) when `normalize` (qwen3moe, mixtral,
//   gpt-oss: the same as a softmax over the chosen experts' logits alone);
//   out = sum over ranks r = 0, 1, ... of weight_r * down_e(act(gate_e xb) * up_e xb), each product
//   with its expert's bias when the layer has them (gpt-oss), act(g) * u gpt-oss's clamped SwiGLU
//   when swiglu_limit > 0 (kernels.h, kr_swiglu_oai_mul_f32).
// A step groups its tokens by expert, so each chosen expert's rows are read once per step and
// multiplied with all its tokens at once (one token: only the chosen experts' rows are read). The
// bits do not depend on the grouping: every (token, expert) product is the kernels' value for that
// token's row alone, and a token's outputs are added up in its own rank order, never in batch order.
#ifndef KRAFLA_EXPERTS_H
#define KRAFLA_EXPERTS_H

#include "model/model.h"

#define KR_MAX_EXPERTS 1024

typedef struct {
    int32_t n_experts, n_used;        // experts of the layer, experts per token
    bool normalize;                   // renormalise the chosen experts' weights to sum 1
    kr_matrix router;                 // (n_experts, dim) ffn_gate_inp
    const float *router_bias;         // (n_experts,) or NULL
    kr_matrix *gate, *up, *down;      // (n_experts,) of (ffn_dim, dim), (ffn_dim, dim), (dim, ffn_dim),
                                      // views into ffn_gate_exps / ffn_up_exps / ffn_down_exps
    const float *gate_bias, *up_bias; // (n_experts, ffn_dim) or NULL
    const float *down_bias;           // (n_experts, dim) or NULL
    float swiglu_alpha, swiglu_limit; // limit > 0: gpt-oss's clamped SwiGLU in place of the model's activation
} kr_experts;

// A step's buffers for the expert layers of a model, n_batch tokens wide.
typedef struct {
    int32_t n_batch, n_used, n_experts;
    float *router_logits;             // (n_batch, n_experts), then the probabilities
    int32_t *choice;                  // (n_batch, n_used) expert of each token's rank
    float *weight;                    // (n_batch, n_used) weight of each token's rank
    int32_t *first;                   // (n_experts + 1) first sorted slot of each expert
    int32_t *slot_of;                 // (n_batch * n_used) sorted position -> token * n_used + rank
    int32_t *position;                // (n_batch * n_used) token * n_used + rank -> sorted position
    int32_t *items;                   // (work items, 2) expert and first row of each matmul item
    int64_t max_items;
    void *inputs[KR_TYPE_COUNT];      // (n_batch * n_used) prepared xb rows in sorted order, per type
    void *hidden_prepared[KR_TYPE_COUNT];  // (n_batch * n_used) prepared act(gate) * up rows, per type
    float *gate, *up;                 // (n_batch * n_used, ffn_dim)
    float *out;                       // (n_batch * n_used, dim) each expert's output for a slot
} kr_experts_scratch;

// Binds blk.<layer>.ffn_gate_inp.weight and the three merged expert tensors
// blk.<layer>.ffn_{gate,up,down}_exps.weight ((n_experts, rows, cols), one type each) into `out`,
// whose per-expert matrices are views into the file's mapping. Allocates out->gate/up/down
// (kr_experts_free).
int kr_bind_experts(kr_model *m, const char *path, int32_t layer, int32_t n_experts, int32_t n_used, bool normalize,
                    kr_experts *out, kr_error *err);
// The biases of the router and of every expert's three matrices (gpt-oss):
// blk.<layer>.ffn_gate_inp.bias (n_experts,) and ffn_{gate,up,down}_exps.bias (n_experts, rows), f32.
int kr_bind_expert_biases(kr_model *m, const char *path, int32_t layer, kr_experts *e, kr_error *err);
void kr_experts_free(kr_experts *e);
// The layer's matrices (router, then each expert's gate, up, down) into out (NULL: count only).
int kr_experts_matrices(kr_experts *e, kr_matrix **out);

// Buffers for the model's expert layers `layers[0..n_layers)`, for a scratch of n_batch tokens.
int kr_experts_scratch_new(kr_model *m, const kr_experts *const *layers, int32_t n_layers, int32_t n_batch,
                           kr_experts_scratch *out, kr_error *err);
void kr_experts_scratch_free(kr_experts_scratch *x);

// The expert layer of prepared xb (kr_residual given e->router, e->gate[0] and e->up[0]) into s->proj.
void kr_experts_block(kr_model *m, kr_scratch *s, kr_experts_scratch *x, const kr_batch *b, const kr_experts *e);

#endif
