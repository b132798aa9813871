// threads.h: the thread pool the engine's steps run on (threads.c). Internal to the library.
#ifndef KRAFLA_THREADS_H
#define KRAFLA_THREADS_H

#include "runtime/internal.h"

typedef struct kr_pool kr_pool;
// One chunk of a job: `chunk` of `n_chunks`, run by thread `thread` (0 = the caller), which
// indexes per-thread scratch. A chunk's results must not depend on which thread runs it.
typedef void (*kr_pool_fn)(void *job, int chunk, int n_chunks, int thread);

kr_pool *kr_pool_new(int n_threads, kr_error *err);
// Run fn on every chunk in [0, n_chunks) (at most 65535), on whichever threads claim them first;
// returns when all are finished.
void kr_pool_run(kr_pool *pool, kr_pool_fn fn, void *job, int n_chunks);
// A run of a job's units [begin, end), by thread `thread`; as a chunk's, its results must not
// depend on the thread or on how the units are cut into runs.
typedef void (*kr_pool_range_fn)(void *job, int64_t begin, int64_t end, int thread);
// Run fn over the units [0, units) of a job that streams its data from memory (one token's
// matmuls): each thread takes runs from the front of its own contiguous share, so it reads one
// stream, then halves of the largest shares left. Returns when all are finished.
void kr_pool_run_shares(kr_pool *pool, kr_pool_range_fn fn, void *job, int64_t units);
// Run fn over the units [0, units) of a batch's matmuls, bound by arithmetic: in tapered parts
// (kr_split_tapered, kr_pool_tapered_chunks) that threads claim as kr_pool_run's chunks.
void kr_pool_run_tapered(kr_pool *pool, kr_pool_range_fn fn, void *job, int64_t units);
int kr_pool_size(const kr_pool *pool);
// How many chunks to cut `items` units of work into: 1 on one thread, else a few per thread.
int kr_pool_chunks(const kr_pool *pool, int64_t items);
void kr_pool_free(kr_pool *pool);

// [begin, end) of `total` items for one part of n_parts; boundaries are multiples of `align`.
void kr_split(int64_t total, int64_t align, int part, int n_parts, int64_t *begin, int64_t *end);

// Chunks for a job whose work is memory reads of `items` equal units (a matmul's row tiles of
// several tokens, a mixture's expert rows), split with kr_split_tapered: 1 on one thread, else 8
// per thread, or 4 when the job is one token's (`streaming`: a mixture's experts; one token's dense
// matmuls go by kr_pool_run_shares). A one-token matmul streams its rows from memory, and each part
// starts a stream of its own (kernels.h, KR_STREAM_AHEAD); with 4 parts per thread instead of 8,
// two threads generated 5.4% faster on Qwen2.5-Coder-1.5B Q4_K_M when this machine's memory gave
// them 65 GB/s, 2.3% when it gave 37, and 3.1% on a qwen3moe (bench/ab_generate.c; 2 per thread
// measured alike, 16 lost 6%). Prompts keep 8: they are bound by arithmetic.
int kr_pool_tapered_chunks(const kr_pool *pool, int64_t items, bool streaming);
// As kr_split, but the parts shrink as the job goes: part p of n starts at the fraction
// p(2n - p)/n^2 of the blocks, so the first part is 2/n of the work and the last 1/n^2. Threads
// claim parts in order, so the big ones go first and the last few, claimed while the other
// threads finish theirs, are small: a thread waits at the job's end for at most a small part.
void kr_split_tapered(int64_t total, int64_t align, int part, int n_parts, int64_t *begin, int64_t *end);

#endif
