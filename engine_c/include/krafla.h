// krafla.h: the whole C API that krafla_twisted (ctypes) sees.
//
// Conventions: opaque handles, no globals. Every function that can fail takes a
// `kr_error *err` (may be NULL), returns a status (KR_OK = 0) or NULL, and fills err with a
// message the user can act on. The library never exits or aborts on bad input.
// Each section below belongs to one source file in engine_c/src/.
#ifndef KRAFLA_H
#define KRAFLA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// ---------------------------------------------------------------------------------------------
// Errors (error.c; kr_weight_type_supported is types/types.c's)

typedef enum {
    KR_OK = 0,
    KR_ERR_IO = 1,           // open, stat, mmap, read, write failed
    KR_ERR_FORMAT = 2,       // a file is malformed, truncated or hostile
    KR_ERR_UNSUPPORTED = 3,  // valid but not something this build can run
    KR_ERR_ARGUMENT = 4,     // a bad argument from the caller (token id, size, NULL)
    KR_ERR_MEMORY = 5,       // allocation failed or a size would overflow
    KR_ERR_CONTEXT = 6,      // positions past the session's context
    KR_ERR_STATE = 7,        // the handle cannot do this now (closed, busy)
} kr_status;

#define KR_ERROR_MESSAGE_SIZE 512

typedef struct {
    int32_t status;                        // kr_status
    char message[KR_ERROR_MESSAGE_SIZE];   // NUL-terminated, "" when status is KR_OK
} kr_error;

// Version string, e.g. "0.7.0", and the ISA this library was built for: "avx2", "generic".
const char *kr_version(void);
const char *kr_isa(void);
// 1 when this library computes on weight matrices of `type` (a kr_type), else 0: what `krafla
// pull` keeps a published file's types for.
int kr_weight_type_supported(int32_t type);

// ---------------------------------------------------------------------------------------------
// Container files .mlb / .mlt (file.c; the type table, kr_type_size and kr_type_name, types/types.c).
// The layout is in docs/formats.md and krafla_twisted/engine/formats.py; these constants must agree
// with that module (tested).

#define KR_MODEL_MAGIC "KRAFLAMB"
#define KR_TOKENIZER_MAGIC "KRAFLATK"
#define KR_FILE_VERSION 1
#define KR_ALIGNMENT 64
#define KR_MAX_DIMS 4
#define KR_MAX_NAME 1024
#define KR_MAX_ENTRIES (1u << 20)

typedef enum { KR_META_INT = 1, KR_META_FLOAT = 2, KR_META_STR = 3, KR_META_INTS = 4, KR_META_FLOATS = 5 } kr_meta_kind;

// Block types after KR_U8 are ggml's layouts byte for byte (docs/formats.md): q4_1, q5_0, q5_1,
// iq4_nl and mxfp4 in blocks of 32, the k-quants q2_K, q3_K, q4_K, q5_K, q6_K and iq4_xs in
// super-blocks of 256.
typedef enum {
    KR_F32 = 0, KR_F16 = 1, KR_BF16 = 2, KR_Q8_0 = 3, KR_Q4_0 = 4, KR_I32 = 5, KR_U8 = 6,
    KR_Q4_1 = 7, KR_Q5_0 = 8, KR_Q5_1 = 9, KR_Q4_K = 10, KR_Q5_K = 11, KR_Q6_K = 12,
    KR_Q2_K = 13, KR_Q3_K = 14, KR_IQ4_NL = 15, KR_IQ4_XS = 16, KR_MXFP4 = 17,
    KR_TYPE_COUNT = 18,
} kr_type;

typedef struct kr_file kr_file;

typedef struct {
    const char *name;        // NUL-terminated copy, owned by the kr_file
    int32_t type;            // kr_type
    int32_t n_dims;
    uint64_t dims[KR_MAX_DIMS];  // outermost first (numpy order); rows of a matrix are dims[0]
    uint64_t n_elements;
    uint64_t n_bytes;
    const void *data;        // inside the mapping, KR_ALIGNMENT-aligned
} kr_tensor_info;

// Open and fully validate a container; `magic` is KR_MODEL_MAGIC, KR_TOKENIZER_MAGIC or NULL
// for either. Every offset, size, count and dimension is checked against the file length.
// Returns NULL and fills err on any problem.
kr_file *kr_file_open(const char *path, const char *magic, kr_error *err);
void kr_file_close(kr_file *file);
const char *kr_file_magic(const kr_file *file);  // 8 chars, not NUL-terminated
uint64_t kr_file_size(const kr_file *file);
int32_t kr_file_n_meta(const kr_file *file);
int32_t kr_file_n_tensors(const kr_file *file);

