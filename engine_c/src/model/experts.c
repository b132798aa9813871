// experts.c: the mixture-of-experts layer (experts.h): the router, the grouping of a step's tokens
// by expert, and the experts' matrix products over each group.
//
// A step of n tokens with n_used experts each has n * n_used slots (token t, rank r). The router
// job gives every token its experts and weights; the slots are then sorted by expert (a counting
// sort, tokens in batch order within an expert), so each expert's tokens are one run of rows:
//
//   gather   slot rows of the prepared xb, in sorted order                     (split by slots)
//   gate/up  per (expert, 64 rows): g = act(x Wg_e^T) * (x Wu_e^T) on its run  (split by items)
//            (biases added to each product first, when the layer has them)
//   prepare  g for the down matrices' type                                     (split by slots)
//   down     per (expert, 64 rows): o = g Wd_e^T on its run                    (split by items)
//   combine  proj_t = sum over r of weight_{t,r} * o_{t,r}, r = 0, 1, ...       (split by tokens)
//
// The matmul phases cut their items into tapered parts (threads.h, kr_split_tapered), and a part's
// items of one expert are one call over their rows, so the tiles fetch ahead across them (one
// token's step reads 64-row items, which alone would each start cold). In a one-token step, the
// rows of the call after each call (up's after gate's, the next expert's after the last) are
// fetched ahead too, so they do not start cold either.
//
// Each product is the kernels' value for one row alone (kernels.h: it does not depend on how many
// rows are multiplied together), and the combine follows the token's own rank order, so a token's
// result does not depend on the other tokens of the step, nor on the thread count.
#include "model/experts.h"

#include "kernels/kernels.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ITEM_ROWS 64      // rows of one expert per matmul item (a multiple of the kernels' 16-row tiles)

// --- Binding

static int bind_stack(kr_model *m, const char *path, const char *name, int32_t n_experts, int64_t rows, int64_t cols,
                      kr_matrix **out, kr_error *err) {
    kr_tensor_info t;
    int status = kr_file_find_tensor(m->file, name, &t, err);
    if (status) return status;
    if (!kr_kernel_type_supported(t.type))
        return kr_fail(err, KR_ERR_UNSUPPORTED, "%s: tensor %s has type %s, which the kernels do not take", path, name,
                       kr_type_name(t.type));
    if (t.n_dims != 3 || t.dims[0] != (uint64_t)n_experts || t.dims[1] != (uint64_t)rows || t.dims[2] != (uint64_t)cols)
        return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %s has %d dimensions (%llu, %llu, %llu...), expected (%d, %lld, %lld)",
                       path, name, t.n_dims, (unsigned long long)t.dims[0],
                       (unsigned long long)(t.n_dims > 1 ? t.dims[1] : 0),
                       (unsigned long long)(t.n_dims > 2 ? t.dims[2] : 0), n_experts, (long long)rows, (long long)cols);
    if (cols % kr_kernel_type_block(t.type))
        return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %s has rows of %lld, not a multiple of %s's block", path, name,
                       (long long)cols, kr_type_name(t.type));
    size_t row_bytes = kr_weight_row_bytes(t.type, cols), expert_bytes = row_bytes * (size_t)rows;
    if (expert_bytes * (size_t)n_experts != t.n_bytes)
        return kr_fail(err, KR_ERR_FORMAT, "%s: tensor %s holds %llu bytes, expected %zu", path, name,
                       (unsigned long long)t.n_bytes, expert_bytes * (size_t)n_experts);
    kr_matrix *experts = calloc((size_t)n_experts, sizeof *experts);
    if (!experts) return kr_fail(err, KR_ERR_MEMORY, "out of memory for tensor %s", name);
    for (int32_t e = 0; e < n_experts; e++)
        experts[e] = (kr_matrix){.type = t.type, .data = (const char *)t.data + (size_t)e * expert_bytes, .rows = rows,
                                 .cols = cols, .row_bytes = row_bytes};
    *out = experts;
    return KR_OK;
}

