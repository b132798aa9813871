"""Generation with a JSON schema against the same generation without: issue 16 asks for at least
0.9x the speed. Both runs use the same model, prompt, seed and number of tokens; the constrained
run's grammar is a JSON string that must be longer than --tokens tokens can spell (minLength), so
both replies run to exactly --tokens tokens and only the per-token mask cost differs. (A list of
free strings let the model answer `[]`: two tokens, timed against the plain run's 128.)

    .venv/bin/python bench/grammar.py                      # SmolLM2 from the cache, 2 threads
    .venv/bin/python bench/grammar.py --model smollm2-135m --tokens 128 --rounds 3 --threads 2

Prints tokens per second of each run and their ratio, and the mean mask time per token.
"""

import argparse
import statistics
import time

from krafla_twisted.cli import models, startup
from krafla_twisted.generation import generate, grammar


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    pulled = models.pull(args.model)
    runtime = startup.load_runtime({"model": str(pulled.mlb), "tokenizer": str(pulled.mlt),
                                    "chat": pulled.chat, "threads": args.threads})
    generator = generate.Generator(runtime)
    prompt = runtime.template.render([{"role": "user", "content": "List many animals."}], runtime.tokenizer)
    schema = {"type": "string", "minLength": 64 * args.tokens}  # no token spells 64 characters
    started = time.perf_counter()
    vocabulary = grammar.Vocabulary.of(runtime.tokenizer, runtime.stop_token_ids)
    print(f"vocabulary for llguidance: {time.perf_counter() - started:.2f} s (once per tokenizer)")
    sampling = generate.SamplingParams(temperature=0.8, seed=7)
    plain, constrained, mask_ms = [], [], []
    for _ in range(args.rounds):
        runtime.reset()
        result = generator.generate(prompt, max_tokens=args.tokens, sampling=sampling)
        plain.append(rate(result, args.tokens, "plain"))
        runtime.reset()
        constraint = grammar.Constraint(vocabulary, grammar.json_schema_grammar(schema))
        timed = TimedConstraint(constraint)
        result = generator.generate(prompt, max_tokens=args.tokens, sampling=sampling, constraint=timed)
        constrained.append(rate(result, args.tokens, "constrained"))
        mask_ms.append(1000 * timed.seconds / max(1, timed.calls))
    without, with_schema = statistics.median(plain), statistics.median(constrained)
    print(f"without a schema: {without:.1f} tok/s; with: {with_schema:.1f} tok/s; ratio {with_schema / without:.3f}; "
          f"mask {statistics.median(mask_ms):.3f} ms per token")
    runtime.close()


def rate(result, tokens, label):
    """Reply tokens per second; both runs must reach `tokens` tokens or they are not comparable."""
    if result.completion_tokens != tokens:
        raise SystemExit(f"the {label} reply has {result.completion_tokens} tokens, not {tokens} "
                         f"({result.finish_reason}): the runs would not be comparable")
    return result.completion_tokens / result.generation_seconds


class TimedConstraint:
    """A Constraint that adds up the time its mask and accept calls take."""

    def __init__(self, constraint):
        self.constraint = constraint
        self.seconds = 0.0
        self.calls = 0

    @property
    def done(self):
        return self.constraint.done

    def mask(self, logits):
        started = time.perf_counter()
        out = self.constraint.mask(logits)
        self.seconds += time.perf_counter() - started
        self.calls += 1
        return out

    def accept(self, token):
        started = time.perf_counter()
        self.constraint.accept(token)
        self.seconds += time.perf_counter() - started


if __name__ == "__main__":
    main()