// Metadata entry by index: key, kind and value. For arrays, *count is the number of elements
// and ints/floats point at them (unaligned little-endian storage is copied for you on access
// through kr_file_meta_int_at / _float_at). Returns KR_ERR_ARGUMENT for a bad index.
int kr_file_meta(const kr_file *file, int32_t index, const char **key, int32_t *kind,
                 int64_t *int_value, double *float_value, const char **str_value,
                 uint32_t *str_length_or_count, kr_error *err);
int64_t kr_file_meta_int_at(const kr_file *file, int32_t index, uint32_t element);
double kr_file_meta_float_at(const kr_file *file, int32_t index, uint32_t element);
// Copy all `count` values of an ints/floats entry (as int64_t or double, the entry's kind) to
// `out`; `count` must equal the entry's count. KR_ERR_ARGUMENT for a bad index, kind or count.
int kr_file_meta_array(const kr_file *file, int32_t index, void *out, uint32_t count, kr_error *err);
// Index of a metadata key, or -1.
int32_t kr_file_find_meta(const kr_file *file, const char *key);
// Typed lookups with a default for a missing key; a present key of the wrong kind is an error.
int kr_file_get_int(const kr_file *file, const char *key, int64_t fallback, int64_t *out, kr_error *err);
int kr_file_get_float(const kr_file *file, const char *key, double fallback, double *out, kr_error *err);
// A string value, NUL-terminated copy owned by the file, or `fallback` if missing.
int kr_file_get_str(const kr_file *file, const char *key, const char *fallback, const char **out, kr_error *err);

int kr_file_tensor(const kr_file *file, int32_t index, kr_tensor_info *info, kr_error *err);
// Find a tensor by name; returns KR_ERR_FORMAT naming the file and tensor if missing.
int kr_file_find_tensor(const kr_file *file, const char *name, kr_tensor_info *info, kr_error *err);
int32_t kr_file_find_tensor_index(const kr_file *file, const char *name);

// Bytes taken by `n_elements` of `type` (a whole number of blocks), or 0 if invalid.
uint64_t kr_type_size(int32_t type, uint64_t n_elements);
const char *kr_type_name(int32_t type);

// ---------------------------------------------------------------------------------------------
// --- Tokenizer (tokenizer.c, tokenizer_unicode.c; owner: tokenizer)
//
// A kr_tokenizer reads a .mlt (docs/formats.md, "Tokenizer files"): byte-level BPE with the
// gpt2 / llama3 / qwen2 / smollm / qwen35 pre-tokenizers, or SentencePiece BPE with byte
// fallback. It behaves as llama.cpp's tokenizer does and is immutable once open, so any number of
// threads may encode and decode with it at once. Text is bytes: NUL is an ordinary character and
// an invalid UTF-8 byte is kept and encoded through the byte tokens (never lost, never an error).

typedef struct kr_tokenizer kr_tokenizer;

typedef enum {
    KR_TOKEN_UNDEFINED = 0, KR_TOKEN_NORMAL = 1, KR_TOKEN_UNKNOWN = 2, KR_TOKEN_CONTROL = 3,
    KR_TOKEN_USER_DEFINED = 4, KR_TOKEN_UNUSED = 5, KR_TOKEN_BYTE = 6,
} kr_token_type;  // GGUF's token types

typedef struct {
    int32_t n_vocab;
    int32_t kind;                              // 1 byte-level BPE, 2 SentencePiece BPE
    int32_t bos_id, eos_id, unk_id, pad_id;    // -1 when the vocabulary has none
    int32_t add_bos, add_eos, add_space_prefix;
    int32_t n_eot;                             // end-of-generation ids (kr_tokenizer_eot_ids)
    char pre[16];                              // "gpt2", "llama3", "qwen2", "smollm", "qwen35", "none"
} kr_tokenizer_info;

