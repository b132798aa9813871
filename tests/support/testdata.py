"""llama.cpp's tokenizer test vectors: vocabulary-only GGUFs with .inp/.out pairs, in
tests/data/vocab (tests/data/README.md gives their source and licence).

Converted .mlt files are cached beside the GGUF cache, keyed by the GGUF's content and the
tokenizer converter's fingerprint (models.converter_fingerprints), so only the first run on a
machine pays gguf-py's slow parse of a 280000-merge vocabulary: not every clone or worktree again.
"""

import functools
import pathlib

import gguf

from krafla_twisted.cli import models
from krafla_twisted.convert import tokenizer as convert_tokenizer
from krafla_twisted.engine import formats

VOCABS = ("gpt-2", "llama-bpe", "qwen2", "qwen35", "llama-spm", "phi-3")
SEPARATOR = "\n__ggml_vocab_test__\n"
REPO = pathlib.Path(__file__).resolve().parents[2]
VOCAB_DIR = REPO / "tests" / "data" / "vocab"


def vocab_gguf(name):
    return VOCAB_DIR / f"ggml-vocab-{name}.gguf"


def vocab_cases(name):
    """(text, expected ids without BOS) for every input of the vector file."""
    base = vocab_gguf(name)
    texts = base.with_name(base.name + ".inp").read_text(encoding="utf-8").split(SEPARATOR)
    lines = base.with_name(base.name + ".out").read_text(encoding="utf-8").split("\n")
    if texts and texts[-1] == "":
        texts = texts[:-1]
    if len(lines) < len(texts):
        raise RuntimeError(f"{base}: {len(texts)} inputs but {len(lines)} expected lines")
    return [(text, [int(x) for x in line.split()]) for text, line in zip(texts, lines)]


@functools.lru_cache(maxsize=None)
def _content_digest(path):
    return models.sha256_of(path)[:12]


def converted_mlt(gguf_path, label):
    """The .mlt of a GGUF's vocabulary, converted once per GGUF content and converter version."""
    gguf_path = pathlib.Path(gguf_path).resolve()
    key = f"{_content_digest(gguf_path)}-{models.converter_fingerprints()['tokenizer']}"
    out = models.krafla_home() / "testdata" / "mlt" / f"{label}-{key}.mlt"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        formats.write(out, convert_tokenizer.container_from_gguf(gguf.GGUFReader(gguf_path)))
    return out


def vocab_mlt(name):
    return converted_mlt(vocab_gguf(name), f"vocab-{name}")
