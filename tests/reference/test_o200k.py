"""The real o200k vocabulary (gpt-4o, gpt-oss) through krafla's converters, against tiktoken.

OpenAI publishes o200k_base as a download, which tiktoken fetches on first use; the test machines
reach no such host. The `quicktok-v1` package ships the same ranks (quicktok/data/o200k.vocab,
"derived from OpenAI's tiktoken, MIT", its NOTICE says). The file is read here and written back in
tiktoken's own format, and tiktoken's constructor of `o200k_harmony` (gpt-oss's encoding: o200k_base's
ranks and split regex, harmony's special tokens) loads it only if its sha256 equals the hash tiktoken
pins for the download: the vocabulary is exactly OpenAI's.

From the ranks, the files krafla converts are written as llama.cpp's and Hugging Face's converters
write them: tokens in GPT-2's byte alphabet, and for each token of two or more bytes the merge that
byte-pair encoding with only lower ranks ends on (two parts), in rank order. Then krafla's ids
equal tiktoken's, from the GGUF (`tokenizer.ggml.pre = "gpt-4o"`) and from tokenizer.json.
"""

import base64
import importlib.resources
import json
import struct

import gguf
import pytest
import tiktoken
import tiktoken.load
from hypothesis import assume, example, given, settings
from tiktoken_ext import openai_public

from krafla_twisted.convert.tokenizer import container_from_gguf
from krafla_twisted.convert.tokenizer_json import container_from_folder
from krafla_twisted.engine import formats
from krafla_twisted.engine.tokenizer import Tokenizer, unicode_class
from tests import strategies
from tests.support import o200k_vocab
from tests.test_tokenizer import regex_class

CONTROL = 3


def _ranks_from_quicktok():
    """quicktok's o200k.vocab: u32 count, then per token u16 length, the bytes, u32 rank (little-endian)."""
    data = (importlib.resources.files("quicktok") / "data" / "o200k.vocab").read_bytes()
    (count,), offset, ranks = struct.unpack_from("<I", data), 4, {}
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, offset)
        token = data[offset + 2:offset + 2 + length]
        (ranks[token],) = struct.unpack_from("<I", data, offset + 2 + length)
        offset += 6 + length
    assert offset == len(data)
    return ranks


def harmony_encoding(folder):
    """tiktoken's o200k_harmony, built by tiktoken's own constructor with its loader pointed at the
    ranks written into `folder` (its pinned sha256 still checked) instead of the download."""
    ranks = _ranks_from_quicktok()
    path = folder / "o200k_base.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])))
    hashes = []

    def load_local(blobpath, expected_hash=None):
        hashes.append(expected_hash)
        return tiktoken.load.load_tiktoken_bpe(str(path), expected_hash=expected_hash)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(openai_public, "load_tiktoken_bpe", load_local)
        patch.setenv("TIKTOKEN_CACHE_DIR", str(folder / "cache"))  # read_file_cached checks the hash on a miss
        encoding = tiktoken.Encoding(**openai_public.o200k_harmony())
    assert hashes and all(hashes)
    return encoding


def _byte_alphabet():
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def merges_from_ranks(ranks):
    """(left, right) per multi-byte token in rank order: where merging by rank below the token's own stops."""
    merges = []
    for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(token) < 2:
            continue
        parts = [token[i:i + 1] for i in range(len(token))]
        while True:
            candidates = [(ranks.get(parts[i] + parts[i + 1], rank), i) for i in range(len(parts) - 1)]
            lowest, i = min(candidates)
            if lowest >= rank:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        assert len(parts) == 2, token
        merges.append((parts[0], parts[1]))
    return merges


@pytest.fixture(scope="module")
def o200k(tmp_path_factory):
    """tiktoken's o200k_harmony and krafla's tokenizers of the same vocabulary from both files."""
    folder = tmp_path_factory.mktemp("o200k")
    encoding = harmony_encoding(folder)
    ranks = encoding._mergeable_ranks
    alphabet = _byte_alphabet()
    spell = lambda token: "".join(alphabet[b] for b in token)  # noqa: E731
    tokens, types = [None] * encoding.n_vocab, [1] * encoding.n_vocab
    for token, rank in ranks.items():
        tokens[rank] = spell(token)
    # o200k_harmony names id 200018 twice (<|endofprompt|> from o200k_base, then <|reserved_200018|>):
    # the files keep the first spelling, as gpt-oss's tokenizer.json does
    special = {}
    for text, i in encoding._special_tokens.items():
        special.setdefault(i, text)
    for i, text in special.items():
        tokens[i], types[i] = text, CONTROL
    merges = [f"{spell(a)} {spell(b)}" for a, b in merges_from_ranks(ranks)]
    eos = encoding._special_tokens["<|return|>"]

    o200k_vocab.write_gguf(folder / "o200k.gguf", tokens, types, merges, eos)
    formats.write(folder / "gguf.mlt", container_from_gguf(gguf.GGUFReader(folder / "o200k.gguf")))
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
              "special": True} for i, t in sorted(special.items())]
    tokenizer_json = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": encoding._pat_str}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {spell(t): r for t, r in ranks.items()}, "merges": merges}}
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer_json, ensure_ascii=False), encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|return|>", "add_bos_token": False}))
    formats.write(folder / "json.mlt", container_from_folder(folder))
    return {"tiktoken": encoding, "gguf": Tokenizer(folder / "gguf.mlt"), "json": Tokenizer(folder / "json.mlt")}


class O200kVocabularyTests:
    def test_files_carry_the_vocabulary(self, o200k):
        """Both files give the o200k pre-tokenizer, all 201088 ids, and <|return|> among the end ids."""
        for name in ("gguf", "json"):
            tok = o200k[name]
            assert (tok.pre, tok.n_vocab) == ("o200k", o200k["tiktoken"].n_vocab), name
            assert tok.token_id("<|return|>") in tok.eot_ids

    @pytest.mark.parametrize("text", o200k_vocab.TEXTS)
    def test_fixed_corpus_equals_tiktoken(self, o200k, text):
        """Plain text: ids equal tiktoken's encode_ordinary, from both files."""
        expected = o200k["tiktoken"].encode_ordinary(text)
        assert o200k["gguf"].encode(text, add_bos=False) == expected
        assert o200k["json"].encode(text, add_bos=False) == expected

    @settings(max_examples=200, deadline=None)
    @given(text=strategies.cased_tokenizer_texts)
    @example(text="<|start|>user<|message|>What's 2+2? Answer in ÜBER-casE.<|end|><|start|>assistant")
    def test_hypothesis_text_equals_tiktoken(self, o200k, text):
        """Hypothesis text with harmony's special tokens parsed (tiktoken's allowed_special="all")."""
        assume(all(regex_class(ch) == unicode_class(ord(ch)) for ch in text))
        expected = o200k["tiktoken"].encode(text, allowed_special="all")
        assert o200k["gguf"].encode(text, add_bos=False, special=True) == expected
        assert o200k["json"].encode(text, add_bos=False, special=True) == expected

    def test_decode_returns_the_text(self, o200k):
        """tiktoken's ids decode through krafla to the text they came from."""
        for text in o200k_vocab.TEXTS:
            assert o200k["gguf"].decode(o200k["tiktoken"].encode_ordinary(text)) == text.encode()