// Open and validate a .mlt; NULL and err filled on any problem (the file and the table named).
kr_tokenizer *kr_tokenizer_open(const char *path, kr_error *err);
void kr_tokenizer_close(kr_tokenizer *tok);
int kr_tokenizer_get_info(const kr_tokenizer *tok, kr_tokenizer_info *info, kr_error *err);
// The end-of-generation ids (eos, end of turn: <|im_end|>, <|eot_id|>, <end_of_turn>, ...),
// ascending; writes min(count, capacity) and returns the count.
int32_t kr_tokenizer_eot_ids(const kr_tokenizer *tok, int32_t *ids, int32_t capacity);
int kr_tokenizer_is_eot(const kr_tokenizer *tok, int32_t id);

// Encode text[0..n_text) (at most 2^28 bytes). add_bos / add_eos: 1 yes, 0 no, -1 as the file says.
// special = 1: exact spellings of control tokens (e.g. "<|im_start|>") become those tokens;
// special = 0: they stay plain text and no control token can come out. User-defined tokens are
// matched either way (as llama.cpp and Hugging Face do). *n_tokens gets the full count; only the
// first `capacity` ids are written, so call again with a larger buffer if it did not fit.
int kr_tokenizer_encode(const kr_tokenizer *tok, const char *text, int64_t n_text, int32_t add_bos, int32_t add_eos,
                        int32_t special, int32_t *tokens, int64_t capacity, int64_t *n_tokens, kr_error *err);
// The bytes of ids; control and unknown tokens give nothing unless special = 1. An id outside
// the vocabulary is KR_ERR_ARGUMENT. *n_bytes and capacity as for encode.
int kr_tokenizer_decode(const kr_tokenizer *tok, const int32_t *ids, int64_t n_ids, int32_t special, char *out,
                        int64_t capacity, int64_t *n_bytes, kr_error *err);
// What token `id` stands for (a control token: its spelling) and its spelling in the vocabulary
// (BPE: GPT-2's byte alphabet, SPM: U+2581 for a space); pointers into the tokenizer, NULL for a
// bad id. kr_tokenizer_find is the exact inverse of the spelling (-1 if none).
const char *kr_tokenizer_token_piece(const kr_tokenizer *tok, int32_t id, int64_t *length);
const char *kr_tokenizer_token_text(const kr_tokenizer *tok, int32_t id, int64_t *length);
int32_t kr_tokenizer_find(const kr_tokenizer *tok, const char *text, int64_t n_text);
int32_t kr_tokenizer_token_type(const kr_tokenizer *tok, int32_t id);  // kr_token_type, 0 for a bad id
// The pre-tokenizer alone (tests and debugging): byte end offsets of each pre-token of text.
int kr_tokenizer_pretokenize(const kr_tokenizer *tok, const char *text, int64_t n_text, int64_t *ends,
                             int64_t capacity, int64_t *n_words, kr_error *err);
// Class bits of a codepoint as the pre-tokenizers see it: 1 letter \p{L}, 2 number \p{N}, 4 mark
// \p{M}, 8 White_Space \s, 16 upper-case letter \p{Lu} or \p{Lt}, 32 lower-case letter \p{Ll}.
int32_t kr_unicode_class(uint32_t codepoint);
// --- end Tokenizer

// ---------------------------------------------------------------------------------------------
// --- Model and session (model/: model.c, loader.c, session.c, layers.c, arch_*.c; runtime/threads.c; owner: engine)
//
// A kr_model maps a .mlb file, validates every hyperparameter and binds every tensor (type and
// shape checked), and owns a pool of n_threads threads (the caller plus n_threads - 1 workers).
// A kr_session owns a KV cache of n_ctx positions and the scratch for n_batch tokens per step.
// A model may have several sessions, but only one call may evaluate on it at a time (a second
// concurrent kr_session_eval* or kr_batch_eval fails with KR_ERR_STATE); kr_batch_eval runs one
// step over several of its sessions at once. Free every session before closing its model.

typedef struct kr_model kr_model;
typedef struct kr_session kr_session;

typedef enum { KR_ROPE_NORM = 0, KR_ROPE_NEOX = 1 } kr_rope_style;
typedef enum { KR_ACT_SILU = 0, KR_ACT_GELU_TANH = 1 } kr_activation;

typedef struct {
    char arch[16];               // "llama", "qwen2", "gemma3"
    char name[128];              // metadata `name`, "" if absent
    int32_t n_vocab, dim, n_layers, n_heads, n_kv_heads, head_dim, ffn_dim, max_seq;
    int32_t rope_dims, rope_style, activation, tied_embeddings, sliding_window;
    int32_t n_sliding_layers;    // layers with layer_types[i] == 1
    int32_t weight_type;         // kr_type of blk.0.attn_q.weight (for display)
    int32_t output_type;         // kr_type of the output head
    int32_t n_threads;
    float norm_eps, rope_theta, rope_theta_local, rope_scale, embedding_scale, attn_scale;
    float attn_softcap, final_softcap;
    uint64_t n_params;           // elements in all tensors
    uint64_t n_bytes;            // bytes of all tensors
} kr_model_info;

