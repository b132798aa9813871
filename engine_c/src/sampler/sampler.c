// sampler.c: choosing the next token from a row of logits.
//
// Order of operations (one call of kr_sampler_sample):
//   1. repeat penalty over the distinct ids among the last repeat_last_n tokens of the history
//      (llama.cpp's rule: a positive logit is divided by the penalty, a negative one multiplied);
//   2. temperature 0, top_k 1 or top_p 0: greedy, the highest logit, ties to the lowest id;
//   3. otherwise softmax of logits / temperature, then top-k, then top-p over what top-k kept
//      (renormalised), then one draw from a xoshiro256** stream seeded by splitmix64. Tokens rank
//      by probability, ties to the lower id; the kept ones are found by selection (expected
//      linear time), and the draw walks them in the order selection left them.
// Everything here is sequential and single-threaded, so the chosen token depends only on the
// logits, the history, the parameters and how many draws came before: never on thread count or
// batch size. Exactly one random number is drawn per non-greedy call.
#include "kernels/kernels.h"
#include "runtime/internal.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    double weight;
    int32_t id;
} kr_candidate;

struct kr_sampler {
    kr_sampler_params params;
    int32_t n_vocab;
    uint64_t rng[4];      // xoshiro256** state, never all zero
    float *logits;        // (n_vocab,) penalised copy of the caller's logits, when a penalty applies
    double *weights;      // (n_vocab,) exp((logit - max) / temperature)
    kr_candidate *candidates;  // (n_vocab,) tokens under consideration (kept ones first)
    uint8_t *seen;        // (n_vocab,) marks ids already penalised in this call
    int32_t *counts;      // (n_vocab,) occurrences in the window (frequency penalty only; else NULL)
};

// ---------------------------------------------------------------------------------------------
// RNG: splitmix64 expands the seed, xoshiro256** (Blackman & Vigna) produces the stream.

static uint64_t splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

static uint64_t xoshiro_next(uint64_t s[4]) {
    uint64_t result = rotl(s[1] * 5, 7) * 9;
    uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return result;
}

static void seed_rng(uint64_t s[4], uint64_t seed) {
    uint64_t state = seed;
    for (int i = 0; i < 4; i++) s[i] = splitmix64(&state);
    if (!(s[0] | s[1] | s[2] | s[3])) s[0] = 1;  // splitmix64 never yields this, but be sure
}

// A double uniform in [0, 1) from the top 53 bits.
static double next_uniform(uint64_t s[4]) { return (double)(xoshiro_next(s) >> 11) * 0x1.0p-53; }

// ---------------------------------------------------------------------------------------------
// Parameters

static int check_params(const kr_sampler_params *p, kr_error *err) {
    if (!p) return kr_fail(err, KR_ERR_ARGUMENT, "sampler parameters are NULL");
    if (!isfinite(p->temperature) || p->temperature < 0.0f)
        return kr_fail(err, KR_ERR_ARGUMENT, "temperature must be a finite number >= 0, got %g", (double)p->temperature);
    if (!(p->top_p >= 0.0f && p->top_p <= 1.0f))
        return kr_fail(err, KR_ERR_ARGUMENT, "top_p must be between 0 and 1, got %g", (double)p->top_p);
    if (p->top_k < 0) return kr_fail(err, KR_ERR_ARGUMENT, "top_k must be >= 0 (0 = off), got %d", p->top_k);
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return kr_fail(err, KR_ERR_ARGUMENT, "min_p must be between 0 and 1 (0 = off), got %g", (double)p->min_p);
    if (!isfinite(p->repeat_penalty) || p->repeat_penalty <= 0.0f)
        return kr_fail(err, KR_ERR_ARGUMENT, "repeat_penalty must be a finite number > 0 (1 = off), got %g",
                       (double)p->repeat_penalty);
    if (!isfinite(p->frequency_penalty) || !isfinite(p->presence_penalty))
        return kr_fail(err, KR_ERR_ARGUMENT, "frequency_penalty and presence_penalty must be finite numbers, got %g and %g",
                       (double)p->frequency_penalty, (double)p->presence_penalty);
    if (p->repeat_last_n < -1)
        return kr_fail(err, KR_ERR_ARGUMENT, "repeat_last_n must be >= 0, or -1 for the whole history, got %d",
                       p->repeat_last_n);
    return KR_OK;
}

