"""Tokenizer speed: encode about 1 MB of mixed text (and two one-pre-token worst cases), report MB/s.

    python bench/tokenizer.py [TOKENIZER.mlt ...]

With no argument it uses llama.cpp's vocabulary test files (converted once, see
tests/support/testdata.py) and the pulled SmolLM2 tokenizer. Encoding should be linear in the
text: a megabyte in well under a second, whatever the text looks like.
"""

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from krafla_twisted.engine.tokenizer import Tokenizer  # noqa: E402

SAMPLES = [
    "The quick brown fox jumps over the lazy dog. ", "It's 2024, isn't it? ", "    return x * 2\n",
    "def f(a, b):\n\t", "1234567890 ", "Äpfel und Birnen — ", "нещо на Български ", "我想在apple工作 ",
    "🦙🚀 😶‍🌫️ ", "\n\n", "   ", "<|im_start|>user\n", "e\u0301 ", "ส่วน ", "'re 'LL ",
]


def mixed_text(size, seed=0):
    rng = random.Random(seed)
    parts, total = [], 0
    while total < size:
        part = rng.choice(SAMPLES)
        parts.append(part)
        total += len(part.encode())
    return "".join(parts)


def bench(tok, name, text, repeat=3):
    data = text.encode()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        ids = tok.encode(data, add_bos=False)
        best = min(best, time.perf_counter() - start)
    print(f"{name:>40}  {len(data) / 1e6:5.2f} MB  {len(ids):8d} tokens  {best * 1e3:8.1f} ms  "
          f"{len(data) / 1e6 / best:7.2f} MB/s")


def default_tokenizers():
    from tests.support import real_models, testdata
    paths = [(f"vocab {name}", testdata.vocab_mlt(name)) for name in testdata.VOCABS]
    paths.append(("smollm2-135m", real_models.real_model("smollm2-135m").mlt))
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizers", nargs="*", help=".mlt files (default: the test vocabularies and SmolLM2)")
    parser.add_argument("--size", type=int, default=1 << 20, help="bytes of text (default 1 MiB)")
    args = parser.parse_args(argv)
    paths = [(Path(p).name, p) for p in args.tokenizers] or default_tokenizers()
    text = mixed_text(args.size)
    for label, path in paths:
        tok = Tokenizer(path)
        print(f"{label} ({tok.kind}, pre {tok.pre})")
        bench(tok, "mixed text", text)
        bench(tok, "one letter (one giant pre-token)", "a" * args.size)
        bench(tok, "one space run", " " * args.size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