// Open `path` (a .mlb) with a pool of n_threads (1..256). NULL and err filled on any problem:
// a missing or malformed key, an unsupported architecture, a tensor of the wrong type or shape.
kr_model *kr_model_open(const char *path, int32_t n_threads, kr_error *err);
void kr_model_close(kr_model *model);
int kr_model_get_info(const kr_model *model, kr_model_info *info, kr_error *err);
// The container the model was read from (metadata access through kr_file_*); owned by the model.
const kr_file *kr_model_file(const kr_model *model);

// The context a session gets when kr_session_new is asked for n_ctx = 0 (or the model's max_seq
// if that is shorter).
#define KR_DEFAULT_MAX_CTX 4096
// The KV cache types kr_session_new accepts (q8_0: head_dim a multiple of 32).
typedef enum { KR_KV_F32 = KR_F32, KR_KV_F16 = KR_F16, KR_KV_Q8_0 = KR_Q8_0 } kr_kv_type;

// n_ctx: positions in the KV cache (0 = the model's max_seq, at most KR_DEFAULT_MAX_CTX); kv_type
// a kr_kv_type; n_batch: tokens per forward step (1..65536, clamped to n_ctx).
kr_session *kr_session_new(kr_model *model, int32_t n_ctx, int32_t kv_type, int32_t n_batch, kr_error *err);
void kr_session_free(kr_session *session);
// Run tokens[0..n) at positions n_tokens.. in steps of n_batch; write the last token's logits
// (n_vocab floats) to logits_out unless it is NULL. Token ids outside [0, n_vocab) are
// KR_ERR_ARGUMENT and tokens past n_ctx are KR_ERR_CONTEXT, both checked before any work, so a
// failed call leaves the session unchanged.
int kr_session_eval(kr_session *session, const int32_t *tokens, int32_t n, float *logits_out, kr_error *err);
// As kr_session_eval, but logits_out (required) receives the logits of every token: n * n_vocab
// floats, row i for tokens[i], each row the bits kr_session_eval gives when tokens[i] is its last
// token (perplexity, scoring). The one-logit path does not pay for it.
int kr_session_eval_all(kr_session *session, const int32_t *tokens, int32_t n, float *logits_out, kr_error *err);
// Forget every position from n_tokens on (0 <= n_tokens <= kr_session_n_tokens).
int kr_session_truncate(kr_session *session, int32_t n_tokens, kr_error *err);
// Make `dst` hold the first n_tokens positions of `src` (0 <= n_tokens <= src's tokens, within dst's
// context), dropping what dst held: their keys and values are copied, so evaluating on in dst
// gives the bits it would give after evaluating those tokens itself. Both sessions of one model
// with the same KV type; refused (KR_ERR_UNSUPPORTED) for an architecture with a recurrent state
// (Qwen3.5), whose state exists only for the last position.
int kr_session_copy_prefix(kr_session *dst, const kr_session *src, int32_t n_tokens, kr_error *err);
int32_t kr_session_n_tokens(const kr_session *session);
int32_t kr_session_n_ctx(const kr_session *session);
int32_t kr_session_n_batch(const kr_session *session);
int32_t kr_session_kv_type(const kr_session *session);

