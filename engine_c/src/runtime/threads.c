// threads.c: a persistent pool of N threads (the caller plus N - 1 workers) that share the
// chunks of one job at a time.
//
// A job is cut into n_chunks chunks that threads claim one by one from a shared counter, so a
// worker the OS has not scheduled yet simply claims nothing: the caller does its chunks and the
// step goes on, instead of waiting a whole time slice at every barrier when the machine is busy.
// Which thread computes a chunk never changes the result (each chunk's values depend only on its
// inputs), so this keeps the engine's bitwise reproducibility.
//
// `state` packs (generation:32 | n_chunks:16 | next chunk:16) in one atomic word, so a claim (a
// compare-and-swap) only succeeds for a chunk of the job the claimer read `fn` and `job` for: a
// job's descriptor is only rewritten after all its chunks were claimed and finished.
//
// A streaming job (kr_pool_run_shares) is cut differently: each thread owns a contiguous share of
// its units and takes runs from the front of its own share, so its runs read one stream of weights
// front to back; a thread whose share is done takes the back half of the largest share left. Each
// share is one atomic word (generation:32 | begin:16 | end:16) on a cache line of its own, so a
// claim only succeeds on a share of the job the claimer read `range_fn` and `range_job` for, as
// above. Such a job is published with n_chunks 0, which no chunk job has. A batch's range job
// (kr_pool_run_tapered) is a chunk job whose chunks are its tapered parts.
//
// Idle workers spin on the generation for a while (with `pause`, yielding the core now and then),
// then sleep on a condition variable. Sleeping is race-free because both sides use sequentially
// consistent atomics: a worker counts itself in `sleeping` under the mutex before it re-checks
// the generation, and the caller bumps the generation before it reads `sleeping`.
#include "runtime/threads.h"

#include <pthread.h>
#include <stdatomic.h>
#include <sched.h>
#include <stdlib.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

#define SPIN_ROUNDS (1 << 13)
#define YIELD_EVERY 256
#define MAX_CHUNKS 0xFFFF

typedef struct {
    kr_pool *pool;
    int index;
} worker;

#define MAX_SHARE_UNITS 0xFFFF
typedef struct {
    _Alignas(64) atomic_uint_least64_t word;  // generation << 32 | begin << 16 | end
} share_word;

struct kr_pool {
    int n_threads;
    pthread_t *threads;
    worker *workers;
    int n_started;
    _Atomic(kr_pool_fn) fn;   // the current job, valid while its chunks are unfinished
    _Atomic(void *) job;
    atomic_uint_least64_t state;  // generation << 32 | n_chunks << 16 | next chunk
    atomic_int_least64_t finished;  // chunks of the current job finished (units of a job of shares)
    atomic_int sleeping;      // workers asleep on `wake`
    atomic_int stopping;
    pthread_mutex_t mutex;
    pthread_cond_t wake;
    // a job of runs (kr_pool_run_shares, kr_pool_run_tapered): its function and units, each
    // thread's share
    _Atomic(kr_pool_range_fn) range_fn;
    _Atomic(void *) range_job;
    _Atomic(int64_t) units;
    share_word *shares;
};

static inline void spin_round(int round) {
    if (round % YIELD_EVERY == YIELD_EVERY - 1) sched_yield();
    else cpu_relax();
}

static inline uint32_t generation_of(uint64_t state) { return (uint32_t)(state >> 32); }

// Claim and run chunks of the job published as `seen` state until none is left.
static void run_chunks(kr_pool *pool, uint64_t seen, int thread) {
    kr_pool_fn fn = pool->fn;
    void *job = pool->job;
    uint64_t state = seen;
    for (;;) {
        uint32_t n_chunks = (uint32_t)(state >> 16) & MAX_CHUNKS, next = (uint32_t)state & MAX_CHUNKS;
        if (generation_of(state) != generation_of(seen) || next >= n_chunks) return;
        if (!atomic_compare_exchange_weak(&pool->state, &state, state + 1)) continue;
        fn(job, (int)next, (int)n_chunks, thread);
        atomic_fetch_add(&pool->finished, 1);
    }
}

