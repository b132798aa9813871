"""The tokenizer (engine_c/src/tokenizer/tokenizer.c through krafla_twisted.engine.tokenizer) and its converter.

Independent references: llama.cpp's own test vectors (tests/support/testdata.py), the `regex`
module running the pre-tokenizer patterns llama.cpp uses, plain-Python BPE and SentencePiece
merges over vocabularies read straight from the GGUF with gguf-py, and Python's unicodedata.
o200k (gpt-4o, gpt-oss) has no llama.cpp vectors: its split is checked against tiktoken's regex in
the `regex` module and in Hugging Face's `tokenizers`, and its encode against `tokenizers` on a
small vocabulary that library trains (tests/support/o200k_vocab.py; the real vocabulary against
tiktoken is tests/reference/test_o200k.py).
"""

import ctypes
import functools
import math
import unicodedata

import gguf
import hypothesis.strategies as st
import numpy as np
import pytest
import regex
import tokenizers
from hypothesis import HealthCheck, assume, example, given, settings

from krafla_twisted.convert import tokenizer as convert
from krafla_twisted.convert.tokenizer_json import container_from_folder
from krafla_twisted.engine import clib, formats
from krafla_twisted.engine.tokenizer import CONTROL, UNKNOWN, USER_DEFINED, Tokenizer, unicode_class
from tests import strategies
from tests.support import o200k_vocab, real_models, testdata

BPE_VOCABS = ("gpt-2", "llama-bpe", "qwen2", "qwen35")
SPM_VOCABS = ("llama-spm", "phi-3")


@functools.lru_cache(maxsize=None)
def vocab_tokenizer(name):
    return Tokenizer(testdata.vocab_mlt(name))


@functools.lru_cache(maxsize=None)
def pulled_tokenizer(name):
    """The real model's tokenizer as `krafla pull` wrote it (this converter, from the checked GGUF)."""
    return Tokenizer(real_models.real_model(name).mlt)


@functools.lru_cache(maxsize=None)
def special_spellings(tok, types=(CONTROL, USER_DEFINED, UNKNOWN)):
    return [(i, tok.token_text(i)) for i in range(tok.n_vocab) if tok.token_type(i) in types]


def _round_trip_expected(tok, data):
    """decode(encode(text)): the bytes back, with SentencePiece's added leading space (before
    any text at all; an empty text stays empty). SentencePiece writes a space as U+2581, so a
    U+2581 typed in the text comes back as a space, as it does in llama.cpp and sentencepiece."""
    if tok.kind != "spm":
        return data
    data = data.replace("\u2581".encode(), b" ")
    return (b" " if tok.add_space_prefix and data else b"") + data


def _has_special_spelling(tok, data):
    return any(text in data for _, text in special_spellings(tok, (USER_DEFINED,)))


@functools.lru_cache(maxsize=None)
def missing_bytes(tok):
    """Bytes a byte-level vocabulary has no token for (SmolLM2 lacks a few never seen in its
    training text, e.g. 0xF1): like llama.cpp, encode drops them, so they cannot round-trip."""
    if tok.kind != "bpe":
        return frozenset()
    alphabet = _gpt2_alphabet()
    return frozenset(b for b in range(256) if tok.token_id(alphabet[b]) is None)


def _encodable(tok, data):
    return not missing_bytes(tok).intersection(data)


class VocabVectorTests:
    """llama.cpp's vectors: each input line encodes (no BOS) to exactly the expected ids."""

    @pytest.mark.parametrize("name", testdata.VOCABS)
    def test_every_line_encodes_to_the_expected_ids(self, name):
        """All lines of ggml-vocab-NAME.gguf.inp/.out, compared id for id."""
        tok = vocab_tokenizer(name)
        cases = testdata.vocab_cases(name)
        assert len(cases) >= 40
        wrong = [(text, want, got) for text, want in cases if (got := tok.encode(text, add_bos=False)) != want]
        assert not wrong, f"{len(wrong)} of {len(cases)} lines differ, first: {wrong[0]}"

    def test_qwen25_coder_shares_qwen2_vectors(self):
        """The real Qwen2.5-Coder vocabulary has qwen2's merges, so qwen2's vectors hold for it too."""
        tok = pulled_tokenizer("qwen2.5-coder-0.5b")
        for text, want in testdata.vocab_cases("qwen2"):
            assert tok.encode(text, add_bos=False) == want, text

    def test_file_defaults_as_llama_cpp_reads_them(self):
        """add_bos, the pre-tokenizer and the end-of-generation ids follow llama.cpp's loader."""
        llama3 = vocab_tokenizer("llama-bpe")
        assert (llama3.pre, llama3.add_bos, llama3.bos_id) == ("llama3", True, 128000)
        assert {128001, 128009} <= llama3.eot_ids
        assert llama3.encode("Hi")[0] == 128000 and llama3.encode("Hi", add_bos=False)[0] != 128000
        spm = vocab_tokenizer("llama-spm")
        assert (spm.kind, spm.add_bos, spm.add_space_prefix, spm.eos_id) == ("spm", True, True, 2)
        assert vocab_tokenizer("phi-3").token_id("<|end|>") in vocab_tokenizer("phi-3").eot_ids
        assert vocab_tokenizer("gpt-2").encode("Hi") == vocab_tokenizer("gpt-2").encode("Hi", add_bos=False)


