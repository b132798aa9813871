// model.h: the model, its sequences, and the interface each architecture implements.
// Internal to the library (owner: engine).
//
//   model.c      opens a .mlb, finds its architecture in the table below, binds the embeddings and
//                the output head, owns the thread pool;
//   loader.c     the loader helpers model.c and the architectures read metadata and tensors with;
//   session.c    the public kr_session_* and kr_batch_eval: one sequence + one step's scratch per
//                session, eval in steps of one or several sessions;
//   layers.c     the pieces every architecture's step is made of (norms, RoPE, the residual,
//                matmul, attention and MLP jobs, the output head), over a batch of tokens that may
//                belong to several sequences at different positions;
//   arch_*.c     one file per architecture family: its layers, its tensors and its step;
//   pack.c       repacks the matrices an architecture lists; kr_matrix_matmul. model.c and
//                pack.c call nothing of each other's: kr_model_close frees the packing through
//                m->pack_free, and pack.c gives the file's pages back with loader.c's helper.
#ifndef KRAFLA_MODEL_H
#define KRAFLA_MODEL_H

#include "runtime/internal.h"
#include "runtime/threads.h"

#include <stdatomic.h>

typedef struct {
    int32_t type;        // kr_type of the weights
    const void *data;    // (rows, cols) in file layout, or packed
    int64_t rows, cols;
    uint64_t row_bytes;
    int32_t packed;      // speed: 1 when data is in the packed layout (pack.c, kernels.h)
} kr_matrix;

// out[t * w->rows + r] = row r of w . prepared row t, for rows [begin, end) and n_tokens prepared rows
// (kr_prepare_activations for w->type): the packed kernels when pack.c repacked w, else the file
// layout's; the same bits either way (pack.c).
void kr_matrix_matmul(const kr_matrix *w, const void *prepared, int64_t n_tokens, float *out, int64_t begin, int64_t end);
// Fetch the first bytes of w's rows [begin, end) (begin a multiple of 8) ahead of a matmul over
// them (kernels.h, kr_stream_start).
void kr_matrix_prefetch(const kr_matrix *w, int64_t begin, int64_t end);

// --- Layers the architectures share (layers.c runs them)

// Softmax attention over the KV cache. wq's rows per head are [q (head_dim) | gate (head_dim)]
// when `gated` (the output is then multiplied by sigmoid(gate)), else q alone.
typedef struct {
    kr_matrix wq, wk, wv, wo;
    const float *bq, *bk, *bv;        // biases (qwen2, gpt-oss) or NULL
    const float *bo;                  // (dim,) Wo's bias (gpt-oss) or NULL
    const float *sinks;               // (n_heads,) each head's learned logit in its softmax's denominator
                                      // (gpt-oss's attention sinks) or NULL
    const float *q_norm, *k_norm;     // (head_dim,) per-head RMSNorm or NULL
    int32_t qk_norm_whole;            // 1: q_norm, k_norm are (q_dim,), (kv_dim,) over the whole projection (olmoe)
    int32_t sliding;                  // 1: sliding-window layer (the model's sliding_window, local RoPE)
    int32_t no_rope;                  // 1: q and k are not rotated (smollm3's every fourth layer)
    int32_t gated;
    int32_t cache_layer;              // which layer of the KV cache it reads and writes
} kr_attention;

typedef struct {
    kr_matrix gate, up, down;         // act(x Wg^T) * (x Wu^T), then Wd
} kr_mlp;

// --- The model

typedef struct kr_arch kr_arch;

