"""The .mlt from a Hugging Face tokenizer.json (krafla_twisted.convert.tokenizer_json).

For the byte-level BPE vocabularies of llama.cpp's test vectors, a tokenizer.json is written
from the GGUF (tests/support/hf_tokenizer_json.py; the reference environment checks with the
`tokenizers` library that these files encode the vectors), converted by krafla, and krafla's
tokenizer must then encode every vector input to exactly llama.cpp's ids, and pick the same
pre-tokenizer and special ids as the GGUF path. o200k (gpt-oss) has no vectors: a small vocabulary
that `tokenizers` trains with its split (tests/support/o200k_vocab.py) stands in, and
tests/test_tokenizer.py checks its ids against `tokenizers`.
"""

import gguf
import pytest

from krafla_twisted.convert.tokenizer import TokenizerConversionError, container_from_gguf
from krafla_twisted.convert.tokenizer_json import container_from_folder, tables_from_json
from krafla_twisted.engine import formats
from krafla_twisted.engine.tokenizer import Tokenizer
from tests.support import o200k_vocab
from tests.support.hf_tokenizer_json import write_hf_tokenizer
from tests.support.testdata import vocab_cases, vocab_gguf, vocab_mlt

VOCABS = ("qwen35", "llama-bpe", "gpt-2", "llama-spm")  # qwen2: the reference env checks its file


@pytest.fixture(scope="module", params=VOCABS)
def converted(request, tmp_path_factory):
    folder = write_hf_tokenizer(vocab_gguf(request.param), tmp_path_factory.mktemp(request.param), request.param)
    mlt = folder / "tok.mlt"
    formats.write(mlt, container_from_folder(folder))
    return request.param, mlt


class TokenizerJsonTests:
    def test_vectors(self, converted):
        """Every llama.cpp vector input encodes to the expected ids (no BOS)."""
        name, mlt = converted
        tokenizer = Tokenizer(mlt)
        for text, expected in vocab_cases(name):
            assert tokenizer.encode(text, add_bos=False) == expected, text

    def test_same_settings_as_the_gguf_path(self, converted):
        """kind, pre-tokenizer, vocabulary size, special ids, add_bos / add_space_prefix and the
        end-of-generation ids equal the .mlt converted from the GGUF."""
        name, mlt = converted
        ours, theirs = formats.read(mlt).metadata, formats.read(vocab_mlt(name)).metadata
        for key in ("kind", "pre", "n_vocab", "bos_id", "eos_id", "unk_id", "ignore_merges", "eot_ids", "add_bos",
                    "add_space_prefix"):
            assert ours[key] == theirs[key], key

    def test_o200k_same_settings_as_the_gguf_path(self, tmp_path):
        """gpt-oss's split regex is o200k, as `tokenizer.ggml.pre = "gpt-4o"` is: the two files of the
        small o200k vocabulary give the same settings."""
        folder = o200k_vocab.tiny_folder(tmp_path)
        ours = container_from_folder(folder).metadata
        theirs = container_from_gguf(gguf.GGUFReader(o200k_vocab.gguf_from_folder(folder, tmp_path / "v.gguf"))).metadata
        assert ours["pre"] == "o200k"
        for key in ("kind", "pre", "n_vocab", "eos_id", "ignore_merges", "eot_ids", "add_bos"):
            assert ours[key] == theirs[key], key

    def test_refusals(self):
        """A non-BPE model or an unknown split regex is refused with a message."""
        with pytest.raises(TokenizerConversionError, match="krafla reads BPE"):
            tables_from_json({"model": {"type": "Unigram"}})
        odd = {"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a a"]},
               "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                   {"type": "Split", "pattern": {"Regex": "x+"}}, {"type": "ByteLevel"}]}}
        with pytest.raises(TokenizerConversionError, match="split regex"):
            tables_from_json(odd)
        # o200k with its punctuation run keeping no '/': a case-splitting regex krafla has no splitter for
        near = o200k_vocab.REGEX.replace("[\\r\\n/]*", "[\\r\\n]*")
        assert near != o200k_vocab.REGEX
        odd["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = near
        with pytest.raises(TokenizerConversionError, match="split regex .* not one krafla knows"):
            tables_from_json(odd)
