"""Embedding throughput of an encoder: texts per second and tokens per second through
kr_session_embed, as the server runs it (generation.embeddings.EmbeddingRuntime).

    .venv/bin/python bench/embeddings.py [MODEL.mlb TOKENIZER.mlt] [-t THREADS] [-r RUNS]

Without files, all-MiniLM-L6-v2 is pulled (`krafla pull all-minilm-l6-v2`). Two loads: 64 short
texts (about 12 tokens each) in one request, and 8 long ones (256 tokens each); the median of the
runs after one warm-up, in wall time and per CPU second (all threads' CPU time). Speed lives
here, never in tests.
"""

import argparse
import statistics
import time

from krafla_twisted.generation.embeddings import EmbeddingRuntime

SHORT = "The quick brown fox jumps over the lazy dog near the river bank."


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="*", help="MODEL.mlb TOKENIZER.mlt (default: the pulled all-MiniLM-L6-v2)")
    parser.add_argument("-t", "--threads", type=int, default=2)
    parser.add_argument("-r", "--runs", type=int, default=5)
    args = parser.parse_args()
    if args.files:
        mlb, mlt = args.files
    else:
        from krafla_twisted.cli import models
        pulled = models.pull_embedder("all-minilm-l6-v2", progress=False)
        mlb, mlt = pulled.mlb, pulled.mlt
    runtime = EmbeddingRuntime.load(mlb, mlt, threads=args.threads)
    short = runtime.tokenize(SHORT)
    long_ids = (runtime.tokenize(SHORT * 30)[:255] + [short[-1]])
    loads = {"64 x %d tokens" % len(short): [short] * 64, "8 x %d tokens" % len(long_ids): [long_ids] * 8}
    print(f"{mlb}: threads {args.threads}, isa {runtime.isa}")
    for label, sequences in loads.items():
        runtime.embed(sequences)  # warm-up
        times, cpu = [], []
        for _ in range(args.runs):
            start, start_cpu = time.perf_counter(), time.process_time()
            runtime.embed(sequences)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - start_cpu)
        median, median_cpu = statistics.median(times), statistics.median(cpu)
        tokens = sum(len(s) for s in sequences)
        # CPU seconds too: on a shared machine the wall time says more about the others' load
        print(f"{label:>16}: {median * 1000:8.1f} ms  {len(sequences) / median:8.1f} texts/s  {tokens / median:9.0f} "
              f"tokens/s  ({tokens / median_cpu:9.0f} tokens per CPU second)")
    runtime.close()


if __name__ == "__main__":
    main()