int kr_bind_experts(kr_model *m, const char *path, int32_t layer, int32_t n_experts, int32_t n_used, bool normalize,
                    kr_experts *out, kr_error *err) {
    const kr_model_info *h = &m->info;
    char name[96];
    int status;
    memset(out, 0, sizeof *out);
    out->n_experts = n_experts, out->n_used = n_used, out->normalize = normalize;
#define NAME(suffix) (snprintf(name, sizeof name, "blk.%d.%s", layer, suffix), name)
    if ((status = kr_bind_matrix(m, path, NAME("ffn_gate_inp.weight"), n_experts, h->dim, &out->router, err)) ||
        (status = bind_stack(m, path, NAME("ffn_gate_exps.weight"), n_experts, h->ffn_dim, h->dim, &out->gate, err)) ||
        (status = bind_stack(m, path, NAME("ffn_up_exps.weight"), n_experts, h->ffn_dim, h->dim, &out->up, err)) ||
        (status = bind_stack(m, path, NAME("ffn_down_exps.weight"), n_experts, h->dim, h->ffn_dim, &out->down, err)))
        return status;
#undef NAME
    return KR_OK;
}

int kr_bind_expert_biases(kr_model *m, const char *path, int32_t layer, kr_experts *e, kr_error *err) {
    const kr_model_info *h = &m->info;
    char name[96];
    int status;
#define NAME(suffix) (snprintf(name, sizeof name, "blk.%d.%s", layer, suffix), name)
    if ((status = kr_bind_f32(m, path, NAME("ffn_gate_inp.bias"), e->n_experts, 0, &e->router_bias, err)) ||
        (status = kr_bind_f32(m, path, NAME("ffn_gate_exps.bias"), e->n_experts, h->ffn_dim, &e->gate_bias, err)) ||
        (status = kr_bind_f32(m, path, NAME("ffn_up_exps.bias"), e->n_experts, h->ffn_dim, &e->up_bias, err)) ||
        (status = kr_bind_f32(m, path, NAME("ffn_down_exps.bias"), e->n_experts, h->dim, &e->down_bias, err)))
        return status;
#undef NAME
    return KR_OK;
}

// rows[t * width + r] += bias[r] for r in [begin, end) of n rows.
static void add_bias(float *rows, int64_t width, int32_t n, const float *bias, int64_t begin, int64_t end) {
    for (int32_t t = 0; t < n; t++)
        for (int64_t r = begin; r < end; r++) rows[(size_t)t * (size_t)width + (size_t)r] += bias[r];
}

void kr_experts_free(kr_experts *e) {
    free(e->gate), free(e->up), free(e->down);
    e->gate = e->up = e->down = NULL;
}

int kr_experts_matrices(kr_experts *e, kr_matrix **out) {
    int n = 0;
    if (out) out[n] = &e->router;
    n++;
    for (int32_t i = 0; i < e->n_experts; i++) {
        kr_matrix *three[] = {&e->gate[i], &e->up[i], &e->down[i]};
        for (int k = 0; k < 3; k++, n++)
            if (out) out[n] = three[k];
    }
    return n;
}

// --- Scratch

int kr_experts_scratch_new(kr_model *m, const kr_experts *const *layers, int32_t n_layers, int32_t n_batch,
                           kr_experts_scratch *x, kr_error *err) {
    const kr_model_info *h = &m->info;
    memset(x, 0, sizeof *x);
    bool input_type[KR_TYPE_COUNT] = {false}, hidden_type[KR_TYPE_COUNT] = {false}, failed = false;
    for (int32_t i = 0; i < n_layers; i++) {
        const kr_experts *e = layers[i];
        if (e->n_used > x->n_used) x->n_used = e->n_used;
        if (e->n_experts > x->n_experts) x->n_experts = e->n_experts;
        input_type[e->gate[0].type] = input_type[e->up[0].type] = true;
        hidden_type[e->down[0].type] = true;
    }
    size_t b = (size_t)n_batch, slots = b * (size_t)x->n_used, active = slots < (size_t)x->n_experts ? slots : (size_t)x->n_experts;
    int64_t widest = h->dim > h->ffn_dim ? h->dim : h->ffn_dim;
    x->n_batch = n_batch;
    x->max_items = (int64_t)active * ((widest + ITEM_ROWS - 1) / ITEM_ROWS);
    x->router_logits = kr_zalloc(b * (size_t)x->n_experts, sizeof(float), &failed);
    x->choice = kr_zalloc(slots, sizeof(int32_t), &failed);
    x->weight = kr_zalloc(slots, sizeof(float), &failed);
    x->first = kr_zalloc((size_t)x->n_experts + 1, sizeof(int32_t), &failed);
    x->slot_of = kr_zalloc(slots, sizeof(int32_t), &failed);
    x->position = kr_zalloc(slots, sizeof(int32_t), &failed);
    x->items = kr_zalloc(2 * (size_t)x->max_items, sizeof(int32_t), &failed);
    x->gate = kr_zalloc(slots * (size_t)h->ffn_dim, sizeof(float), &failed);
    x->up = kr_zalloc(slots * (size_t)h->ffn_dim, sizeof(float), &failed);
    x->out = kr_zalloc(slots * (size_t)h->dim, sizeof(float), &failed);
    for (int32_t t = 0; t < KR_TYPE_COUNT; t++) {
        if (input_type[t]) x->inputs[t] = kr_zalloc(kr_activation_bytes(t, (int64_t)slots, h->dim), 1, &failed);
        if (hidden_type[t])
            x->hidden_prepared[t] = kr_zalloc(kr_activation_bytes(t, (int64_t)slots, h->ffn_dim), 1, &failed);
    }
    if (failed) {
        kr_experts_scratch_free(x);
        return kr_fail(err, KR_ERR_MEMORY, "out of memory for the expert layers of a step of %d tokens", n_batch);
    }
    return KR_OK;
}