struct kr_model {
    kr_file *file;
    const kr_arch *arch;
    kr_model_info info;
    int32_t q_dim, kv_dim;            // n_heads * head_dim, n_kv_heads * head_dim
    int32_t n_cache_layers;           // layers with a KV cache
    kr_matrix **matrices;             // every matrix of the layers, in arch->matrices' order (listed once at open)
    int32_t n_matrices;
    int64_t widest_input;             // the most columns of any matrix (prepared activation rows)
    kr_matrix token_embd;             // (n_vocab, dim)
    kr_matrix output;                 // (n_vocab, dim), token_embd when tied
    const float *output_norm;         // (dim,)
    float **vectors;                  // kr_bind_f32's copies of the f32 tensors (norms, biases), owned
    int32_t n_vectors, vectors_cap;
    float *inv_freq_full;             // (rope_dims / 2,) RoPE frequencies / rope_scale
    float *inv_freq_local;            // (rope_dims / 2,) for sliding-window layers
    void *layers;                     // the architecture's layers (its arch_*.c), freed by arch->close
    kr_pool *pool;
    atomic_int busy;                  // 1 while a step of this model runs
    void *pack;                       // speed: pack.c's state (kr_model_pack), else NULL
    void (*pack_free)(void *pack);    // pack.c's, set with m->pack; kr_model_close calls it
    int32_t n_labels;                 // encoder: outputs of its classifier head (a cross-encoder), else 0
    int32_t n_token_types;            // encoder: rows of its token type (segment) embedding
};

// One sequence's memory: its KV cache and the architecture's recurrent state.
typedef struct {
    int32_t type;                     // KR_F32, KR_F16, KR_Q8_0
    int32_t n_ctx;
    size_t row_bytes;                 // one KV head's row at one position
    uint8_t *k, *v;                   // (n_cache_layers, n_kv_heads, n_ctx, row_bytes)
} kr_kv_cache;

typedef struct {
    kr_kv_cache kv;
    void *recurrent;                  // arch->seq_new's state (qwen35: conv and DeltaNet states) or NULL
} kr_seq;

// Attention takes at most this many queries of one KV head at a time (fewer when the context is so
// long that their scores would pass KR_ATT_SCORES_BUDGET floats per thread).
#define KR_ATT_MAX_QUERIES 64
#define KR_ATT_SCORES_BUDGET (1 << 22)

// A step's scratch, n_batch tokens wide: what layers.c's jobs read and write.
typedef struct {
    int32_t n_batch, n_ctx;
    float *x;                         // (n_batch, dim) residual stream
    float *xb;                        // (n_batch, dim) normed input of a block
    float *q;                         // (n_batch, q_dim) queries after norm and RoPE
    float *qg;                        // (n_batch, 2 q_dim) gated attention's q | gate rows, or NULL
    float *k, *v;                     // (n_batch, kv_dim)
    float *att;                       // (n_batch, q_dim) attention output, heads side by side
    float *proj;                      // (n_batch, dim) output of Wo or of the MLP
    float *gate, *up;                 // (n_batch, ffn_dim)
    int32_t att_queries;              // queries per attention block, at most
    float *scores;                    // (n_threads, att_queries, n_ctx)
    float *att_q;                     // (n_threads, att_queries, head_dim) a block's queries
    int32_t *att_blocks;              // (n_batch * group, 2) [first, end) queries of each block
    float *rope_cos, *rope_sin;       // (2, n_batch, rope_dims / 2): [0] full layers, [1] sliding
    void *prepared[KR_TYPE_COUNT];    // activations prepared for each weight type
    void *gate_prepared;              // (1, ffn_dim) one token's act(gate) * up prepared for the MLP's down matrix
    void *own;                        // arch->scratch_new's buffers or NULL
} kr_scratch;

// The tokens of one step. Token i is at position pos[i] of sequence seq[i]; a sequence's tokens
// come in the batch in order of position, right after the ones it holds (position 0 starts it
// afresh). Each token's values depend only on its sequence, never on the other tokens of the batch
// (docs/architecture.md), so sequences can share a step.
typedef struct {
    int32_t n;                        // 1 to the scratch's n_batch
    const int32_t *tokens;
    const int32_t *pos;
    kr_seq *const *seq;
    float *const *logits;             // token i's logits go to logits[i] unless NULL (or logits NULL)
    const int32_t *token_types;       // encoder: token i's segment (0 or 1 for a sentence pair), NULL: all 0
    // kr_session_embed of a decoder: token i's final hidden state (after output_norm, dim floats)
    // goes to hidden[i] unless NULL; a step asks for hidden states or for logits, not both.
    float *const *hidden;
} kr_batch;