class RoundTripTests:
    """decode(encode(text)) gives back the text: exactly for BPE, after the leading space for SPM."""

    @pytest.mark.parametrize("name", BPE_VOCABS + SPM_VOCABS)
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(text=strategies.tokenizer_texts)
    @example(text="")
    @example(text="<|im_start|>user\nhi<|im_end|>")
    @example(text="\u2581")
    def test_text_round_trips(self, name, text):
        """Hypothesis text (spaces, digits, marks, CJK, emoji, NUL) survives encode then decode."""
        tok = vocab_tokenizer(name)
        data = text.encode()
        assume(tok.kind == "bpe" or not _has_special_spelling(tok, data))
        assert tok.decode(tok.encode(text, add_bos=False)) == _round_trip_expected(tok, data)

    @pytest.mark.parametrize("name", BPE_VOCABS + SPM_VOCABS)
    @settings(max_examples=40, deadline=None)
    @given(data=st.binary(max_size=40))
    @example(data=b"\xff\xfe\x00\xc3(\xe2\x82")
    def test_invalid_utf8_bytes_round_trip(self, name, data):
        """Any bytes, invalid UTF-8 and NUL included, come back exactly (through byte tokens)."""
        tok = vocab_tokenizer(name)
        assume(tok.kind == "bpe" or not _has_special_spelling(tok, data))
        assert tok.decode(tok.encode(data, add_bos=False)) == _round_trip_expected(tok, data)

    @pytest.mark.parametrize("name", real_models.NAMES)
    @settings(max_examples=25, deadline=None)
    @given(text=strategies.tokenizer_texts)
    def test_real_model_tokenizers_round_trip(self, name, text):
        """The pulled models' .mlt files (what `krafla pull` wrote) round-trip too."""
        tok = pulled_tokenizer(name)
        data = text.encode()
        assume(_encodable(tok, data) and (tok.kind == "bpe" or not _has_special_spelling(tok, data)))
        assert tok.decode(tok.encode(text, add_bos=False)) == _round_trip_expected(tok, data)

    def test_one_giant_pre_token(self):
        """200 kB of one letter (one pre-token) and of one space run encode and round-trip."""
        for name in ("llama-bpe", "llama-spm"):
            tok = vocab_tokenizer(name)
            for text in ("a" * 200_000, " " * 200_000, "ab1 " * 50_000):
                ids = tok.encode(text, add_bos=False)
                assert len(ids) < len(text) and tok.decode(ids) == _round_trip_expected(tok, text.encode())