static uint64_t share_pack(uint32_t generation, uint64_t begin, uint64_t end) {
    return (uint64_t)generation << 32 | begin << 16 | end;
}
static uint64_t share_begin(uint64_t word) { return (word >> 16) & MAX_SHARE_UNITS; }
static uint64_t share_end(uint64_t word) { return word & MAX_SHARE_UNITS; }
// Each share unit is this many of a job's units (more than one in a job of more than 65535).
static int64_t share_scale(int64_t units) { return (units + MAX_SHARE_UNITS - 1) / MAX_SHARE_UNITS; }

// Run the share units [begin, end) on thread `thread`.
static void run_units(kr_pool *pool, kr_pool_range_fn fn, void *job, int64_t units, uint64_t begin, uint64_t end,
                      int thread) {
    const int64_t scale = share_scale(units), first = (int64_t)begin * scale;
    const int64_t last = (int64_t)end * scale < units ? (int64_t)end * scale : units;
    fn(job, first, last, thread);
    atomic_fetch_add(&pool->finished, last - first);
}

// Take runs of the job of generation `generation` until no share has units left: first from the
// front of thread `thread`'s own share, then the back half of the largest share left. An owner takes
// 7/8 of what is left of its share at a time (at least one unit), so another thread finds some to
// take if it finished early or this one started late. Each run is a call of its own, and a call
// costs its stream something even where it continues the last (Qwen2.5-Coder-1.5B, two threads:
// 1.044x the tapered chunks' generation taking 7/8, 1.041x a half, 1.026x a quarter).
static void run_shares(kr_pool *pool, uint32_t generation, int thread) {
    kr_pool_range_fn fn = pool->range_fn;
    void *job = pool->range_job;
    int64_t units = pool->units;
    atomic_uint_least64_t *own = &pool->shares[thread].word;
    for (uint64_t word = atomic_load(own);;) {
        uint64_t begin = share_begin(word), end = share_end(word);
        if (generation_of(word) != generation || begin >= end) break;
        uint64_t take = end - begin - (end - begin) / 8;
        if (!atomic_compare_exchange_weak(own, &word, share_pack(generation, begin + take, end))) continue;
        run_units(pool, fn, job, units, begin, begin + take, thread);
        word = atomic_load(own);
    }
    for (;;) {
        int victim = -1;
        uint64_t most = 0, word = 0;
        for (int t = 0; t < pool->n_threads; t++) {
            uint64_t w = atomic_load(&pool->shares[t].word), left = share_end(w) - share_begin(w);
            if (generation_of(w) == generation && share_end(w) > share_begin(w) && left > most) victim = t, most = left, word = w;
        }
        if (victim < 0) return;
        uint64_t begin = share_begin(word), end = share_end(word), take = (end - begin + 1) / 2;
        if (atomic_compare_exchange_strong(&pool->shares[victim].word, &word, share_pack(generation, begin, end - take)))
            run_units(pool, fn, job, units, end - take, end, thread);
    }
}

static uint64_t wait_for_job(kr_pool *pool, uint32_t seen_generation) {
    for (int i = 0; i < SPIN_ROUNDS; i++) {
        uint64_t now = atomic_load(&pool->state);
        if (generation_of(now) != seen_generation) return now;
        spin_round(i);
    }
    pthread_mutex_lock(&pool->mutex);
    atomic_fetch_add(&pool->sleeping, 1);
    uint64_t now;
    while (generation_of(now = atomic_load(&pool->state)) == seen_generation) pthread_cond_wait(&pool->wake, &pool->mutex);
    atomic_fetch_sub(&pool->sleeping, 1);
    pthread_mutex_unlock(&pool->mutex);
    return now;
}