// What an architecture implements. `open` reads m->file into m after model.c has read the common
// hyperparameters (m->info, q_dim, kv_dim): its own metadata and its layers (m->layers, through the
// loader helpers below); model.c then binds the embeddings, output head and RoPE frequencies.
// Everything else runs on an opened model.
struct kr_arch {
    const char *name;                 // the file's `arch`
    const void *variant;              // the implementation's constants for this name (arch_llama.c's
                                      // optional tensors), or NULL
    int (*open)(kr_model *m, const char *path, kr_error *err);
    void (*close)(kr_model *m);       // frees m->layers
    // Every matrix of the layers (not the embedding or head), in a fixed order: pack.c repacks the
    // packable ones in this order (the pack cache's), the session sizes its buffers from all of them.
    // kr_model_open lists them once into m->matrices.
    int (*matrices)(kr_model *m, kr_matrix **out);  // out NULL: count only
    // Optional (NULL: nothing beyond the KV cache / layers.c's scratch).
    int (*seq_new)(kr_model *m, kr_seq *seq, kr_error *err);
    void (*seq_free)(kr_seq *seq);
    int (*scratch_new)(kr_model *m, kr_scratch *s, kr_error *err);
    void (*scratch_free)(kr_scratch *s);
    // Which lengths a sequence holding `held` tokens can be cut back to (kr_session_truncate).
    int (*truncate)(const kr_model *m, int32_t keep, int32_t held, kr_error *err);
    // One forward step over the batch: caches and states of its sequences, logits it asks for.
    void (*step)(kr_model *m, kr_scratch *s, const kr_batch *b);
    // An encoder (arch_bert.c) has no output norm or head and no KV cache, and no RoPE unless
    // `rotary`: model.c reads rope_* and activation only then, and binds only token_embd. Its step
    // attends within each sequence both ways (a sequence is the run of tokens from a position 0 to
    // the next, all in one step) and leaves every token's final hidden state in s->x (n, dim).
    // kr_session_eval refuses it; kr_session_embed pools s->x.
    bool encoder;
    bool rotary;                      // an encoder with RoPE on q and k (nomic-bert), not absolute positions
    // Optional (encoders with m->n_labels > 0): the classifier head on the first token's hidden
    // state (dim,) -> out (n_labels,), with `work` (dim,) floats to use.
    void (*classify)(const kr_model *m, const float *first_hidden, float *work, float *out);
};

extern const kr_arch kr_arch_llama, kr_arch_qwen2, kr_arch_gemma3, kr_arch_qwen35;
// issue 17: mistral, phi3 (split by the converter) and smollm3 (layer_rope) are llama's layer,
// qwen3 llama's layer with q/k head norms (arch_llama.c)
extern const kr_arch kr_arch_qwen3, kr_arch_mistral, kr_arch_phi3, kr_arch_smollm3;
// issue 27: BERT-family encoders and cross-encoders, and nomic-bert (RoPE, SwiGLU) (arch_bert.c)
extern const kr_arch kr_arch_bert, kr_arch_nomic_bert;
// issue 28: the mixtures of experts (arch_moe.c, experts.c)
extern const kr_arch kr_arch_qwen3moe, kr_arch_mixtral, kr_arch_olmoe, kr_arch_gpt_oss;

// --- Sequences and scratch (session.c), for a step over several sequences

int kr_seq_new(kr_model *m, kr_seq *seq, int32_t n_ctx, int32_t kv_type, kr_error *err);
void kr_seq_free(kr_model *m, kr_seq *seq);
int kr_scratch_new(kr_model *m, kr_scratch *s, int32_t n_batch, int32_t n_ctx, kr_error *err);
void kr_scratch_free(kr_model *m, kr_scratch *s);
// calloc of count * size bytes; sets *failed (and returns NULL) on overflow, zero size or no memory.
void *kr_zalloc(size_t count, size_t size, bool *failed);

// --- Loader helpers (loader.c): each checks and names the file, key or tensor in its error

int kr_load_int(kr_model *m, const char *path, const char *key, bool required, int64_t fallback, int64_t low,
                int64_t high, int32_t *out, kr_error *err);
// A float in [low, high] (strictly above low when strict_low); NaN and infinities refused.
int kr_load_float(kr_model *m, const char *path, const char *key, bool required, double fallback, double low,
                  bool strict_low, double high, float *out, kr_error *err);