class SpecialTokenTests:
    """Control-token spellings in user text stay text; in special mode they become the tokens."""

    @pytest.mark.parametrize("name", testdata.VOCABS)
    def test_user_text_never_becomes_a_control_token(self, name):
        """Every special spelling of the vocabulary, glued and spaced, encodes to no control token."""
        tok = vocab_tokenizer(name)
        spellings = [text for _, text in special_spellings(tok)]
        for text in (b"".join(spellings), b" ".join(spellings), b"x\n".join(spellings)):
            ids = tok.encode(text, add_bos=False)
            assert not [i for i in ids if tok.is_control(i)]
            assert tok.decode(ids) == _round_trip_expected(tok, text) or tok.kind == "spm"

    @pytest.mark.parametrize("name", real_models.NAMES)
    def test_real_model_chat_markers_stay_text(self, name):
        """The pulled models' own turn markers typed by a user are not control tokens."""
        tok = pulled_tokenizer(name)
        text = "".join(t.decode("utf-8", "replace") for _, t in special_spellings(tok, (CONTROL,))[:300])
        assert not [i for i in tok.encode(text, add_bos=False) if tok.is_control(i)]

    @pytest.mark.parametrize("name", testdata.VOCABS)
    def test_special_mode_parses_each_control_token(self, name):
        """With special=True a control token's exact spelling is that one token."""
        tok = vocab_tokenizer(name)
        for token, text in special_spellings(tok, (CONTROL,))[:64]:
            assert tok.encode(text, add_bos=False, special=True) == [token]
            assert tok.token_id(text.decode()) == token
            assert tok.token_bytes(token) == text and tok.decode([token]) == b""
            assert tok.decode([token], special=True) == text

    def test_chat_turn_in_special_mode(self):
        """A ChatML turn splits around its markers; the text between is encoded as usual."""
        tok = vocab_tokenizer("qwen2")
        start, end = tok.token_id("<|im_start|>"), tok.token_id("<|im_end|>")
        ids = tok.encode("<|im_start|>user\nHello<|im_end|>\n", special=True)
        assert ids == [start] + tok.encode("user\nHello") + [end] + tok.encode("\n")
        assert end in tok.eot_ids

    @pytest.mark.parametrize("name,special", [("gemma3-270m", False), ("gemma3-270m", True), ("qwen2.5-coder-0.5b", True)])
    @settings(max_examples=60, deadline=None)
    @given(data=st.data())
    def test_partition_equals_the_reference(self, name, special, data):
        """Text glued from special spellings (overlapping runs of spaces and newlines, markers)
        and plain characters splits exactly as the naive longest-first partition does."""
        tok = pulled_tokenizer(name)
        tokens, types, _, _ = gguf_vocab(name)
        spellings = [tokens[i] for i, t in enumerate(types) if t in (CONTROL, USER_DEFINED)][:400]
        pieces = data.draw(st.lists(st.sampled_from(spellings) | st.sampled_from([" ", "\n", "a", "<", "|", ">"]),
                                    max_size=12))
        text = "".join(pieces)
        ids = tok.encode(text, add_bos=False, special=special)
        expected = reference_partition(tokens, types, text, special)
        assert [i for i in ids if tok.token_type(i) in (CONTROL, USER_DEFINED)] == [
            p for p in expected if isinstance(p, int)]
        assert tok.decode(ids, special=True) == ("".join(
            tokens[p] if isinstance(p, int) else p for p in expected)).encode()

    def test_phi3_strips_whitespace_after_special_tokens(self):
        """phi-3 eats the spaces after a special token (llama.cpp's rstrip for that model)."""
        tok = vocab_tokenizer("phi-3")
        user = tok.token_id("<|user|>")
        assert tok.encode("<|user|>   hi", special=True, add_bos=False) == [user] + tok.encode("hi", add_bos=False)


# --- pre-tokenizers against the `regex` module running llama.cpp's patterns (o200k: tiktoken's)

CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
PATTERNS = {
    "gpt2": [GPT2],
    "llama3": [CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "qwen2": [CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    "qwen35": [CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+"],
    "smollm": [r"\p{N}", GPT2],
    "o200k": [o200k_vocab.REGEX],
}


@pytest.fixture(scope="module")
def o200k_tiny(tmp_path_factory):
    """The small o200k vocabulary three ways: krafla's .mlt from its GGUF (pre "gpt-4o") and from its
    tokenizer.json, and Hugging Face's tokenizer itself."""
    folder = o200k_vocab.tiny_folder(tmp_path_factory.mktemp("o200k"))
    reader = gguf.GGUFReader(o200k_vocab.gguf_from_folder(folder, folder / "vocab.gguf"))
    formats.write(folder / "gguf.mlt", convert.container_from_gguf(reader))
    formats.write(folder / "json.mlt", container_from_folder(folder))
    return {"gguf": Tokenizer(folder / "gguf.mlt"), "json": Tokenizer(folder / "json.mlt"),
            "hf": tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json")),
            "hf_split": tokenizers.pre_tokenizers.Split(tokenizers.Regex(o200k_vocab.REGEX), behavior="isolated")}


def reference_split(patterns, text):
    """Each pattern splits every piece in turn; text between matches is a piece of its own."""
    pieces = [text]
    for pattern in patterns:
        compiled = regex.compile(pattern)
        split = []
        for piece in pieces:
            last = 0
            for match in compiled.finditer(piece):
                if match.start() > last:
                    split.append(piece[last:match.start()])
                if match.end() > match.start():
                    split.append(match.group())
                last = match.end()
            if last < len(piece):
                split.append(piece[last:])
        pieces = split
    return pieces


def regex_class(ch):
    return ((1 if regex.match(r"\p{L}", ch) else 0) | (2 if regex.match(r"\p{N}", ch) else 0)
            | (4 if regex.match(r"\p{M}", ch) else 0) | (8 if regex.match(r"\s", ch) else 0)
            | (16 if regex.match(r"[\p{Lu}\p{Lt}]", ch) else 0) | (32 if regex.match(r"\p{Ll}", ch) else 0))


class PreTokenizerTests:
    """Each hand-written splitter equals llama.cpp's regex for it (o200k: tiktoken's), run by the
    `regex` module."""

    @pytest.mark.parametrize("pre,name", [("gpt2", "gpt-2"), ("llama3", "llama-bpe"), ("qwen2", "qwen2"),
                                          ("qwen35", "qwen35"), ("smollm", "smollm2-135m")])
    @settings(max_examples=150, deadline=None)
    @given(text=strategies.tokenizer_texts)
    @example(text="Hello, y'all! How're you 😁 ?我想在apple工作1314151天～ \n\n  x  \r\n\t' era  ")
    def test_split_equals_the_regex(self, pre, name, text):
        """Pre-tokens of hypothesis text, over characters whose class both Unicode tables agree on."""
        assume(all(regex_class(ch) == unicode_class(ord(ch)) for ch in text))
        tok = pulled_tokenizer(name) if name in real_models.NAMES else vocab_tokenizer(name)
        assert tok.pre == pre
        assert [p.decode() for p in tok.pretokenize(text)] == reference_split(PATTERNS[pre], text)

    @settings(max_examples=400, deadline=None)
    @given(text=strategies.cased_tokenizer_texts)
    def test_o200k_split_equals_both_regex_engines(self, o200k_tiny, text):
        """o200k (from a GGUF with pre "gpt-4o"): pre-tokens of hypothesis text equal tiktoken's regex run
        by the `regex` module and by `tokenizers` (Oniguruma), over characters whose class both
        Unicode tables agree on."""
        assume(all(regex_class(ch) == unicode_class(ord(ch)) for ch in text))
        tok = o200k_tiny["gguf"]
        assert tok.pre == "o200k"
        pieces = [p.decode() for p in tok.pretokenize(text)]
        assert pieces == reference_split(PATTERNS["o200k"], text)
        assert pieces == [piece for piece, _ in o200k_tiny["hf_split"].pre_tokenize_str(text)]

    @pytest.mark.parametrize("text", o200k_vocab.TEXTS)
    def test_o200k_split_of_the_fixed_corpus(self, o200k_tiny, text):
        """The fixed corpus: the same two references, line by line."""
        pieces = [p.decode() for p in o200k_tiny["gguf"].pretokenize(text)]
        assert pieces == reference_split(PATTERNS["o200k"], text)
        assert pieces == [piece for piece, _ in o200k_tiny["hf_split"].pre_tokenize_str(text)]

    def test_o200k_long_runs_split_in_one_pass(self, o200k_tiny):
        """200 kB runs on which the word alternatives give back characters (no lower case after an
        upper-side run, marks as prefix and word): the splits equal the regex's."""
        tok = o200k_tiny["gguf"]
        for unit, head, tail in (("A", "中", " "), ("Aa", "", ""), ("中A", "", "!"), ("\u0301", "x", "'S"),
                                 ("ʰ", "A", "B"), ("1", "", "")):
            text = head + unit * (200_000 // len(unit)) + tail
            assert [p.decode() for p in tok.pretokenize(text)] == reference_split(PATTERNS["o200k"], text), unit


class UnicodeClassTests:
    """The generated class table agrees with Python's unicodedata for every codepoint."""

    def test_every_codepoint(self):
        """Letter, number, mark and letter-case bits from the general category; space from White_Space."""
        white_space = set(range(9, 14)) | {0x20, 0x85, 0xA0, 0x1680, *range(0x2000, 0x200B), 0x2028, 0x2029, 0x202F,
                                           0x205F, 0x3000}
        lib = clib.load()
        table_version = (ctypes.c_char * 16).in_dll(lib, "kr_unicode_version").value.decode()
        wrong, newer = [], []
        for cp in range(0x110000):
            category = unicodedata.category(chr(cp))
            case = 16 if category in ("Lu", "Lt") else 32 if category == "Ll" else 0
            want = 8 if cp in white_space else {"L": 1, "N": 2, "M": 4}.get(category[0], 0) | case
            got = lib.kr_unicode_class(cp)
            if got != want:
                # a Python newer than the table's Unicode knows characters the table leaves unassigned
                (newer if got == 0 and table_version != unicodedata.unidata_version else wrong).append(hex(cp))
        assert not wrong
        assert len(newer) < 20000

    def test_generated_table_is_up_to_date(self):
        """tokenizer_unicode.c is exactly what its generator writes (same Unicode version)."""
        import importlib.util
        import io
        source = testdata.REPO / "engine_c" / "src" / "tokenizer"
        spec = importlib.util.spec_from_file_location("tokenizer_unicode", source / "tokenizer_unicode.py")
        generator = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(generator)
        committed = (source / "tokenizer_unicode.c").read_text()
        out = io.StringIO()
        generator.main(out)
        if f"(Unicode {unicodedata.unidata_version})" in committed:
            assert out.getvalue() == committed
        else:  # a newer Python: its table may only add runs (test_every_codepoint checks the classes)
            assert len(out.getvalue()) >= len(committed) and out.getvalue().startswith(committed[:40])
        assert unicode_class(0x110000) == 0 and unicode_class(0xFFFFFFFF) == 0


# --- whole encodes against plain-Python merges over the GGUF's own tables


def _gpt2_alphabet():
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    extra = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


@functools.lru_cache(maxsize=None)
def gguf_vocab(name):
    reader = real_models.gguf_reader(name)
    fields = reader.fields
    tokens = [bytes(fields["tokenizer.ggml.tokens"].parts[i]).decode() for i in fields["tokenizer.ggml.tokens"].data]
    types = [int(t) for t in fields["tokenizer.ggml.token_type"].contents()]
    extra = {}
    if "tokenizer.ggml.merges" in fields:
        merges = [bytes(fields["tokenizer.ggml.merges"].parts[i]).decode() for i in fields["tokenizer.ggml.merges"].data]
        extra["ranks"] = {tuple(m.split(" ", 1)): rank for rank, m in reversed(list(enumerate(merges)))}
    if "tokenizer.ggml.scores" in fields:
        extra["scores"] = [float(s) for s in fields["tokenizer.ggml.scores"].contents()]
    return tokens, types, {t: i for i, t in enumerate(tokens)}, extra


def reference_partition(tokens, types, text, special=False, rstrip=frozenset()):
    """llama.cpp's special-token partition, naively: spellings longest first, each claiming its
    leftmost occurrences in unclaimed text (equal lengths: leftmost first, an order llama.cpp
    leaves open). Returns raw-text pieces (str) and token ids (int), in order."""
    wanted = (CONTROL, USER_DEFINED, UNKNOWN) if special else (USER_DEFINED,)
    spellings = {}
    for i, t in enumerate(types):
        if t in wanted:
            spellings.setdefault(tokens[i], i)
    claimed = [None] * len(text)  # token id at the start of a claimed span, -1 inside it, -2 stripped
    for length in sorted({len(s) for s in spellings}, reverse=True):
        for p in range(len(text) - length + 1):
            token = spellings.get(text[p:p + length])
            if token is None or any(c is not None for c in claimed[p:p + length]):
                continue
            claimed[p:p + length] = [token] + [-1] * (length - 1)
            if token in rstrip:
                q = p + length
                while q < len(text) and claimed[q] is None and text[q] in " \t\n\v\f\r":
                    claimed[q] = -2
                    q += 1
    pieces, raw = [], ""
    for ch, c in zip(text, claimed):
        if c is None:
            raw += ch
        elif c >= 0:
            pieces += [raw, c] if raw else [c]
            raw = ""
    return pieces + ([raw] if raw else [])


def reference_bpe_encode(name, text):
    tokens, types, ids, extra = gguf_vocab(name)
    alphabet, out = _gpt2_alphabet(), []
    for fragment in reference_partition(tokens, types, text):
        if isinstance(fragment, int):
            out.append(fragment)
            continue
        for word in reference_split(PATTERNS["smollm"], fragment):
            symbols = [alphabet[b] for b in word.encode()]
            while len(symbols) > 1:
                rank, i = min((extra["ranks"].get((symbols[i], symbols[i + 1]), math.inf), i)
                              for i in range(len(symbols) - 1))
                if rank == math.inf:
                    break
                symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
            out += [ids[s] for s in symbols if s in ids]  # a byte without a token is dropped
    return out


def reference_spm_encode(name, text, add_space_prefix):
    tokens, types, ids, extra = gguf_vocab(name)
    scores, out, after_special = extra["scores"], [], True
    usable = lambda s: s in ids and types[ids[s]] not in (CONTROL, UNKNOWN)  # noqa: E731
    for fragment in reference_partition(tokens, types, text):
        if isinstance(fragment, int):
            out.append(fragment)
            after_special = True
            continue
        symbols = list(((" " if add_space_prefix and after_special else "") + fragment).replace(" ", "▁"))
        after_special = False
        while True:
            best = None
            for i in range(len(symbols) - 1):
                pair = symbols[i] + symbols[i + 1]
                if usable(pair) and (best is None or scores[ids[pair]] > best[0]):
                    best = (scores[ids[pair]], i)
            if best is None:
                break
            i = best[1]
            symbols[i:i + 2] = [symbols[i] + symbols[i + 1]]
        for s in symbols:
            out += [ids[s]] if usable(s) else [ids[f"<0x{b:02X}>"] for b in s.encode()]
    return out


class ReferenceEncodeTests:
    """Real vocabularies without llama.cpp vectors, against plain-Python merges."""

    @settings(max_examples=60, deadline=None)
    @given(text=strategies.tokenizer_texts)
    @example(text="\U00040000 \U000e0067")
    @example(text="What is the capital of France? It's Paris, 2024.\n\n  def f(x):\n\treturn x'")
    def test_smollm2_equals_python_bpe(self, text):
        """SmolLM2 (byte-level BPE, smollm split): ids equal a naive merge-by-rank loop."""
        assume(all(regex_class(ch) == unicode_class(ord(ch)) for ch in text))
        assert pulled_tokenizer("smollm2-135m").encode(text, add_bos=False) == reference_bpe_encode(
            "smollm2-135m", text)

    @settings(max_examples=25, deadline=None)
    @given(text=strategies.tokenizer_texts)
    @example(text="Hello world!\n\n  The capital of France is Paris. 12345 <table>x</table>")
    def test_gemma3_equals_python_sentencepiece(self, text):
        """Gemma 3 (SentencePiece BPE, byte fallback, user-defined space runs): ids equal a naive
        highest-score merge loop."""
        tok = pulled_tokenizer("gemma3-270m")
        assert tok.kind == "spm" and tok.add_bos and not tok.add_space_prefix
        assert tok.encode(text, add_bos=False) == reference_spm_encode("gemma3-270m", text, add_space_prefix=False)

    @settings(max_examples=150, deadline=None)
    @given(text=strategies.cased_tokenizer_texts)
    @example(text="Ain't HelloWorld/<|endoftext|>中A\r\n/ 12345<|return|>")
    def test_o200k_equals_hugging_face_tokenizers(self, o200k_tiny, text):
        """The small o200k vocabulary, converted from its GGUF and from its tokenizer.json: ids equal
        what `tokenizers` encodes from the tokenizer.json (special tokens parsed, as it does)."""
        assume(all(regex_class(ch) == unicode_class(ord(ch)) for ch in text))
        expected = o200k_tiny["hf"].encode(text, add_special_tokens=False).ids
        assert o200k_tiny["gguf"].encode(text, add_bos=False, special=True) == expected
        assert o200k_tiny["json"].encode(text, add_bos=False, special=True) == expected

    @pytest.mark.parametrize("text", o200k_vocab.TEXTS)
    def test_o200k_fixed_corpus_equals_hugging_face_tokenizers(self, o200k_tiny, text):
        """The fixed corpus, both files, against `tokenizers`."""
        expected = o200k_tiny["hf"].encode(text, add_special_tokens=False).ids
        assert len(expected) > 1
        assert o200k_tiny["gguf"].encode(text, add_bos=False) == expected
        assert o200k_tiny["json"].encode(text, add_bos=False) == expected

    def test_gemma3_end_of_turn(self):
        """Gemma's <end_of_turn> ends a generation and bos comes first by default."""
        tok = pulled_tokenizer("gemma3-270m")
        assert tok.token_id("<end_of_turn>") in tok.eot_ids and tok.eos_id in tok.eot_ids
        assert tok.encode("hi")[0] == tok.bos_id == 2


class StreamingDecoderTests:
    """Streamed text never ends inside a character; invalid bytes become U+FFFD."""

    @pytest.mark.parametrize("name", ["llama-bpe", "llama-spm"])
    @settings(max_examples=60, deadline=None)
    @given(text=strategies.tokenizer_texts)
    def test_pieces_are_whole_characters(self, name, text):
        """Each push is a prefix extension of the text (no U+FFFD from a split character)."""
        tok = vocab_tokenizer(name)
        assume(tok.kind == "bpe" or not _has_special_spelling(tok, text.encode()))
        decoder, streamed = tok.streaming_decoder(), ""
        expected = _round_trip_expected(tok, text.encode()).decode()
        for token in tok.encode(text, add_bos=False):
            streamed += decoder.push(token)
            assert expected.startswith(streamed)
        assert streamed + decoder.flush() == expected

    def test_split_emoji_waits_for_its_last_byte(self):
        """An emoji spelled by four byte tokens appears whole with the fourth."""
        tok = vocab_tokenizer("llama-spm")
        byte_tokens = [tok.token_id(f"<0x{b:02X}>") for b in "🦙".encode()]
        decoder = tok.streaming_decoder()
        assert [decoder.push(t) for t in byte_tokens] == ["", "", "", "🦙"]

    def test_invalid_bytes_become_replacement_characters(self):
        """A stray continuation byte is U+FFFD at once; a cut-off character is U+FFFD at flush."""
        tok = vocab_tokenizer("gpt-2")
        decoder = tok.streaming_decoder()
        stray, lead = tok.encode(b"\x80", add_bos=False), tok.encode(b"\xe2\x82", add_bos=False)
        assert "".join(decoder.push(t) for t in stray) == "\ufffd"
        assert "".join(decoder.push(t) for t in lead) == ""
        assert decoder.flush() == "\ufffd"
        assert "".join(decoder.push(t) for t in tok.encode("ok", add_bos=False)) == "ok"


class ConverterTests:
    """The .mlt tables hold the GGUF's vocabulary as gguf-py reads it."""

    @pytest.mark.parametrize("name", ["gpt-2", "llama-spm", "phi-3"])
    def test_tables_match_the_gguf(self, name):
        """Spellings, types (up to llama.cpp's forced control), scores and every merge, row by row."""
        reader = gguf.GGUFReader(testdata.vocab_gguf(name))
        tokens = [bytes(reader.fields["tokenizer.ggml.tokens"].parts[i]) for i in reader.fields["tokenizer.ggml.tokens"].data]
        types = reader.fields["tokenizer.ggml.token_type"].contents()
        mlt = formats.read(testdata.vocab_mlt(name), formats.TOKENIZER_MAGIC)
        text, offsets = mlt.array("token_text").tobytes(), mlt.array("token_offsets")
        spelled = [text[offsets[i]:offsets[i + 1]] for i in range(len(tokens))]
        assert spelled == tokens and mlt.metadata["n_vocab"] == len(tokens)
        stored = mlt.array("token_types").tolist()
        assert [i for i in range(len(tokens)) if stored[i] != types[i]] == [
            i for i in range(len(tokens)) if stored[i] == CONTROL and types[i] != CONTROL]
        if "tokenizer.ggml.merges" in reader.fields:
            merges = [bytes(reader.fields["tokenizer.ggml.merges"].parts[i]) for i in reader.fields["tokenizer.ggml.merges"].data]
            rows = mlt.array("merges")
            assert len(rows) == len(merges)  # gpt-2's merges all name vocabulary strings
            assert all(tokens[a] + b" " + tokens[b] == m and tokens[r] == tokens[a] + tokens[b]
                       for (a, b, r), m in zip(rows.tolist(), merges))
        else:
            assert np.array_equal(mlt.array("token_scores"), reader.fields["tokenizer.ggml.scores"].contents())

    def test_unsupported_vocabularies_are_refused(self):
        """An unknown pre-tokenizer or tokenizer model is a clear conversion error."""
        reader = gguf.GGUFReader(testdata.vocab_gguf("gpt-2"))
        original = reader.fields["tokenizer.ggml.pre"]
        try:
            reader.fields["tokenizer.ggml.pre"] = type("F", (), {"contents": lambda self: "bloom"})()
            with pytest.raises(convert.TokenizerConversionError, match="bloom"):
                convert.container_from_gguf(reader)
            reader.fields["tokenizer.ggml.model"] = type("F", (), {"contents": lambda self: "t5"})()
            with pytest.raises(convert.TokenizerConversionError, match="t5"):
                convert.container_from_gguf(reader)
        finally:
            reader.fields["tokenizer.ggml.pre"] = original


class ThreadTests:
    """One tokenizer serves several threads at once (the reactor renders while the worker decodes)."""

    def test_concurrent_encodes_match_serial_ones(self):
        """Eight threads encoding different texts at once get what one thread gets."""
        from concurrent.futures import ThreadPoolExecutor
        tok = vocab_tokenizer("llama-bpe")
        texts = [f"Thread {i}: " + "naïve café 🦙 12345 " * (50 + i) for i in range(16)]
        serial = [tok.encode(t) for t in texts]
        with ThreadPoolExecutor(8) as pool:
            assert list(pool.map(tok.encode, texts * 2)) == serial * 2

    def test_lone_surrogates_become_replacement_characters(self):
        """A str with a lone surrogate (possible from JSON) encodes as if it held U+FFFD."""
        tok = vocab_tokenizer("qwen2")
        assert tok.encode("a\ud800b") == tok.encode("a\ufffdb")


class MalformedFileTests:
    """A bad .mlt is refused with a message naming the file and the problem, never a crash."""

    @staticmethod
    def tiny_tables():
        alphabet = _gpt2_alphabet()
        tokens = [alphabet[b].encode() for b in range(256)] + ["ab".encode(), "<|end|>".encode()]
        types = [1] * 257 + [CONTROL]
        return convert.TokenizerTables("bpe", "gpt2", tokens, types, merges=[(b"a", b"b")], eos_id=257,
                                       eot_ids={257})

    def write(self, tmp_path, container, name="t.mlt"):
        path = tmp_path / name
        formats.write(path, container)
        return path

    def test_tiny_tokenizer_works(self, tmp_path):
        """The hand-made vocabulary used below is itself valid: 'ab' merges, '<|end|>' is text."""
        tok = Tokenizer(self.write(tmp_path, convert.build_container(self.tiny_tables())))
        assert tok.encode("abc<|end|>") == [256, ord("c")] + [ord(c) for c in "<|end|>"]
        assert tok.encode("<|end|>", special=True) == [257] and tok.eot_ids == {257}

    @pytest.mark.parametrize("change,message", [
        (lambda c: c.metadata.update(kind="wordpiece"), "kind"),
        (lambda c: c.metadata.update(pre="bloom"), "pre-tokenizer"),
        (lambda c: c.metadata.update(eos_id=999), "eos_id"),
        (lambda c: c.metadata.update(eot_ids=[5, 300]), "eot_ids"),
        (lambda c: c.metadata.update(add_bos=1), "add_bos"),
        (lambda c: c.tensors.pop("merges"), "merges"),
        (lambda c: c.add("merges", formats.I32, (1, 3), np.array([[97, 98, 400]])), "merge 0"),
        (lambda c: c.add("token_offsets", formats.I32, (259,), np.r_[0, np.arange(258)[::-1]]), "token_offsets"),
        (lambda c: c.add("token_types", formats.I32, (258,), np.full(258, 9)), "type"),
        (lambda c: c.add("token_types", formats.I32, (12,), np.ones(12)), "token_types"),
    ])
    def test_bad_tables_are_refused(self, tmp_path, change, message):
        """Each broken field gives a KraflaError that names the file and that field."""
        container = convert.build_container(self.tiny_tables())
        change(container)
        path = self.write(tmp_path, container)
        with pytest.raises(clib.KraflaError, match=message) as caught:
            Tokenizer(path)
        assert str(path) in str(caught.value)

    @settings(max_examples=150, deadline=None)
    @given(flips=st.lists(st.tuples(st.integers(0, 10**9), st.integers(0, 255)), min_size=1, max_size=8),
           text=strategies.tokenizer_texts)
    def test_corrupted_files_never_crash(self, tmp_path_factory, flips, text):
        """Random byte changes: the file is refused cleanly, or it opens and encodes any text."""
        path = tmp_path_factory.mktemp("mlt") / "t.mlt"
        formats.write(path, convert.build_container(self.tiny_tables()))
        data = bytearray(path.read_bytes())
        for position, value in flips:
            data[position % len(data)] = value
        path.write_bytes(bytes(data))
        try:
            tok = Tokenizer(path)
        except clib.KraflaError:
            return
        ids = tok.encode(text, special=True)
        assert all(0 <= i < tok.n_vocab for i in ids)
        tok.decode(ids)

    def test_model_file_is_not_a_tokenizer(self, tmp_path):
        """A .mlb given as the tokenizer is refused as the wrong kind of file."""
        path = self.write(tmp_path, formats.Container(formats.MODEL_MAGIC, {"arch": "llama"}), "m.mlb")
        with pytest.raises(clib.KraflaError, match="tokenizer"):
            Tokenizer(path)

    def test_bad_token_ids_in_decode(self):
        """decode refuses ids outside the vocabulary with a ValueError naming the id."""
        tok = vocab_tokenizer("gpt-2")
        with pytest.raises(ValueError, match="50257"):
            tok.decode([1, 50257])
        with pytest.raises(ValueError):
            tok.decode([-1])
