"""Engine throughput per CPU-second of one thread: a measure a busy machine disturbs little.

    KRAFLA_LIB=build/avx2/libkrafla.so .venv/bin/python bench/cputime.py MODEL.mlb [--no-pack] [-p 256] [-n 32]

Wall-clock tokens/s on a shared machine mostly measure the other processes. With one thread, the
process's user CPU time counts only the time the engine ran (memory stalls included, waiting for
a core excluded), so tokens per CPU-second compare two builds or options (packing, KV type) fairly
even under load; run the variants alternately a few times. It is not a wall-clock speed: with -t 2
on an idle machine expect up to twice these figures.
"""

import argparse
import resource

import numpy as np

from krafla_twisted.engine.model import Model


def cpu_seconds():
    return resource.getrusage(resource.RUSAGE_SELF).ru_utime


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("-p", "--prompt", type=int, default=256)
    parser.add_argument("-n", "--generate", type=int, default=32)
    parser.add_argument("-r", "--repetitions", type=int, default=2)
    parser.add_argument("--kv", default="f32")
    parser.add_argument("--no-pack", action="store_true")
    args = parser.parse_args()
    with Model(args.model, threads=1, pack=not args.no_pack) as model:
        tokens = [int(t) for t in np.random.default_rng(1).integers(0, model.n_vocab, args.prompt + args.generate)]
        with model.session(ctx=args.prompt + args.generate, kv=args.kv, batch=args.prompt) as session:
            session.eval(tokens[:32])  # warm-up
            prompt = []
            for _ in range(args.repetitions):
                session.truncate(0)
                start = cpu_seconds()
                session.eval(tokens[:args.prompt])
                prompt.append(cpu_seconds() - start)
            generation = []
            for _ in range(args.repetitions):
                session.truncate(args.prompt)
                start = cpu_seconds()
                for token in tokens[args.prompt:]:
                    session.eval([token])
                generation.append(cpu_seconds() - start)
    print(f"{model.name}: pp{args.prompt} {args.prompt / min(prompt):.1f}, tg{args.generate} "
          f"{args.generate / min(generation):.1f} tokens per CPU-second (one thread, "
          f"{'file layout' if args.no_pack else 'packed'}, kv {args.kv}, best of {args.repetitions})")


if __name__ == "__main__":
    main()
