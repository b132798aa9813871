"""`krafla perplexity MODEL.mlb -z TOK.mlt -f TEXT [--ctx 512] [--chunks N]`: what a type costs.

Computed as llama.cpp's `llama-perplexity` computes it, so the two can be set side by side:

- the whole text is tokenized once (BOS first where the tokenizer adds one, never EOS) and cut
  into chunks of `ctx` tokens; the text must give at least two chunks, and `--chunks` takes the
  first N of them;
- each chunk is evaluated from an empty cache, its first token replaced by BOS where the
  tokenizer adds one;
- only the second half is scored: the logits at positions ctx/2 .. ctx-2 each predict the next
  token of the chunk, so every scored token has at least ctx/2 tokens before it;
- with nll_i = -log softmax(logits_i)[next token] over all scored tokens so far, the running
  estimate after each chunk is exp(mean nll), and the final one is printed with its error
  exp(mean) * sqrt(var(nll) / (count - 1)).

The first half of a chunk is evaluated without logits and the second half through
`Session.eval_all` in pieces small enough that a piece's logits stay under LOGITS_BUDGET floats
(the engine's logits do not depend on how the positions are grouped, so neither does the result).
"""

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np

from krafla_twisted.cli import options
from krafla_twisted.engine import clib

LOGITS_BUDGET = 1 << 24  # floats of logits per eval_all call (64 MiB)
MIN_CTX = 8


class PerplexityError(ValueError):
    """The text, the context or another argument does not allow a measurement."""


def negative_log_likelihoods(logits, targets):
    """-log p(target) for each row of logits (rows, n_vocab), as llama-perplexity's log_softmax:
    the maximum subtracted in float32, the exponentials summed in float64."""
    logits = np.asarray(logits, np.float32)
    shifted = logits - logits.max(axis=1, keepdims=True)
    sums = np.exp(shifted).sum(axis=1, dtype=np.float64)
    chosen = shifted[np.arange(len(targets)), targets].astype(np.float64)
    return np.log(sums) - chosen


@dataclass
class Result:
    """The estimate after the chunks so far: exp of the mean nll, and its error."""
    ctx: int
    n_chunks: int = 0                 # chunks scored
    count: int = 0                    # tokens scored
    nll_sum: float = 0.0
    nll_square_sum: float = 0.0
    running: list = field(default_factory=list)  # the estimate after each chunk

    @property
    def perplexity(self):
        return math.exp(self.nll_sum / self.count)

    @property
    def error(self):
        """The ± of the final estimate (llama-perplexity's), or nan with fewer than 2 tokens."""
        if self.count < 2:
            return math.nan
        mean = self.nll_sum / self.count
        variance = self.nll_square_sum / self.count - mean * mean
        return math.sqrt(variance / (self.count - 1)) * self.perplexity if variance > 0 else math.nan

    def add(self, nll):
        self.nll_sum += float(nll.sum())
        self.nll_square_sum += float(np.square(nll).sum())
        self.count += len(nll)


def chunks_of(tokens, ctx, n_chunks=None):
    """How many chunks of ctx tokens the text gives (at most n_chunks); PerplexityError when it
    is shorter than two chunks, as llama-perplexity refuses it."""
    if ctx < MIN_CTX:
        raise PerplexityError(f"--ctx must be at least {MIN_CTX}, not {ctx}")
    if len(tokens) < 2 * ctx:
        raise PerplexityError(f"the text gives {len(tokens)} tokens; a context of {ctx} needs at least {2 * ctx}")
    available = len(tokens) // ctx
    return available if n_chunks is None else min(n_chunks, available)