void kr_experts_scratch_free(kr_experts_scratch *x) {
    free(x->router_logits), free(x->choice), free(x->weight), free(x->first), free(x->slot_of), free(x->position);
    free(x->items), free(x->gate), free(x->up), free(x->out);
    for (int32_t t = 0; t < KR_TYPE_COUNT; t++) free(x->inputs[t]), free(x->hidden_prepared[t]);
    memset(x, 0, sizeof *x);
}

// --- The step

typedef struct {
    kr_model *m;
    kr_scratch *s;
    kr_experts_scratch *x;
    const kr_experts *e;
    int32_t n_tokens, n_slots;
    int64_t n_items;
} experts_job;

// A one-token step streams the experts' rows from memory: its matmul phases take fewer parts
// (threads.h) and fetch each call's successor ahead; a batch's are bound by arithmetic.
static bool streaming(const experts_job *j) { return j->n_tokens == 1; }

// Softmax over the router's logits, then the n_used most probable experts in rank order and their
// weights. Split by tokens.
static void route_job(void *arg, int chunk, int n_chunks, int thread) {
    experts_job *j = arg;
    kr_experts_scratch *x = j->x;
    const kr_experts *e = j->e;
    int64_t begin, end;
    kr_split(j->n_tokens, 1, chunk, n_chunks, &begin, &end);
    for (int64_t t = begin; t < end; t++) {
        float *p = x->router_logits + t * e->n_experts;
        float top = p[0];
        for (int32_t i = 1; i < e->n_experts; i++)
            if (p[i] > top) top = p[i];
        // speed: the exp kernel, the same bits in every build; its sum in its fixed lane order
        float sum = kr_exp_shift_sum_f32(p, e->n_experts, top);
        for (int32_t i = 0; i < e->n_experts; i++) p[i] /= sum;
        int32_t *choice = x->choice + t * e->n_used;
        float *weight = x->weight + t * e->n_used, chosen_sum = 0;
        for (int32_t r = 0; r < e->n_used; r++) {
            int32_t best = -1;
            for (int32_t i = 0; i < e->n_experts; i++) {
                bool taken = false;
                for (int32_t k = 0; k < r && !taken; k++) taken = choice[k] == i;
                if (!taken && (best < 0 || p[i] > p[best])) best = i;
            }
            choice[r] = best;
            weight[r] = p[best];
            chosen_sum += p[best];
        }
        if (e->normalize)
            for (int32_t r = 0; r < e->n_used; r++) weight[r] /= chosen_sum;
    }
}

// Slot rows of each type's prepared xb into sorted order. Split by sorted positions.
static void gather_job(void *arg, int chunk, int n_chunks, int thread) {
    experts_job *j = arg;
    kr_experts_scratch *x = j->x;
    const kr_experts *e = j->e;
    int64_t begin, end, dim = j->m->info.dim;
    kr_split(j->n_slots, 1, chunk, n_chunks, &begin, &end);
    int32_t types[2] = {e->gate[0].type, e->up[0].type};
    for (int k = 0; k < (types[1] == types[0] ? 1 : 2); k++) {
        size_t row = kr_activation_row_bytes(types[k], dim);
        const char *from = j->s->prepared[types[k]];
        char *to = x->inputs[types[k]];
        for (int64_t i = begin; i < end; i++)
            memcpy(to + (size_t)i * row, from + (size_t)(x->slot_of[i] / e->n_used) * row, row);
    }
}