kr_sampler *kr_sampler_new(const kr_sampler_params *params, int32_t n_vocab, kr_error *err) {
    if (check_params(params, err) != KR_OK) return NULL;
    if (n_vocab <= 0) {
        kr_fail(err, KR_ERR_ARGUMENT, "sampler vocabulary size must be > 0, got %d", n_vocab);
        return NULL;
    }
    kr_sampler *s = calloc(1, sizeof *s);
    if (!s) {
        kr_fail(err, KR_ERR_MEMORY, "out of memory for a sampler");
        return NULL;
    }
    s->params = *params;
    s->n_vocab = n_vocab;
    s->logits = malloc((size_t)n_vocab * sizeof *s->logits);
    s->weights = malloc((size_t)n_vocab * sizeof *s->weights);
    s->candidates = malloc((size_t)n_vocab * sizeof *s->candidates);
    s->seen = calloc((size_t)n_vocab, 1);
    s->counts = params->frequency_penalty != 0.0f ? calloc((size_t)n_vocab, sizeof *s->counts) : NULL;
    if (!s->logits || !s->weights || !s->candidates || !s->seen || (params->frequency_penalty != 0.0f && !s->counts)) {
        kr_sampler_free(s);
        kr_fail(err, KR_ERR_MEMORY, "out of memory for a sampler over %d tokens", n_vocab);
        return NULL;
    }
    seed_rng(s->rng, params->seed);
    kr_ok(err);
    return s;
}

void kr_sampler_free(kr_sampler *sampler) {
    if (!sampler) return;
    free(sampler->logits);
    free(sampler->weights);
    free(sampler->candidates);
    free(sampler->seen);
    free(sampler->counts);
    free(sampler);
}

// ---------------------------------------------------------------------------------------------
// Sampling

// Whether the penalties change anything for this history.
static bool penalises(const kr_sampler_params *p, int32_t n_history) {
    bool any = p->repeat_penalty != 1.0f || p->frequency_penalty != 0.0f || p->presence_penalty != 0.0f;
    return any && p->repeat_last_n != 0 && n_history > 0;
}

// Penalise each distinct id among the last `window` history tokens once (when penalises()): the
// repeat penalty, then count * frequency_penalty + presence_penalty subtracted (llama.cpp's order).
static void apply_penalties(kr_sampler *s, const int32_t *history, int32_t n_history) {
    const kr_sampler_params *p = &s->params;
    int32_t window = p->repeat_last_n;
    int32_t start = (window < 0 || window >= n_history) ? 0 : n_history - window;
    if (s->counts)
        for (int32_t i = start; i < n_history; i++) s->counts[history[i]]++;
    for (int32_t i = start; i < n_history; i++) {
        int32_t id = history[i];
        if (s->seen[id]) continue;
        s->seen[id] = 1;
        float x = s->logits[id];
        if (x == -INFINITY) continue;  // a masked token stays masked
        float y = x > 0.0f ? x / p->repeat_penalty : x * p->repeat_penalty;
        float count = s->counts ? (float)s->counts[id] : 1.0f;
        y -= count * p->frequency_penalty + p->presence_penalty;
        // Saturate: a penalty must neither make +inf (NaN weights) nor mask a token with -inf.
        if (isinf(y)) y = y > 0.0f ? FLT_MAX : -FLT_MAX;
        s->logits[id] = y;
    }
    for (int32_t i = start; i < n_history; i++) {
        s->seen[history[i]] = 0;
        if (s->counts) s->counts[history[i]] = 0;
    }
}

// The order tokens are ranked in: higher weight first, ties to the lower id (a total order).
static inline bool better(kr_candidate a, kr_candidate b) {
    return a.weight > b.weight || (a.weight == b.weight && a.id < b.id);
}

static inline void swap(kr_candidate *a, kr_candidate *b) {
    kr_candidate t = *a;
    *a = *b;
    *b = t;
}

