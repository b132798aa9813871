// model.h: the loaded model and the thread pool, shared by model.c, forward.c and threads.c.
// Internal to the library (owner: engine).
#ifndef KRAFLA_MODEL_H
#define KRAFLA_MODEL_H

#include "runtime/internal.h"

#include <stdatomic.h>

// --- Thread pool (threads.c)

typedef struct kr_pool kr_pool;
// One chunk of a job: `chunk` of `n_chunks`, run by thread `thread` (0 = the caller), which
// indexes per-thread scratch. A chunk's results must not depend on which thread runs it.
typedef void (*kr_pool_fn)(void *job, int chunk, int n_chunks, int thread);

kr_pool *kr_pool_new(int n_threads, kr_error *err);
// Run fn on every chunk in [0, n_chunks) (at most 65535), on whichever threads claim them first;
// returns when all are finished.
void kr_pool_run(kr_pool *pool, kr_pool_fn fn, void *job, int n_chunks);
int kr_pool_size(const kr_pool *pool);
// How many chunks to cut `items` units of work into: 1 on one thread, else a few per thread.
int kr_pool_chunks(const kr_pool *pool, int64_t items);
void kr_pool_free(kr_pool *pool);

// [begin, end) of `total` items for one part of n_parts; boundaries are multiples of `align`.
void kr_split(int64_t total, int64_t align, int part, int n_parts, int64_t *begin, int64_t *end);

// --- Model (model.c)

typedef struct {
    int32_t type;        // kr_type of the weights
    const void *data;    // (rows, cols) in file layout
    int64_t rows, cols;
    uint64_t row_bytes;
    int32_t packed;      // speed: 1 when data is in the packed layout (pack.c, kernels.h)
} kr_matrix;

// out[t * w->rows + r] = row r of w . prepared row t, for rows [begin, end) and n_tokens prepared rows
// (kr_prepare_activations for w->type): the packed kernels when pack.c repacked w, else the file
// layout's; the same bits either way (pack.c).
void kr_matrix_matmul(const kr_matrix *w, const void *prepared, int64_t n_tokens, float *out, int64_t begin, int64_t end);

typedef struct {
    int32_t sliding;                  // 1: sliding-window attention layer
    const float *attn_norm;           // (dim,)
    kr_matrix wq;                     // (n_heads * head_dim, dim)
    kr_matrix wk, wv;                 // (n_kv_heads * head_dim, dim)
    const float *bq, *bk, *bv;        // biases of q, k, v (qwen2) or NULL
    const float *q_norm, *k_norm;     // (head_dim,) per-head RMSNorm (gemma3) or NULL
    kr_matrix wo;                     // (dim, n_heads * head_dim)
    const float *post_attn_norm;      // (dim,) gemma3 or NULL
    const float *ffn_norm;            // (dim,)
    kr_matrix gate, up;               // (ffn_dim, dim)
    kr_matrix down;                   // (dim, ffn_dim)
    const float *post_ffw_norm;       // (dim,) gemma3 or NULL
} kr_layer;

struct kr_model {
    kr_file *file;
    kr_model_info info;
    int32_t q_dim, kv_dim;            // n_heads * head_dim, n_kv_heads * head_dim
    kr_matrix token_embd;             // (n_vocab, dim)
    kr_matrix output;                 // (n_vocab, dim), token_embd when tied
    const float *output_norm;         // (dim,)
    kr_layer *layers;                 // (n_layers,)
    float *inv_freq_full;             // (rope_dims / 2,) RoPE frequencies / rope_scale
    float *inv_freq_local;            // (rope_dims / 2,) for sliding-window layers
    kr_pool *pool;
    atomic_int busy;                  // 1 while a session of this model is evaluating
    void *ext;                        // qwen35: its own layers (forward_qwen35.c), else NULL
    void *pack;                       // speed: pack.c's state (kr_model_pack), else NULL
};

// --- qwen35 hooks (owner: qwen35; forward_qwen35.c). model.c and forward.c hand a qwen35 model
// and its sessions over to these; nothing else changes for the other architectures.
int kr_qwen35_is(const kr_file *file);                               // 1 when arch is qwen35
int kr_qwen35_open(kr_model *m, const char *path, kr_error *err);    // info, tensors, m->ext
void kr_qwen35_free(void *ext);
// Its q8_0/q4_0 layer matrices for pack.c, layer by layer (out NULL: only count them).
int kr_qwen35_matrices(kr_model *m, kr_matrix **out);
void *kr_qwen35_state_new(kr_model *m, int32_t n_ctx, int32_t kv_type, int32_t n_batch, kr_error *err);
void kr_qwen35_state_free(void *state);
// Run n tokens at positions pos.. (pos 0 starts from empty states); logits of the last unless NULL,
// or with all_logits of every token ((n, n_vocab), each row the bits the one-logit path gives).
void kr_qwen35_step(void *state, const int32_t *tokens, int32_t n, int32_t pos, float *logits, bool all_logits);
// --- end qwen35 hooks

// --- speed hook (pack.c): frees what kr_model_pack made
void kr_pack_free(void *state);

#endif