// --- Several sessions in one step (the server's batching of concurrent requests)
//
// kr_batch_eval appends items[k].tokens to items[k].session for every item, all in the same
// forward steps: a scheduler gives one item per active sequence, 1 token for a sequence that is
// generating and a chunk of its prompt for one that is prefilling, and the weights are read once
// per step for all of them. Each session's logits are bitwise identical to what kr_session_eval /
// kr_session_eval_all give it alone, whatever the other items, their number, positions and
// lengths, the order of the items and the thread count (docs/architecture.md, "batched step").
//
// Steps: the tokens are laid out item after item, each item's in order, and run in steps of the
// n_batch of the scratch the call borrows: that of the listed session with the longest context
// (the first such), whose scratch can score every position of every session. With sessions of
// one n_ctx and n_batch (a server's slots), a call of at most n_batch tokens in all is one step;
// a longer one is cut into consecutive steps (an item may straddle two), with the same bits.
//
// Everything is checked before any work, so a failed call changes no session: model and items
// not NULL, n_items >= 1, each session of this model and listed once, tokens in
// [0, n_vocab) (KR_ERR_ARGUMENT), each item's tokens within its session's context
// (KR_ERR_CONTEXT), logits_out present when asked for, the model not busy (KR_ERR_STATE). The
// error message names the item. Qwen3.5's sessions follow their rule as ever: a session that
// holds 0 tokens starts afresh (kr_session_truncate keeps the whole state or none).
typedef enum {
    KR_LOGITS_NONE = 0,          // prefill: no logits
    KR_LOGITS_LAST = 1,          // the last token's: n_vocab floats (kr_session_eval's)
    KR_LOGITS_ALL = 2,           // every token's: n_tokens * n_vocab floats, row i for tokens[i] (eval_all's)
} kr_logits_mode;

typedef struct {
    kr_session *session;
    const int32_t *tokens;       // (n_tokens,) appended at positions kr_session_n_tokens(session)..
    int32_t n_tokens;            // at least 1
    int32_t logits;              // kr_logits_mode
    float *logits_out;           // where they go (unused with KR_LOGITS_NONE)
} kr_batch_item;

int kr_batch_eval(kr_model *model, const kr_batch_item *items, int32_t n_items, kr_error *err);

// Tests of the step itself (model/model.h, kr_batch): one step of n tokens (at most sessions[0]'s
// n_batch, whose scratch it uses), token i appended to sessions[which[i]] (all sessions of one
// model), a session's tokens side by side or apart; logits_out (n * n_vocab floats, or NULL) gets
// every token's logits, row i for tokens[i]. Checked like kr_session_eval.
int kr_test_eval_mixed(kr_session *const *sessions, int32_t n_sessions, const int32_t *tokens, const int32_t *which,
                       int32_t n, float *logits_out, kr_error *err);
// --- end Model and session

// --- Embeddings (model/session.c, model/arch_bert.c; owner: embed)
//
// kr_session_embed runs n_sequences independent sequences (tokens laid end to end, sequence k
// lengths[k] tokens long, each from position 0) through an encoder (arch bert; the session's own
// positions are not used nor changed) or a decoder (any other arch: each sequence in turn through
// the session's KV cache, causal attention, the states after output_norm; the session holds no
// tokens afterwards) and writes, sequence after sequence, into out:
//   KR_POOLING_NONE   every token's final hidden state, lengths[k] * dim floats;
//   KR_POOLING_MEAN   their mean (the tokens summed in order, then divided), dim floats;
//   KR_POOLING_CLS    the first token's, dim floats;
//   KR_POOLING_LAST   the last token's, dim floats;
//   KR_POOLING_RANK   the classifier head on the first token (a cross-encoder), n_labels floats.
// (A decoder's KR_POOLING_LAST is Qwen3-Embedding's last-token pooling.)
// No normalisation: the caller applies what the model card says. token_types (NULL: all 0) gives
// each token's segment, below the model's n_token_types. Sequences share forward steps of the
// session's n_batch tokens (an encoder's each whole in one step: lengths[k] <= n_batch, n_ctx and
// the model's max_seq; a decoder's within n_ctx and max_seq; else KR_ERR_CONTEXT), and a
// sequence's outputs are bitwise the same whichever others share its step, in any order, on any
// thread count. Everything is checked first (KR_ERR_ARGUMENT: ids, types (a decoder takes none),
// lengths, pooling; KR_ERR_UNSUPPORTED: KR_POOLING_RANK without a classifier head; KR_ERR_STATE:
// the model busy).
typedef enum {
    KR_POOLING_NONE = 0,
    KR_POOLING_MEAN = 1,
    KR_POOLING_CLS = 2,
    KR_POOLING_LAST = 3,
    KR_POOLING_RANK = 4,
} kr_pooling;
int kr_session_embed(kr_session *session, const int32_t *tokens, const int32_t *token_types, const int32_t *lengths,
                     int32_t n_sequences, int32_t pooling, float *out, kr_error *err);
// Floats kr_session_embed writes per sequence for `pooling` (KR_POOLING_NONE: per token): dim, or
// n_labels for KR_POOLING_RANK (0 when the model has no classifier head).
int32_t kr_model_pooled_size(const kr_model *model, int32_t pooling);
// --- end Embeddings