// Partition c[lo..hi) (hi - lo >= 1) around a median-of-three pivot: afterwards c[lo..p) rank
// above the pivot, c[p] is the pivot, c[p+1..hi) rank below. Returns p; *mass_above gets the
// summed weight of c[lo..p).
static int32_t partition(kr_candidate *c, int32_t lo, int32_t hi, double *mass_above) {
    int32_t mid = lo + (hi - lo) / 2, last = hi - 1;
    int32_t pick = mid;
    if (better(c[lo], c[mid]) != better(c[lo], c[last])) pick = lo;
    else if (better(c[last], c[mid]) != better(c[last], c[lo])) pick = last;
    swap(&c[pick], &c[last]);
    kr_candidate pivot = c[last];
    int32_t p = lo;
    double mass = 0.0;
    for (int32_t j = lo; j < last; j++) {
        if (better(c[j], pivot)) {
            mass += c[j].weight;
            swap(&c[p++], &c[j]);
        }
    }
    swap(&c[p], &c[last]);
    *mass_above = mass;
    return p;
}

static int compare_best_first(const void *a, const void *b) {
    kr_candidate x = *(const kr_candidate *)a, y = *(const kr_candidate *)b;
    return better(x, y) ? -1 : better(y, x) ? 1 : 0;
}

// Quickselect rounds before falling back to sorting what is left, so that even logits built to
// defeat the median-of-three pivot cost O(n log n), not O(n^2).
#ifndef MAX_SELECT_ROUNDS
#define MAX_SELECT_ROUNDS 64
#endif

// Move the best k of c[0..n) to the front (in no particular order). Expected O(n).
static void select_best_count(kr_candidate *c, int32_t n, int32_t k) {
    int32_t lo = 0, hi = n;
    for (int round = 0; hi - lo > 1; round++) {
        if (round == MAX_SELECT_ROUNDS) {
            qsort(c + lo, (size_t)(hi - lo), sizeof *c, compare_best_first);
            return;
        }
        double unused;
        int32_t p = partition(c, lo, hi, &unused);
        if (p == k || p + 1 == k) return;
        if (p > k) hi = p;
        else lo = p + 1;
    }
}

// Move to the front the shortest best-first prefix of c[0..n) whose weight reaches `goal`, in
// no particular order, and return its length. Expected O(n): no full sort.
static int32_t select_best_mass(kr_candidate *c, int32_t n, double goal) {
    int32_t lo = 0, hi = n;
    double need = goal > 0.0 ? goal : DBL_MIN;  // a goal that underflowed still keeps the best token
    for (int round = 0; lo < hi; round++) {
        if (round == MAX_SELECT_ROUNDS) {
            qsort(c + lo, (size_t)(hi - lo), sizeof *c, compare_best_first);
            for (int32_t k = lo; k < hi; k++) {
                need -= c[k].weight;
                if (need <= 0.0) return k + 1;
            }
            return hi;
        }
        double above;
        int32_t p = partition(c, lo, hi, &above);
        if (above >= need) {
            hi = p;  // the prefix ends among the tokens above the pivot
            continue;
        }
        if (above + c[p].weight >= need) return p + 1;
        need -= above + c[p].weight;
        lo = p + 1;
    }
    return hi;
}

// Pick one of candidates[0..n) with probability weight / mass.
static int32_t draw(kr_sampler *s, const kr_candidate *candidates, int32_t n, double mass) {
    double target = next_uniform(s->rng) * mass;
    double cumulative = 0.0;
    int32_t last_positive = candidates[0].id;
    for (int32_t k = 0; k < n; k++) {
        if (candidates[k].weight <= 0.0) continue;
        cumulative += candidates[k].weight;
        last_positive = candidates[k].id;
        if (target < cumulative) return candidates[k].id;
    }
    return last_positive;  // rounding left target at the very top
}

// The index of the best logit, or -1 with err naming the first NaN or +inf (all -inf: `when_none`
// says what cannot be done). One pass checks the row and finds its best token (kernels: a scan of
// 150k logits one comparison chain at a time took a millisecond); the offending value is named
// only on failure.
static int64_t checked_argmax(const float *logits, int32_t n, const char *when_none, kr_error *err) {
    int64_t best = kr_argmax_f32(logits, n);
    if (best >= 0) return best;
    for (int32_t i = 0; i < n; i++)
        if (isnan(logits[i]) || logits[i] == INFINITY) {
            kr_fail(err, KR_ERR_ARGUMENT, "logit of token %d is %s", i, isnan(logits[i]) ? "NaN" : "+inf");
            return -1;
        }
    kr_fail(err, KR_ERR_ARGUMENT, "every logit is -inf: %s", when_none);
    return -1;
}