// The metadata `key` as a list of one integer per layer (read with kr_file_meta_int_at): *index is
// its entry, or -1 when the file has none.
int kr_find_layer_list(kr_model *m, const char *path, const char *key, int32_t *index, kr_error *err);
// layer_types, one integer per layer, each one of `allowed` (a string of digits, e.g. "01");
// absent: `fallback` for every layer, or an error when fallback < 0.
int kr_load_layer_types(kr_model *m, const char *path, const char *allowed, int32_t fallback, int32_t *types,
                        kr_error *err);
// layer_types of full (0) and sliding-window (1) layers into sliding (absent: all full), counted
// into m->info.n_sliding_layers; an error when some slide but sliding_window is 0.
int kr_load_sliding_layers(kr_model *m, const char *path, int32_t *sliding, kr_error *err);
int kr_bind_matrix(kr_model *m, const char *path, const char *name, int64_t rows, int64_t cols, kr_matrix *out,
                   kr_error *err);
// Give the model file's pages holding [data, data + bytes) back (whole pages, so a neighbour's
// share of the first and last page goes too): the mapping is private and never written, so a page
// read again later is faulted back in from the page cache. For what was copied out of the file.
void kr_release_file_pages(const void *data, size_t bytes);
// An f32 tensor of shape (d0,) when d1 is 0, else (d0, d1), copied (its file pages given back).
int kr_bind_f32(kr_model *m, const char *path, const char *name, int64_t d0, int64_t d1, const float **out,
                kr_error *err);
// A layer's attention tensors: attn_q/k/v/output (wq of q_rows rows), biases and q/k norms when
// asked for.
int kr_bind_attention(kr_model *m, const char *path, int32_t layer, int64_t q_rows, bool biases, bool qk_norms,
                      kr_attention *out, kr_error *err);
int kr_bind_mlp(kr_model *m, const char *path, int32_t layer, kr_mlp *out, kr_error *err);

// --- Shared pieces of a step (layers.c)

// RoPE angles of every token of the batch at its position, for full and sliding layers.
void kr_rope_tables(kr_model *m, kr_scratch *s, const kr_batch *b);
// Rotate the first rope_dims values of one head by the angles whose cos/sin are given (a row of
// kr_rope_tables'), pairs (i, i + rope_dims / 2) for KR_ROPE_NEOX, (2i, 2i + 1) for KR_ROPE_NORM.
void kr_rope_head(float *head, const float *cos_row, const float *sin_row, int32_t rope_dims, int32_t style);
// Layer 0: x = embed(tokens); else x += add (after add_norm when set). Then xb = norm(x) and xb
// prepared for the n_w matrices that read it.
void kr_residual(kr_model *m, kr_scratch *s, const kr_batch *b, const int32_t *tokens, float *add,
                 const float *add_norm, const float *norm, const kr_matrix *const *w, int32_t n_w);
// out_i = input W_i^T (+ bias_i) for up to four matrices reading `input`, (n, cols) floats,
// prepared first unless input is NULL (already prepared: kr_residual's xb).
void kr_matmuls(kr_model *m, kr_scratch *s, int32_t n, const float *input, int64_t cols, int32_t n_w,
                const kr_matrix *const *w, float *const *out, const float *const *bias);
// Attention of prepared xb: q, k, v, norms, RoPE, K/V into each token's cache, softmax attention,
// [gate], Wo into s->proj.
void kr_attention_block(kr_model *m, kr_scratch *s, const kr_batch *b, const kr_attention *l);
// The MLP of prepared xb into s->proj.
void kr_mlp_block(kr_model *m, kr_scratch *s, const kr_batch *b, const kr_mlp *l);
// The MLP of n rows of `input` (n, dim), prepared first (NULL: xb, already prepared), into s->proj.
void kr_mlp_rows(kr_model *m, kr_scratch *s, int32_t n, const float *input, const kr_mlp *l);
// Tokens that ask for logits: x += add (after add_norm), final norm, the output head, softcap.
// With b->hidden (no logits): the final norm of the tokens that ask, into hidden[i], and no head.
void kr_output(kr_model *m, kr_scratch *s, const kr_batch *b, float *add, const float *add_norm);

#endif