// ---------------------------------------------------------------------------------------------
// --- Sampler (sampler.c; owner: generate)
//
// Penalties over the last repeat_last_n history tokens, each distinct id once, as llama.cpp applies
// them: the repeat penalty (a positive logit is divided by it, a negative one multiplied), then
// OpenAI's frequency and presence penalties (count * frequency_penalty + presence_penalty is
// subtracted, count being the id's occurrences in that window); then greedy when temperature is 0,
// top_k is 1 or top_p is 0 (ties to the lowest id), else softmax(logits / temperature) -> top-k
// -> top-p -> min-p (drop what is less likely than min_p times the best token) -> one draw from a
// xoshiro256** stream seeded with `seed`. Deterministic: the result
// depends only on the arguments and on how many draws this sampler made before.

typedef struct kr_sampler kr_sampler;

typedef struct {
    float temperature;     // >= 0; 0 = greedy
    float top_p;           // 0..1; 1 = off
    int32_t top_k;         // >= 0; 0 = off
    float repeat_penalty;  // > 0; 1 = off
    int32_t repeat_last_n; // >= 0, or -1 for the whole history; 0 = off (for all three penalties)
    uint64_t seed;
    float frequency_penalty;  // finite; 0 = off (OpenAI's range is -2..2)
    float presence_penalty;   // finite; 0 = off
    float min_p;              // 0..1; 0 = off
} kr_sampler_params;

// A sampler over n_vocab tokens; NULL and err filled for a bad parameter (named in the message).
kr_sampler *kr_sampler_new(const kr_sampler_params *params, int32_t n_vocab, kr_error *err);
void kr_sampler_free(kr_sampler *sampler);
// Choose the next token from logits[0..n_logits) (n_logits must be n_vocab) given the history
// (prompt and reply so far, oldest first; only its tail is used). NaN or +inf logits, all -inf,
// or history ids outside the vocabulary are KR_ERR_ARGUMENT. The caller's logits are not changed.
int kr_sampler_sample(kr_sampler *sampler, const float *logits, int32_t n_logits, const int32_t *history,
                      int32_t n_history, int32_t *token_out, kr_error *err);
// Restart the random stream as if the sampler were new with this seed.
int kr_sampler_reseed(kr_sampler *sampler, uint64_t seed, kr_error *err);

// What the API reports of a row of logits beside the sampled token (its `logprobs`): the
// log-softmax in double precision, summed in id order. *token_logprob gets `token`'s;
// top_ids/top_logprobs get the `top` (0..n) most likely tokens, best first, ties to the lower id.
// NaN or +inf logits, or all -inf, are KR_ERR_ARGUMENT, as for kr_sampler_sample.
int kr_logprobs(const float *logits, int32_t n, int32_t token, int32_t top, int32_t *top_ids, double *top_logprobs,
                double *token_logprob, kr_error *err);
// A grammar's mask: logits[i] = -inf for every i < n whose bit in `allowed` is clear (token i is
// bit i % 32 of allowed[i / 32], llguidance's layout).
int kr_logits_mask(float *logits, int32_t n, const uint32_t *allowed, kr_error *err);
// --- end Sampler


// ---------------------------------------------------------------------------------------------
// --- Kernels (tests) (kernels.c; owner: kernels)
// Entry points that run one numeric kernel of engine_c/src/kernels/kernels.h on caller buffers, so
// tests can compare the reference and the AVX2 version of each kernel inside one library. `impl`
// picks which: KR_KERNEL_DISPATCH (what the engine calls), KR_KERNEL_REFERENCE (the _ref twins:
// quant_ref.c, f16.c, legacy_ref.c, kquant_ref.c) or KR_KERNEL_AVX2 (kernels_avx2.c;
// KR_ERR_UNSUPPORTED in an ISA=generic build). Every size and type is checked; a bad one is
// KR_ERR_ARGUMENT. Weight types: KR_F32, KR_F16, KR_BF16, KR_Q8_0, KR_Q4_0, KR_Q4_1, KR_Q5_0,
// KR_Q5_1, KR_Q4_K, KR_Q5_K, KR_Q6_K, KR_Q2_K, KR_Q3_K, KR_IQ4_NL, KR_IQ4_XS, KR_MXFP4;
// q8_0/q4_0/q4_1/q5_0/q5_1/iq4_nl/mxfp4 rows are whole blocks of 32, k-quant and iq4_xs rows of 256.
// q2_K, q3_K and iq4_xs (kernels/lowbit.h) are not packed: kr_test_pack refuses them (iq4_nl and
// mxfp4 are: kernels/legacy.h).