static void *worker_main(void *arg) {
    worker *self = arg;
    kr_pool *pool = self->pool;
    uint32_t seen = 0;
    for (;;) {
        uint64_t state = wait_for_job(pool, seen);
        seen = generation_of(state);
        if (atomic_load(&pool->stopping)) return NULL;
        if (((state >> 16) & MAX_CHUNKS) == 0) run_shares(pool, seen, self->index);
        else run_chunks(pool, state, self->index);
    }
}

static void publish(kr_pool *pool, uint64_t state) {
    atomic_store(&pool->state, state);
    if (atomic_load(&pool->sleeping) > 0) {
        pthread_mutex_lock(&pool->mutex);
        pthread_cond_broadcast(&pool->wake);
        pthread_mutex_unlock(&pool->mutex);
    }
}

kr_pool *kr_pool_new(int n_threads, kr_error *err) {
    kr_pool *pool = calloc(1, sizeof *pool);
    if (!pool || n_threads < 1) {
        free(pool);
        kr_fail(err, n_threads < 1 ? KR_ERR_ARGUMENT : KR_ERR_MEMORY, "cannot create a pool of %d threads", n_threads);
        return NULL;
    }
    pool->n_threads = n_threads;
    atomic_init(&pool->state, 0);
    atomic_init(&pool->finished, 0);
    atomic_init(&pool->sleeping, 0);
    atomic_init(&pool->stopping, 0);
    pthread_mutex_init(&pool->mutex, NULL);
    pthread_cond_init(&pool->wake, NULL);
    if (n_threads > 1) {
        pool->threads = calloc((size_t)n_threads - 1, sizeof *pool->threads);
        pool->workers = calloc((size_t)n_threads - 1, sizeof *pool->workers);
        pool->shares = aligned_alloc(_Alignof(share_word), (size_t)n_threads * sizeof *pool->shares);
        if (pool->shares)
            for (int i = 0; i < n_threads; i++) atomic_init(&pool->shares[i].word, 0);
        if (!pool->threads || !pool->workers || !pool->shares) {
            kr_pool_free(pool);
            kr_fail(err, KR_ERR_MEMORY, "out of memory creating %d threads", n_threads);
            return NULL;
        }
        for (int i = 0; i < n_threads - 1; i++) {
            pool->workers[i] = (worker){pool, i + 1};
            if (pthread_create(&pool->threads[i], NULL, worker_main, &pool->workers[i])) {
                kr_pool_free(pool);
                kr_fail(err, KR_ERR_MEMORY, "cannot start thread %d of %d", i + 2, n_threads);
                return NULL;
            }
            pool->n_started++;
        }
    }
    return pool;
}

void kr_pool_run(kr_pool *pool, kr_pool_fn fn, void *job, int n_chunks) {
    if (n_chunks < 1) return;
    if (n_chunks > MAX_CHUNKS) n_chunks = MAX_CHUNKS;
    if (pool->n_threads == 1 || n_chunks == 1) {
        for (int chunk = 0; chunk < n_chunks; chunk++) fn(job, chunk, n_chunks, 0);
        return;
    }
    pool->fn = fn;
    pool->job = job;
    atomic_store(&pool->finished, 0);
    uint64_t generation = generation_of(atomic_load(&pool->state)) + 1u;
    uint64_t state = (generation & 0xFFFFFFFFu) << 32 | (uint64_t)n_chunks << 16;
    publish(pool, state);
    run_chunks(pool, state, 0);
    // Every chunk is claimed; wait for the ones other threads are still running.
    for (int i = 0; atomic_load(&pool->finished) < n_chunks; i++) spin_round(i);
}

