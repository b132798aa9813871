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

struct kr_pool {
    int n_threads;
    pthread_t *threads;
    worker *workers;
    int n_started;
    _Atomic(kr_pool_fn) fn;   // the current job, valid while its chunks are unfinished
    _Atomic(void *) job;
    atomic_uint_least64_t state;  // generation << 32 | n_chunks << 16 | next chunk
    atomic_int finished;      // chunks of the current job finished
    atomic_int sleeping;      // workers asleep on `wake`
    atomic_int stopping;
    pthread_mutex_t mutex;
    pthread_cond_t wake;
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
        run_chunks(pool, state, self->index);
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
        if (!pool->threads || !pool->workers) {
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