#define KR_KERNEL_DISPATCH 0
#define KR_KERNEL_REFERENCE 1
#define KR_KERNEL_AVX2 2

// Conversions of n values: f16 -> f32 and f32 -> f16 (round to nearest even).
int kr_test_f16_to_f32(int impl, const uint16_t *x, float *y, int64_t n, kr_error *err);
int kr_test_f32_to_f16(int impl, const float *x, uint16_t *y, int64_t n, kr_error *err);
// n floats (a multiple of 32) -> n/32 q8_0 blocks of 34 bytes.
int kr_test_quantize_q8_0(int impl, const float *x, void *blocks, int64_t n, kr_error *err);
// n floats (a multiple of 256) -> n/256 q8_K blocks of 292 bytes (float d, int8 q[256], int16 bsums[16]).
int kr_test_quantize_q8_K(int impl, const float *x, void *blocks, int64_t n, kr_error *err);
// One row of n weights of `type` -> n floats.
int kr_test_dequantize(int32_t type, const void *row, float *out, int64_t n, kr_error *err);
// W (rows, cols) of weight_type @ x (n_tokens, cols) f32 -> out (n_tokens, rows): prepares the
// activations with impl's quantizer, then kr_matmul over rows [row_begin, row_end) only.
int kr_test_matmul(int impl, int32_t weight_type, const void *weights, int64_t rows, int64_t cols, const float *x,
                   int64_t n_tokens, float *out, int64_t row_begin, int64_t row_end, kr_error *err);
// dot(a, b) for a of KR_F32 or KR_F16 and b f32; and y += alpha * x for x of KR_F32 or KR_F16.
int kr_test_dot(int impl, int32_t type, const void *a, const float *b, int64_t n, float *result, kr_error *err);
int kr_test_axpy(int impl, int32_t type, float alpha, const void *x, float *y, int64_t n, kr_error *err);
// kr_dot_rows / kr_axpy_rows: rows of n values of `type` (KR_F32 or KR_F16), row i at byte
// offset i * row_stride; out (n_rows) = the dots with x; y (n) += sum weights[i] * row i.
int kr_test_dot_rows(int impl, int32_t type, const void *rows, int64_t row_stride, int64_t n_rows, const float *x,
                     int64_t n, float *out, kr_error *err);
int kr_test_axpy_rows(int impl, int32_t type, const float *weights, const void *rows, int64_t row_stride, int64_t n_rows,
                      float *y, int64_t n, kr_error *err);
// Element-wise kernels; which: 0 y = exp(x); 1 x = exp(x - shift) in place and *sum = their sum;
// 2 x = silu(x) * y; 3 x = gelu_tanh(x) * y (x is the gate, y the up projection).
int kr_test_elementwise(int impl, int32_t which, float *x, float *y, int64_t n, float shift, float *sum, kr_error *err);
// One token of DeltaNet's gated delta rule (kernels/deltanet.h) on a value head's state S^T (dv rows
// of dk, updated in place): out (dv) = the new state's rows . q.
int kr_test_delta_rule(int impl, float *state, int64_t dk, int64_t dv, const float *q, const float *k, const float *v,
                       float beta, float decay, float *out, kr_error *err);
// For bench/kernels.py: prepare the activations and run kr_matmul (kr_matmul_packed when `packed`
// is nonzero: weights from kr_test_pack) over all rows `repeat` times; *best_seconds is the fastest
// repetition in CPU time of the calling thread (so a busy machine slows it less than wall time).
// Arguments as kr_test_matmul.
int kr_bench_matmul(int impl, int32_t weight_type, const void *weights, int32_t packed, int64_t rows, int64_t cols,
                    const float *x, int64_t n_tokens, int32_t repeat, double *best_seconds, kr_error *err);
// Packed weights (owner: speed): kr_test_pack rearranges a q8_0/q4_0/q4_1/q5_0/q5_1/k-quant (rows, cols)
// matrix into the packed layout (engine_c/src/kernels/kernels.h, legacy.h; the same number of bytes); kr_test_matmul_packed is
// kr_test_matmul on packed weights and gives the same bits.
int kr_test_pack(int32_t weight_type, const void *weights, int64_t rows, int64_t cols, void *packed, kr_error *err);
int kr_test_matmul_packed(int impl, int32_t weight_type, const void *packed, int64_t rows, int64_t cols, const float *x,
                          int64_t n_tokens, float *out, int64_t row_begin, int64_t row_end, kr_error *err);