// The items from `item` on (before end_item) that are one expert's: its rows [begin, end) of
// `rows`, multiplied in one call so the kernels fetch each tile's successor ahead across the items;
// returns the first item after them.
static int64_t expert_run(const kr_experts_scratch *x, int64_t item, int64_t end_item, int64_t rows, int32_t *expert,
                          int32_t *begin, int32_t *end) {
    *expert = x->items[2 * item];
    *begin = x->items[2 * item + 1];
    int64_t next = item + 1;
    while (next < end_item && x->items[2 * next] == *expert) next++;
    int64_t last = x->items[2 * (next - 1) + 1] + ITEM_ROWS;
    *end = (int32_t)(last < rows ? last : rows);
    return next;
}

// Fetch the first rows of the run that starts at `item` in `stack` (gate, up or down) ahead.
static void prefetch_run(const kr_experts_scratch *x, const kr_matrix *stack, int64_t item, int64_t rows) {
    int32_t begin = x->items[2 * item + 1];
    kr_matrix_prefetch(&stack[x->items[2 * item]], begin, begin + ITEM_ROWS < rows ? begin + ITEM_ROWS : rows);
}

// act(x Wg^T) * (x Wu^T) of 64 rows of one expert over its run of slots. Split by items.
static void gate_up_job(void *arg, int chunk, int n_chunks, int thread) {
    experts_job *j = arg;
    kr_experts_scratch *x = j->x;
    const kr_experts *e = j->e;
    int64_t first_item, end_item, ffn = j->m->info.ffn_dim, dim = j->m->info.dim;
    bool gelu = j->m->info.activation == KR_ACT_GELU_TANH;
    kr_split_tapered(j->n_items, 1, chunk, n_chunks, &first_item, &end_item);
    for (int64_t item = first_item, next; item < end_item; item = next) {
        int32_t expert, begin, end;
        next = expert_run(x, item, end_item, ffn, &expert, &begin, &end);
        int32_t slot = x->first[expert], n = x->first[expert + 1] - slot;
        const kr_matrix *g = &e->gate[expert], *u = &e->up[expert];
        float *gate = x->gate + (size_t)slot * (size_t)ffn, *up = x->up + (size_t)slot * (size_t)ffn;
        if (streaming(j)) kr_matrix_prefetch(u, begin, end);
        kr_matrix_matmul(g, (const char *)x->inputs[g->type] + (size_t)slot * kr_activation_row_bytes(g->type, dim), n,
                         gate, begin, end);
        if (streaming(j) && next < end_item) prefetch_run(x, e->gate, next, ffn);
        kr_matrix_matmul(u, (const char *)x->inputs[u->type] + (size_t)slot * kr_activation_row_bytes(u->type, dim), n,
                         up, begin, end);
        if (e->gate_bias) add_bias(gate, ffn, n, e->gate_bias + (size_t)expert * (size_t)ffn, begin, end);
        if (e->up_bias) add_bias(up, ffn, n, e->up_bias + (size_t)expert * (size_t)ffn, begin, end);
        for (int32_t t = 0; t < n; t++) {
            float *gt = gate + (size_t)t * (size_t)ffn + begin, *ut = up + (size_t)t * (size_t)ffn + begin;
            if (e->swiglu_limit > 0) kr_swiglu_oai_mul_f32(gt, ut, end - begin, e->swiglu_alpha, e->swiglu_limit);
            else if (gelu) kr_gelu_tanh_mul_f32(gt, ut, end - begin);
            else kr_silu_mul_f32(gt, ut, end - begin);
        }
    }
}

// The hidden rows prepared for the down matrices. Split by slots.
static void prepare_hidden_job(void *arg, int chunk, int n_chunks, int thread) {
    experts_job *j = arg;
    int32_t type = j->e->down[0].type;
    int64_t begin, end;
    kr_split(j->n_slots, 1, chunk, n_chunks, &begin, &end);
    if (begin < end)
        kr_prepare_activations(type, j->x->gate, j->m->info.ffn_dim, j->x->hidden_prepared[type], begin, end);
}

