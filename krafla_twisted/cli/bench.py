"""`krafla bench MODEL.mlb -t N -p 512 -n 128 [-d D] [-np S] [-r reps] [--json]`: prompt and generation speed.

Measured as llama-bench measures them: `ppP` evaluates P prompt tokens from an empty cache in
`--batch` sized steps; `tgN` generates N tokens one eval at a time from an empty cache. With
`-d D` both start from a cache of D tokens instead (llama-bench's `-d`, "tg128 @ d2048"): the D
tokens are evaluated once, untimed, and each run truncates the cache back to them. With
`-np S` (S > 1), `tgN` runs S sequences stepping together instead (Model.eval_batch, one token
of each per forward step, as the server batches concurrent replies; llama-batched-bench's S_TG)
and reports their aggregate tokens/s: S * N tokens over the time of the N steps. Tokens
are drawn at random from the vocabulary (speed does not depend on them), one warm-up run
precedes the timed repetitions, and the table gives the median tokens/s with the standard
deviation over the repetitions.
"""

import json
import os
import statistics
import sys
import time

import numpy as np

from krafla_twisted.engine import clib
from krafla_twisted.engine.model import Model


def add_arguments(parser):
    parser.add_argument("model", metavar="MODEL.mlb", help="the model to measure")
    parser.add_argument("-t", "--threads", type=int, default=1, help="threads (default 1)")
    parser.add_argument("-p", "--prompt", type=int, default=512, help="prompt tokens, 0 to skip (default 512)")
    parser.add_argument("-n", "--generate", type=int, default=128, help="generated tokens, 0 to skip (default 128)")
    parser.add_argument("-r", "--repetitions", type=int, default=5, help="timed runs of each test (default 5)")
    parser.add_argument("-b", "--batch", type=int, default=512, help="prompt tokens per forward step (default 512)")
    parser.add_argument("-d", "--depth", type=int, default=0,
                        help="tokens already in the cache when each test starts (default 0)")
    parser.add_argument("-np", "--parallel", type=int, default=1,
                        help="sequences generating together in each step, for tgN (default 1)")
    parser.add_argument("--kv", choices=("f32", "f16", "q8_0"), default="f32", help="KV cache type (default f32)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per test instead of a table")
    # speed: weight repacking (krafla_twisted/engine/pack.py)
    parser.add_argument("--no-pack", action="store_true", help="run on the file's weight layout (no repacking)")


def time_prompt(session, tokens, depth):
    session.truncate(depth)
    start = time.perf_counter()
    session.eval(tokens)
    return time.perf_counter() - start


def time_generation(session, tokens, depth):
    session.truncate(depth)
    start = time.perf_counter()
    for token in tokens:
        session.eval([token])
    return time.perf_counter() - start


def time_parallel_generation(model, sessions, tokens, depth):
    """N steps, each one token of every session (tokens: (N, sessions))."""
    for session in sessions:
        session.truncate(depth)
    outs = np.empty((len(sessions), model.n_vocab), np.float32)  # one array: one output-head matmul a step
    start = time.perf_counter()
    for step in tokens:
        model.eval_batch([(session, step[k:k + 1], "last", outs[k]) for k, session in enumerate(sessions)])
    return time.perf_counter() - start


def measure(model, kind, n_tokens, repetitions, batch, kv, parallel=1, depth=0):
    """Seconds of each timed repetition of one test (after one warm-up run), each starting from
    the first `depth` tokens of the cache (evaluated once, untimed, in `batch` sized steps)."""
    rng = np.random.default_rng(1234)
    context = rng.integers(0, model.n_vocab, size=depth).astype(np.int32)
    ctx = max(depth + n_tokens, 1)
    if kind == "tg" and parallel > 1:
        tokens = rng.integers(0, model.n_vocab, size=(n_tokens, parallel)).astype(np.int32)
        # A kr_batch_eval step is as wide as the scratch it borrows: batch=parallel lets one step hold
        # a token of every session (batch=1 ran them one token per step, with no batching at all).
        # (With a depth, `batch` wide too, so that the context goes in prompt-sized steps.)
        width = max(parallel, batch) if depth else parallel
        sessions = [model.session(ctx=ctx, kv=kv, batch=width) for _ in range(parallel)]
        try:
            for session in sessions:
                if depth:
                    session.eval(context, logits=False)
            time_parallel_generation(model, sessions, tokens, depth)
            return [time_parallel_generation(model, sessions, tokens, depth) for _ in range(repetitions)]
        finally:
            for session in sessions:
                session.close()
    tokens = rng.integers(0, model.n_vocab, size=n_tokens).astype(np.int32)
    with model.session(ctx=ctx, kv=kv, batch=batch) as session:
        if depth:
            session.eval(context, logits=False)
        run = time_prompt if kind == "pp" else time_generation
        if kind == "tg":
            tokens = [int(t) for t in tokens]
        run(session, tokens, depth)
        return [run(session, tokens, depth) for _ in range(repetitions)]