int kr_sampler_sample(kr_sampler *s, const float *logits, int32_t n_logits, const int32_t *history,
                      int32_t n_history, int32_t *token_out, kr_error *err) {
    if (!s || !logits || !token_out) return kr_fail(err, KR_ERR_ARGUMENT, "sampler, logits and output must not be NULL");
    if (n_logits != s->n_vocab)
        return kr_fail(err, KR_ERR_ARGUMENT, "got %d logits for a sampler over %d tokens", n_logits, s->n_vocab);
    if (n_history < 0 || (n_history > 0 && !history))
        return kr_fail(err, KR_ERR_ARGUMENT, "bad history: %d tokens", n_history);
    for (int32_t i = 0; i < n_history; i++)
        if (history[i] < 0 || history[i] >= s->n_vocab)
            return kr_fail(err, KR_ERR_ARGUMENT, "history token %d at position %d is outside the vocabulary (0..%d)",
                           history[i], i, s->n_vocab - 1);
    const int32_t n = s->n_vocab;
    int64_t best = checked_argmax(logits, n, "no token can be chosen", err);
    if (best < 0) return KR_ERR_ARGUMENT;

    // The penalty works on a copy; it saturates, so the row stays valid and the scan finds a token.
    const kr_sampler_params *p = &s->params;
    const float *row = logits;
    if (penalises(p, n_history)) {
        memcpy(s->logits, logits, (size_t)n * sizeof *s->logits);
        apply_penalties(s, history, n_history);
        row = s->logits;
        best = kr_argmax_f32(row, n);
    }
    if (p->temperature == 0.0f || p->top_k == 1 || p->top_p == 0.0f) {
        *token_out = (int32_t)best;
        kr_ok(err);
        return KR_OK;
    }

    // Weights relative to the best token (which gets exactly 1), summed in id order.
    const double inverse_temperature = 1.0 / (double)p->temperature;
    const float max_logit = row[best];
    double total = 0.0;
    for (int32_t i = 0; i < n; i++) {
        double w = row[i] == -INFINITY ? 0.0 : exp(((double)row[i] - (double)max_logit) * inverse_temperature);
        s->weights[i] = w;
        total += w;
    }

    const int32_t top_k = (p->top_k > 0 && p->top_k < n) ? p->top_k : 0;
    const bool use_top_p = p->top_p < 1.0f;
    const bool use_min_p = p->min_p > 0.0f;
    if (!top_k && !use_top_p && !use_min_p) {
        for (int32_t i = 0; i < n; i++) s->candidates[i] = (kr_candidate){s->weights[i], i};
        *token_out = draw(s, s->candidates, n, total);
        kr_ok(err);
        return KR_OK;
    }

    // Selection instead of sorting: with Gemma's 262144 tokens a full sort per token would cost
    // more than a small model's forward pass.
    int32_t n_candidates = 0;
    for (int32_t i = 0; i < n; i++)
        if (s->weights[i] > 0.0) s->candidates[n_candidates++] = (kr_candidate){s->weights[i], i};
    if (top_k && n_candidates > top_k) {
        select_best_count(s->candidates, n_candidates, top_k);
        n_candidates = top_k;
    }
    double kept = 0.0;
    for (int32_t k = 0; k < n_candidates; k++) kept += s->candidates[k].weight;
    if (use_top_p) {
        n_candidates = select_best_mass(s->candidates, n_candidates, (double)p->top_p * kept);
        kept = 0.0;
        for (int32_t k = 0; k < n_candidates; k++) kept += s->candidates[k].weight;
    }
    if (use_min_p) {
        // Weights are relative to the best token (1), so min-p is a threshold on the weight itself;
        // the best token always stays. Compacting keeps the candidates' order (the draw walks it).
        const double floor = (double)p->min_p;
        int32_t kept_count = 0;
        kept = 0.0;
        for (int32_t k = 0; k < n_candidates; k++) {
            if (s->candidates[k].weight < floor) continue;
            s->candidates[kept_count++] = s->candidates[k];
            kept += s->candidates[k].weight;
        }
        n_candidates = kept_count;
    }
    *token_out = draw(s, s->candidates, n_candidates, kept);
    kr_ok(err);
    return KR_OK;
}

