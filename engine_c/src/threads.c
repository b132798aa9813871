// threads.c: a persistent pool of N threads (the caller plus N - 1 workers).
//
// kr_pool_run publishes a job by bumping `generation`; workers spin on it for a short while and
// then sleep on a condition variable, so back-to-back jobs inside one token cost a few hundred
// nanoseconds while an idle pool costs nothing. The caller runs its own share as thread 0 and then
// waits (spin, then sleep) until `remaining` reaches zero. No thread is created after kr_pool_new.
//
// Sleeping is race-free because both sides use sequentially consistent atomics: a worker counts
// itself in `sleeping` under the mutex before it re-checks `generation`, and the caller bumps
// `generation` before it reads `sleeping`; the same pattern guards `caller_sleeping`.
#include "model.h"

#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

// Spin this many rounds before sleeping; every YIELD_EVERY rounds give the core away, so a pool
// with more threads than free cores does not starve the thread it waits for.
#define SPIN_ROUNDS (1 << 13)
#define YIELD_EVERY 256

static inline void spin_round(int round) {
    if (round % YIELD_EVERY == YIELD_EVERY - 1) sched_yield();
    else cpu_relax();
}

typedef struct {
    kr_pool *pool;
    int index;
} worker;

struct kr_pool {
    int n_threads;
    pthread_t *threads;
    worker *workers;
    int n_started;
    kr_pool_fn fn;
    void *job;
    atomic_uint generation;   // bumped once per job
    atomic_int remaining;     // workers still running the current job
    atomic_int sleeping;      // workers asleep on `wake`
    atomic_int caller_sleeping;
    atomic_int stopping;
    pthread_mutex_t mutex;
    pthread_cond_t wake;      // workers wait here for a new generation
    pthread_cond_t done;      // the caller waits here for remaining == 0
};

static unsigned wait_for_job(kr_pool *pool, unsigned seen) {
    for (int i = 0; i < SPIN_ROUNDS; i++) {
        unsigned now = atomic_load(&pool->generation);
        if (now != seen) return now;
        spin_round(i);
    }
    pthread_mutex_lock(&pool->mutex);
    atomic_fetch_add(&pool->sleeping, 1);
    unsigned now;
    while ((now = atomic_load(&pool->generation)) == seen) pthread_cond_wait(&pool->wake, &pool->mutex);
    atomic_fetch_sub(&pool->sleeping, 1);
    pthread_mutex_unlock(&pool->mutex);
    return now;
}

static void *worker_main(void *arg) {
    worker *self = arg;
    kr_pool *pool = self->pool;
    unsigned seen = 0;
    for (;;) {
        seen = wait_for_job(pool, seen);
        if (atomic_load(&pool->stopping)) return NULL;
        pool->fn(pool->job, self->index, pool->n_threads);
        if (atomic_fetch_sub(&pool->remaining, 1) == 1 && atomic_load(&pool->caller_sleeping)) {
            pthread_mutex_lock(&pool->mutex);
            pthread_cond_signal(&pool->done);
            pthread_mutex_unlock(&pool->mutex);
        }
    }
}

static void publish(kr_pool *pool) {
    atomic_fetch_add(&pool->generation, 1);
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
    atomic_init(&pool->generation, 0);
    atomic_init(&pool->remaining, 0);
    atomic_init(&pool->sleeping, 0);
    atomic_init(&pool->caller_sleeping, 0);
    atomic_init(&pool->stopping, 0);
    pthread_mutex_init(&pool->mutex, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->done, NULL);
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

void kr_pool_run(kr_pool *pool, kr_pool_fn fn, void *job) {
    if (pool->n_threads == 1) {
        fn(job, 0, 1);
        return;
    }
    pool->fn = fn;
    pool->job = job;
    atomic_store(&pool->remaining, pool->n_threads - 1);
    publish(pool);
    fn(job, 0, pool->n_threads);
    for (int i = 0; i < SPIN_ROUNDS; i++) {
        if (atomic_load(&pool->remaining) == 0) return;
        spin_round(i);
    }
    pthread_mutex_lock(&pool->mutex);
    atomic_store(&pool->caller_sleeping, 1);
    while (atomic_load(&pool->remaining) > 0) pthread_cond_wait(&pool->done, &pool->mutex);
    atomic_store(&pool->caller_sleeping, 0);
    pthread_mutex_unlock(&pool->mutex);
}

int kr_pool_size(const kr_pool *pool) { return pool->n_threads; }

void kr_pool_free(kr_pool *pool) {
    if (!pool) return;
    if (pool->n_started) {
        atomic_store(&pool->stopping, 1);
        publish(pool);
        for (int i = 0; i < pool->n_started; i++) pthread_join(pool->threads[i], NULL);
    }
    pthread_mutex_destroy(&pool->mutex);
    pthread_cond_destroy(&pool->wake);
    pthread_cond_destroy(&pool->done);
    free(pool->threads);
    free(pool->workers);
    free(pool);
}

void kr_split(int64_t total, int64_t align, int thread_index, int n_threads, int64_t *begin, int64_t *end) {
    int64_t chunks = (total + align - 1) / align;
    int64_t per_thread = chunks / n_threads, extra = chunks % n_threads;
    int64_t first = thread_index * per_thread + (thread_index < extra ? thread_index : extra);
    int64_t count = per_thread + (thread_index < extra ? 1 : 0);
    *begin = first * align < total ? first * align : total;
    *end = (first + count) * align < total ? (first + count) * align : total;
}