// Publish the job's shares (thread t's is part t of n_threads, kr_split), take runs with the other
// threads, and wait until every unit is done: a run claimed from a share may still be running when
// the shares are empty.
void kr_pool_run_shares(kr_pool *pool, kr_pool_range_fn fn, void *job, int64_t units) {
    if (units < 1) return;
    if (pool->n_threads == 1 || units == 1) {
        fn(job, 0, units, 0);
        return;
    }
    const int64_t scale = share_scale(units), share_units = (units + scale - 1) / scale;
    const uint32_t generation = generation_of(atomic_load(&pool->state)) + 1u;
    pool->range_fn = fn;
    pool->range_job = job;
    pool->units = units;
    atomic_store(&pool->finished, 0);
    for (int t = 0; t < pool->n_threads; t++) {
        int64_t begin, end;
        kr_split(share_units, 1, t, pool->n_threads, &begin, &end);
        atomic_store(&pool->shares[t].word, share_pack(generation, (uint64_t)begin, (uint64_t)end));
    }
    publish(pool, (uint64_t)generation << 32);  // n_chunks 0: a job of shares
    run_shares(pool, generation, 0);
    for (int i = 0; atomic_load(&pool->finished) < units; i++) spin_round(i);
}

// A chunk of a tapered range job: its tapered part of the units.
static void tapered_chunk(void *arg, int chunk, int n_chunks, int thread) {
    kr_pool *pool = arg;
    int64_t begin, end;
    kr_split_tapered(pool->units, 1, chunk, n_chunks, &begin, &end);
    if (begin < end) pool->range_fn(pool->range_job, begin, end, thread);
}

void kr_pool_run_tapered(kr_pool *pool, kr_pool_range_fn fn, void *job, int64_t units) {
    if (units < 1) return;
    pool->range_fn = fn;
    pool->range_job = job;
    pool->units = units;
    kr_pool_run(pool, tapered_chunk, pool, kr_pool_tapered_chunks(pool, units, false));
}

int kr_pool_size(const kr_pool *pool) { return pool->n_threads; }

void kr_pool_free(kr_pool *pool) {
    if (!pool) return;
    if (pool->n_started) {
        atomic_store(&pool->stopping, 1);
        publish(pool, (uint64_t)(generation_of(atomic_load(&pool->state)) + 1u) << 32);
        for (int i = 0; i < pool->n_started; i++) pthread_join(pool->threads[i], NULL);
    }
    pthread_mutex_destroy(&pool->mutex);
    pthread_cond_destroy(&pool->wake);
    free(pool->threads);
    free(pool->workers);
    free(pool->shares);
    free(pool);
}

// 1 on one thread, else per_thread chunks per thread, at most one per item.
static int chunks_of(const kr_pool *pool, int64_t items, int64_t per_thread) {
    if (pool->n_threads == 1 || items <= 1) return 1;
    int64_t chunks = per_thread * (int64_t)pool->n_threads;
    return (int)(items < chunks ? items : chunks);
}

int kr_pool_chunks(const kr_pool *pool, int64_t items) { return chunks_of(pool, items, 4); }

void kr_split(int64_t total, int64_t align, int part, int n_parts, int64_t *begin, int64_t *end) {
    int64_t blocks = (total + align - 1) / align;
    int64_t per_part = blocks / n_parts, extra = blocks % n_parts;
    int64_t first = part * per_part + (part < extra ? part : extra);
    int64_t count = per_part + (part < extra ? 1 : 0);
    *begin = first * align < total ? first * align : total;
    *end = (first + count) * align < total ? (first + count) * align : total;
}

int kr_pool_tapered_chunks(const kr_pool *pool, int64_t items, bool streaming) {
    return chunks_of(pool, items, streaming ? 4 : 8);
}

// The first block of part p of n: blocks * p(2n - p) / n^2, rounded down (0 at p = 0, blocks at
// p = n, increasing in p).
static int64_t tapered_first(int64_t blocks, int64_t part, int64_t n_parts) {
    return blocks * (part * (2 * n_parts - part)) / (n_parts * n_parts);
}

void kr_split_tapered(int64_t total, int64_t align, int part, int n_parts, int64_t *begin, int64_t *end) {
    int64_t blocks = (total + align - 1) / align;
    int64_t first = tapered_first(blocks, part, n_parts), last = tapered_first(blocks, part + 1, n_parts);
    *begin = first * align < total ? first * align : total;
    *end = last * align < total ? last * align : total;
}