int kr_sampler_reseed(kr_sampler *sampler, uint64_t seed, kr_error *err) {
    if (!sampler) return kr_fail(err, KR_ERR_ARGUMENT, "sampler is NULL");
    seed_rng(sampler->rng, seed);
    kr_ok(err);
    return KR_OK;
}

// ---------------------------------------------------------------------------------------------
// Log probabilities and grammar masks: the rest of what a reply does with a row of logits, so
// the server handles rows as plain buffers.

// Keep best[0..*kept) (at most `top`) the best of the tokens offered so far, best first.
static void offer(kr_candidate *best, int32_t *kept, int32_t top, kr_candidate c) {
    int32_t k = *kept;
    if (k == top) {
        if (!better(c, best[k - 1])) return;
        k--;
    }
    while (k > 0 && better(c, best[k - 1])) {
        best[k] = best[k - 1];
        k--;
    }
    best[k] = c;
    if (*kept < top) (*kept)++;
}

// Past this many alternatives, sorting every token beats inserting into the kept list.
#define LOGPROBS_INSERT_MAX 64

int kr_logprobs(const float *logits, int32_t n, int32_t token, int32_t top, int32_t *top_ids, double *top_logprobs,
                double *token_logprob, kr_error *err) {
    if (!logits || !token_logprob || (top > 0 && (!top_ids || !top_logprobs)))
        return kr_fail(err, KR_ERR_ARGUMENT, "logits and outputs must not be NULL");
    if (n <= 0) return kr_fail(err, KR_ERR_ARGUMENT, "no logits (n = %d)", n);
    if (token < 0 || token >= n)
        return kr_fail(err, KR_ERR_ARGUMENT, "token %d is outside the vocabulary (0..%d)", token, n - 1);
    if (top < 0 || top > n) return kr_fail(err, KR_ERR_ARGUMENT, "top %d is outside 0..%d", top, n);
    int64_t peak_index = checked_argmax(logits, n, "there are no probabilities", err);
    if (peak_index < 0) return KR_ERR_ARGUMENT;
    const double peak = (double)logits[peak_index];
    double total = 0.0;
    for (int32_t i = 0; i < n; i++) total += exp((double)logits[i] - peak);
    const double logsum = peak + log(total);
    *token_logprob = (double)logits[token] - logsum;
    if (top == 0) {
        kr_ok(err);
        return KR_OK;
    }
    kr_candidate few[LOGPROBS_INSERT_MAX];  // the API asks for at most 20: no allocation per token
    kr_candidate *best = few;
    if (top <= LOGPROBS_INSERT_MAX) {
        int32_t kept = 0;
        for (int32_t i = 0; i < n; i++) offer(best, &kept, top, (kr_candidate){logits[i], i});
    } else {
        best = malloc((size_t)n * sizeof *best);
        if (!best) return kr_fail(err, KR_ERR_MEMORY, "out of memory for %d alternatives", top);
        for (int32_t i = 0; i < n; i++) best[i] = (kr_candidate){logits[i], i};
        qsort(best, (size_t)n, sizeof *best, compare_best_first);
    }
    for (int32_t k = 0; k < top; k++) {
        top_ids[k] = best[k].id;
        top_logprobs[k] = best[k].weight - logsum;
    }
    if (best != few) free(best);
    kr_ok(err);
    return KR_OK;
}

int kr_logits_mask(float *logits, int32_t n, const uint32_t *allowed, kr_error *err) {
    if (!logits || !allowed) return kr_fail(err, KR_ERR_ARGUMENT, "logits and mask must not be NULL");
    if (n < 0) return kr_fail(err, KR_ERR_ARGUMENT, "bad number of logits %d", n);
    for (int32_t i = 0; i < n; i++)
        if (!(allowed[i >> 5] >> (i & 31) & 1u)) logits[i] = -INFINITY;
    kr_ok(err);
    return KR_OK;
}
