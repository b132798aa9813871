"""llama.cpp's tokenizer test vectors: vocabulary-only GGUFs with .inp/.out pairs.

They are read from ../shared/testdata/vocab (or $KRAFLA_TESTDATA/vocab). A machine without that
folder fetches the same files from the `llama-cpp-python` source distribution on the package
index (vendor/llama.cpp/models/), once, into $KRAFLA_HOME/testdata/vocab: never skipped.
Converted .mlt files are cached beside the GGUF cache, keyed by the GGUF and the converter's
source, so only the first run pays gguf-py's slow parse of a 280000-merge vocabulary.
"""

import hashlib
import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile

import gguf

from krafla_twisted import formats, models
from krafla_twisted.convert import tokenizer as convert_tokenizer

VOCABS = ("gpt-2", "llama-bpe", "qwen2", "qwen35", "llama-spm", "phi-3")
SEPARATOR = "\n__ggml_vocab_test__\n"
REPO = pathlib.Path(__file__).resolve().parents[2]


def _shared_vocab_dir():
    root = pathlib.Path(os.environ.get("KRAFLA_TESTDATA", REPO.parent / "shared" / "testdata"))
    return root / "vocab"


def vocab_dir():
    """A folder holding ggml-vocab-NAME.gguf(.inp/.out) for every name in VOCABS."""
    shared = _shared_vocab_dir()
    if all((shared / f"ggml-vocab-{name}.gguf.out").exists() for name in VOCABS):
        return shared
    fetched = models.krafla_home() / "testdata" / "vocab"
    if not all((fetched / f"ggml-vocab-{name}.gguf.out").exists() for name in VOCABS):
        _fetch_from_sdist(fetched)
    return fetched


def _fetch_from_sdist(dest):
    """Take the vocab files out of llama-cpp-python's source distribution."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        subprocess.check_call([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                               "--dest", tmp, "llama-cpp-python"])
        archive = next(pathlib.Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        wanted = {f"ggml-vocab-{name}.gguf{ext}" for name in VOCABS for ext in ("", ".inp", ".out")}
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                base = member.name.rsplit("/", 1)[-1]
                if base in wanted and "/vendor/llama.cpp/models/" in member.name:
                    data = tar.extractfile(member).read()
                    (dest / (base + ".part")).write_bytes(data)
                    (dest / (base + ".part")).replace(dest / base)
    missing = [name for name in VOCABS if not (dest / f"ggml-vocab-{name}.gguf.out").exists()]
    if missing:
        raise RuntimeError(f"llama-cpp-python's source distribution lacks the vocab files of {missing}")


def vocab_gguf(name):
    return vocab_dir() / f"ggml-vocab-{name}.gguf"


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


def _converter_digest():
    return hashlib.sha256(pathlib.Path(convert_tokenizer.__file__).read_bytes()).hexdigest()[:16]


def converted_mlt(gguf_path, label):
    """The .mlt of a GGUF's vocabulary, converted once per GGUF and converter version."""
    gguf_path = pathlib.Path(gguf_path)
    stat = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    out = models.krafla_home() / "testdata" / "mlt" / f"{label}-{key}-{_converter_digest()}.mlt"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        formats.write(out, convert_tokenizer.container_from_gguf(gguf.GGUFReader(gguf_path)))
    return out


def vocab_mlt(name):
    return converted_mlt(vocab_gguf(name), f"vocab-{name}")