def measure(model, tokens, *, ctx, n_chunks=None, batch=None, kv="f32", bos_id=None, on_chunk=None):
    """Perplexity of `model` on `tokens` (the whole text's ids) in chunks of ctx. bos_id (or None)
    replaces the first token of each chunk. on_chunk(result, seconds) is called after each chunk.
    Returns the Result."""
    tokens = np.asarray(tokens, np.int32)
    total = chunks_of(tokens, ctx, n_chunks)
    first = ctx // 2
    rows_per_call = max(1, min(batch or ctx, LOGITS_BUDGET // model.n_vocab))
    result = Result(ctx=ctx)
    with model.session(ctx=ctx, kv=kv, batch=batch or ctx) as session:
        for index in range(total):
            started = time.perf_counter()
            chunk = tokens[index * ctx:(index + 1) * ctx].copy()
            if bos_id is not None:
                chunk[0] = bos_id
            session.truncate(0)
            session.eval(chunk[:first], logits=False)
            # positions first .. ctx-2 predict tokens first+1 .. ctx-1; the last token is never run
            nll = []
            for begin in range(first, ctx - 1, rows_per_call):
                end = min(begin + rows_per_call, ctx - 1)
                nll.append(negative_log_likelihoods(session.eval_all(chunk[begin:end]), chunk[begin + 1:end + 1]))
            result.add(np.concatenate(nll))  # one sum per chunk, however the rows were fetched
            result.n_chunks += 1
            result.running.append(result.perplexity)
            if on_chunk:
                on_chunk(result, time.perf_counter() - started)
    return result


def add_arguments(parser):
    parser.add_argument("model", metavar="MODEL.mlb", help="the model to measure")
    parser.add_argument("-z", "--tokenizer", required=True, metavar="TOK.mlt", help="the model's tokenizer")
    parser.add_argument("-f", "--file", required=True, metavar="TEXT", help="the text (UTF-8)")
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default 512, as llama-perplexity -c)")
    parser.add_argument("--chunks", type=int, default=None, help="score the first N chunks only (default all)")
    parser.add_argument("-t", "--threads", type=int, default=None, help="threads (default: the cores)")
    parser.add_argument("--batch", type=int, default=None, help="tokens per forward step (default: --ctx)")
    parser.add_argument("--kv", choices=options.KV_TYPES, default="f32", help="KV cache type (default f32)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")


class Progress:
    """`[3/8] 12.3456  1.52 s/chunk` on stderr after each chunk: one rewritten line with a bar on a
    terminal, one line per chunk elsewhere (a log)."""

    WIDTH = 24

    def __init__(self, stream, total):
        self.stream = stream
        self.total = total
        self.terminal = _is_terminal(stream)

    def __call__(self, result, seconds):
        done = result.n_chunks
        line = f"[{done}/{self.total}] perplexity {result.perplexity:.4f}, {seconds:.2f} s/chunk"
        if self.terminal:
            filled = self.WIDTH * done // self.total
            bar = "#" * filled + "." * (self.WIDTH - filled)
            self.stream.write(f"\r{bar} {line}" + ("\n" if done == self.total else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _is_terminal(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError, OSError):
        return False


def main(args, stdout=None, stderr=None):
    from krafla_twisted.engine.model import Model
    from krafla_twisted.engine.tokenizer import Tokenizer

    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr

    def fail(message, status=1):
        print(f"krafla perplexity: {message}", file=stderr)
        return status

    for name, value in (("--threads", args.threads), ("--batch", args.batch), ("--chunks", args.chunks)):
        if value is not None and value < 1:
            return fail(f"{name} must be at least 1, not {value}", 2)
    if args.ctx < MIN_CTX:
        return fail(f"--ctx must be at least {MIN_CTX}, not {args.ctx}", 2)
    for path in (args.model, args.tokenizer, args.file):
        if not os.path.isfile(path):
            return fail(f"{path}: no such file")
    try:
        with open(args.file, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        return fail(f"{args.file}: not UTF-8 text ({e.reason} at byte {e.start})")
    except OSError as e:
        return fail(f"{args.file}: {e.strerror}")
    try:
        with Tokenizer(args.tokenizer) as tokenizer:
            tokens = tokenizer.encode(text, add_eos=False)
            bos_id = tokenizer.bos_id if tokenizer.add_bos else None
        with Model(args.model, threads=args.threads or options.default_threads()) as model:
            if args.ctx > model.max_seq:
                return fail(f"--ctx {args.ctx} is past the model's context length {model.max_seq}", 2)
            total = chunks_of(tokens, args.ctx, args.chunks)
            print(f"# {model.name} ({model.weight_type}, isa {clib.loaded_isa()}, {model.threads} "
                  f"threads): {len(tokens)} tokens, {total} chunks of {args.ctx}, the last {args.ctx - args.ctx // 2 - 1} "
                  f"tokens of each scored", file=stderr)
            result = measure(model, tokens, ctx=args.ctx, n_chunks=args.chunks, batch=args.batch, kv=args.kv,
                             bos_id=bos_id, on_chunk=Progress(stderr, total))
            name = model.name
    except (PerplexityError, clib.KraflaError) as e:
        return fail(e)
    except KeyboardInterrupt:
        print("\nkrafla perplexity: interrupted", file=stderr)
        return 130
    if args.json:
        print(json.dumps({"model": name, "path": args.model, "ctx": args.ctx, "chunks": result.n_chunks,
                          "tokens_scored": result.count, "perplexity": result.perplexity, "error": result.error,
                          "running": result.running}), file=stdout)
    else:
        print(f"Final estimate: PPL = {result.perplexity:.4f} +/- {result.error:.5f}", file=stdout)
    return 0