// x Wd^T of 64 rows of one expert over its run of slots. Split by items.
static void down_job(void *arg, int chunk, int n_chunks, int thread) {
    experts_job *j = arg;
    kr_experts_scratch *x = j->x;
    const kr_experts *e = j->e;
    int64_t first_item, end_item, ffn = j->m->info.ffn_dim, dim = j->m->info.dim;
    kr_split_tapered(j->n_items, 1, chunk, n_chunks, &first_item, &end_item);
    for (int64_t item = first_item, next; item < end_item; item = next) {
        int32_t expert, begin, end;
        next = expert_run(x, item, end_item, dim, &expert, &begin, &end);
        int32_t slot = x->first[expert], n = x->first[expert + 1] - slot;
        const kr_matrix *d = &e->down[expert];
        const char *hidden = (const char *)x->hidden_prepared[d->type] + (size_t)slot * kr_activation_row_bytes(d->type, ffn);
        if (streaming(j) && next < end_item) prefetch_run(x, e->down, next, dim);
        kr_matrix_matmul(d, hidden, n, x->out + (size_t)slot * (size_t)dim, begin, end);
        if (e->down_bias)
            add_bias(x->out + (size_t)slot * (size_t)dim, dim, n, e->down_bias + (size_t)expert * (size_t)dim, begin, end);
    }
}

// proj_t = the token's expert outputs weighed and added in rank order. Split by tokens.
static void combine_job(void *arg, int chunk, int n_chunks, int thread) {
    experts_job *j = arg;
    kr_experts_scratch *x = j->x;
    int32_t n_used = j->e->n_used;
    int64_t begin, end, dim = j->m->info.dim;
    kr_split(j->n_tokens, 1, chunk, n_chunks, &begin, &end);
    for (int64_t t = begin; t < end; t++) {
        float *proj = j->s->proj + t * dim;
        memset(proj, 0, (size_t)dim * sizeof(float));
        for (int32_t r = 0; r < n_used; r++) {
            int32_t at = x->position[t * n_used + r];
            kr_axpy_f32(x->weight[t * n_used + r], x->out + (size_t)at * (size_t)dim, proj, dim);
        }
    }
}

// The work items of a matmul phase: every expert with tokens, cut into ITEM_ROWS-row pieces.
static int64_t plan_items(kr_experts_scratch *x, const kr_experts *e, int64_t rows) {
    int64_t n = 0;
    for (int32_t expert = 0; expert < e->n_experts; expert++) {
        if (x->first[expert + 1] == x->first[expert]) continue;
        for (int64_t row = 0; row < rows; row += ITEM_ROWS, n++) {
            x->items[2 * n] = expert;
            x->items[2 * n + 1] = (int32_t)row;
        }
    }
    return n;
}

void kr_experts_block(kr_model *m, kr_scratch *s, kr_experts_scratch *x, const kr_batch *b, const kr_experts *e) {
    kr_pool *pool = m->pool;
    experts_job j = {.m = m, .s = s, .x = x, .e = e, .n_tokens = b->n, .n_slots = b->n * e->n_used};
    const kr_matrix *router[] = {&e->router};
    float *logits[] = {x->router_logits};
    const float *router_bias[] = {e->router_bias};
    kr_matmuls(m, s, b->n, NULL, m->info.dim, 1, router, logits, router_bias);
    kr_pool_run(pool, route_job, &j, kr_pool_chunks(pool, b->n));
    // Counting sort of the slots by expert; within an expert, in slot (token, rank) order.
    memset(x->first, 0, ((size_t)e->n_experts + 1) * sizeof(int32_t));
    for (int32_t i = 0; i < j.n_slots; i++) x->first[x->choice[i] + 1]++;
    for (int32_t expert = 0; expert < e->n_experts; expert++) x->first[expert + 1] += x->first[expert];
    for (int32_t i = 0; i < j.n_slots; i++) {
        int32_t at = x->first[x->choice[i]]++;
        x->slot_of[at] = i;
        x->position[i] = at;
    }
    for (int32_t expert = e->n_experts; expert > 0; expert--) x->first[expert] = x->first[expert - 1];
    x->first[0] = 0;
    kr_pool_run(pool, gather_job, &j, kr_pool_chunks(pool, j.n_slots));
    j.n_items = plan_items(x, e, m->info.ffn_dim);
    kr_pool_run(pool, gate_up_job, &j, kr_pool_tapered_chunks(pool, j.n_items, streaming(&j)));
    kr_pool_run(pool, prepare_hidden_job, &j, kr_pool_chunks(pool, j.n_slots));
    j.n_items = plan_items(x, e, m->info.dim);
    kr_pool_run(pool, down_job, &j, kr_pool_tapered_chunks(pool, j.n_items, streaming(&j)));
    kr_pool_run(pool, combine_job, &j, kr_pool_chunks(pool, b->n));
}