def summary(model, args, kind, n_tokens, seconds):
    parallel = args.parallel if kind == "tg" else 1
    rates = [parallel * n_tokens / s for s in seconds]
    return {
        "model": model.name,
        "path": model.path,
        "arch": model.arch,
        "type": model.weight_type,
        "size_bytes": model.n_bytes,
        "params": model.n_params,
        "isa": clib.load().kr_isa().decode(),
        "threads": args.threads,
        "batch": args.batch,
        "kv": args.kv,
        "parallel": parallel,
        "depth": args.depth,
        "test": f"{kind}{n_tokens}" + (f" np{parallel}" if parallel > 1 else "") + (f" @ d{args.depth}" if args.depth else ""),
        "n_tokens": n_tokens,
        "repetitions": len(seconds),
        "seconds": seconds,
        "tokens_per_second": rates,
        "median": statistics.median(rates),
        "stdev": statistics.stdev(rates) if len(rates) > 1 else 0.0,
    }


def print_table(rows, out):
    header = ["model", "size", "params", "backend", "threads", "test", "t/s"]
    lines = []
    for row in rows:
        lines.append([
            f"{row['model']} {row['type'].upper()}",
            f"{row['size_bytes'] / 2**20:.2f} MiB",
            f"{row['params'] / 1e6:.2f} M",
            f"CPU {row['isa']}",
            str(row["threads"]),
            row["test"],
            f"{row['median']:.2f} ± {row['stdev']:.2f}",
        ])
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    right = {1, 2, 4, 5, 6}

    def format_row(cells):
        return "| " + " | ".join(c.rjust(w) if i in right else c.ljust(w)
                                 for i, (c, w) in enumerate(zip(cells, widths))) + " |"

    print(format_row(header), file=out)
    print("| " + " | ".join(("-" * (w - 1) + ":") if i in right else "-" * w
                            for i, w in enumerate(widths)) + " |", file=out)
    for line in lines:
        print(format_row(line), file=out)
    print(f"(median ± standard deviation of {rows[0]['repetitions']} runs, batch {rows[0]['batch']}, "
          f"kv {rows[0]['kv']})" if rows else "", file=out)


def main(args):
    for name in ("threads", "repetitions", "batch", "parallel"):
        if getattr(args, name) < 1:
            print(f"krafla bench: --{name} must be at least 1", file=sys.stderr)
            return 2
    if args.prompt < 0 or args.generate < 0 or args.prompt + args.generate == 0:
        print("krafla bench: -p and -n must be >= 0, and not both 0", file=sys.stderr)
        return 2
    if not 0 <= args.depth <= 1 << 20:
        print("krafla bench: -d must be between 0 and 1048576", file=sys.stderr)
        return 2
    if not os.path.exists(args.model):
        print(f"krafla bench: {args.model}: no such file", file=sys.stderr)
        return 1
    try:
        model = Model(args.model, threads=args.threads, pack=not getattr(args, "no_pack", False))
    except clib.KraflaError as e:
        print(f"krafla bench: {e}", file=sys.stderr)
        return 1
    rows = []
    with model:
        for kind, n_tokens in (("pp", args.prompt), ("tg", args.generate)):
            if not n_tokens:
                continue
            if n_tokens > 1 << 20:
                print(f"krafla bench: {n_tokens} tokens is too many", file=sys.stderr)
                return 2
            try:
                seconds = measure(model, kind, n_tokens, args.repetitions, args.batch, args.kv, args.parallel,
                                  args.depth)
            except clib.KraflaError as e:
                print(f"krafla bench: {e}", file=sys.stderr)
                return 1
            rows.append(summary(model, args, kind, n_tokens, seconds))
            if args.json:
                print(json.dumps(rows[-1]), flush=True)
    if not args.json:
        print_table(rows, sys.stdout)
    return 0