// Row `row` of a packed matrix (from kr_test_pack) as floats (cols of them): the embedding lookup of
// a tied, packed output head, bit for bit kr_test_dequantize of the file layout's row.
int kr_test_dequantize_packed(int32_t weight_type, const void *packed, int64_t rows, int64_t cols, int64_t row, float *out,
                              kr_error *err);
// --- end Kernels (tests)

// ---------------------------------------------------------------------------------------------
// --- Weight packing (model/pack.c; owner: speed)
// Call after kr_model_open and before the first session. KR_PACK_OFF: the file's layout (nothing
// happens). KR_PACK_ON: every q8_0/q4_0/q4_1/q5_0/q5_1/q4_K/q5_K/q6_K matrix is copied once into
// the packed layout (the file's pages of it are then released). KR_PACK_CACHE: the same, kept in the file `cache_path` (the
// Python binding uses the model path + ".pack"), keyed by the model's checksum (every tensor's
// type, shape and bytes), the ISA and the layout version, and
// checked on every load: a matching cache is mapped instead of packing, a stale, foreign or
// corrupt one is rebuilt (atomically, by rename), never trusted. A cache that cannot be written
// leaves the model packed in memory, with the reason in kr_model_pack_status.
#define KR_PACK_OFF 0
#define KR_PACK_ON 1
#define KR_PACK_CACHE 2
int kr_model_pack(kr_model *model, int32_t mode, const char *cache_path, kr_error *err);
// What the last kr_model_pack did (a kr_pack_status); `note` (if not NULL, size bytes) gets a
// one-line reason (why a cache was rebuilt, or why it could not be written: the caller should log that one).
typedef enum {
    KR_PACK_STATUS_NONE = 0,          // not packed: the file's layout
    KR_PACK_STATUS_MEMORY = 1,        // packed in memory (KR_PACK_ON)
    KR_PACK_STATUS_CACHE_MAPPED = 2,  // a valid cache mapped
    KR_PACK_STATUS_CACHE_BUILT = 3,   // the cache (re)built and mapped
    KR_PACK_STATUS_CACHE_FAILED = 4,  // KR_PACK_CACHE, but the cache could not be written: packed in memory
} kr_pack_status;
int32_t kr_model_pack_status(const kr_model *model, char *note, size_t size);
// --- end Weight packing

// ---------------------------------------------------------------------------------------------
// --- Attention kernel (tests) (attention.c; owner: attn)
// kr_attend_values (engine_c/src/attention.h) on caller buffers, `impl` as in "Kernels (tests)":
// value rows of n values of `type` (KR_F32, KR_F16, or KR_Q8_0 with n a multiple of 32), row p at
// byte offset p * row_stride, n_rows of them; weights (n_queries, n_rows) f32; query i folds
// rows [begin[i], end[i]) (0 <= begin <= end <= n_rows) into out (n_queries, n):
// out[i][e] = fma(w_p, V[p][e], ...) over p ascending from 0, as kr_axpy_rows does row by row.
int kr_test_attend_values(int impl, int32_t type, const void *values, int64_t row_stride, int64_t n_rows, int64_t n,
                          const float *weights, int64_t n_queries, const int32_t *begin, const int32_t *end, float *out,
                          kr_error *err);
// kr_attend_scores: key rows (KR_F32 or KR_F16) as above, queries (n_queries, n) f32, out
// (n_queries, n_rows): out[i][p] = dot(key p, query i) for p < end[i] (0 <= end[i] <= n_rows), in
// kr_dot's order; out[i][p] for end[i] <= p < n_rows may be written too.
int kr_test_attend_scores(int impl, int32_t type, const void *keys, int64_t row_stride, int64_t n_rows, int64_t n,
                          const float *queries, int64_t n_queries, const int32_t *end, float *out, kr_error *err);
// kr_attention_softmax on n values in place: x = softmax(scale * x), or with softcap > 0
// softmax(softcap * tanh(scale * x / softcap)).
int kr_test_attention_softmax(int impl, float *x, int64_t n, float scale, float softcap, kr_error *err);
// --- end Attention kernel (tests)

#ifdef __cplusplus
}
#endif
#endif
