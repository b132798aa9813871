"""WordPiece: the tokenizer of BERT-family encoders, read from a `kind wordpiece` .mlt.

The steps are BertTokenizerFast's (Hugging Face tokenizers' BertNormalizer, BertPreTokenizer,
WordPiece and the [CLS] A [SEP] (B [SEP]) template), so the ids equal transformers' on the same
vocabulary (tests/test_embeddings.py checks it on the real all-MiniLM-L6-v2 vocabulary):

  0. split out the special tokens' exact spellings ([CLS], [SEP], [UNK], [PAD], [MASK]: the
     tokenizer's added tokens, matched before normalisation, longest first, case as spelled),
     each its own id, as the tokenizers library does; the text between goes through 1-5;
  1. clean: drop NUL, U+FFFD and control characters; every whitespace character becomes a space;
  2. pad each CJK ideograph with spaces (chinese_chars);
  3. strip accents (NFD, then drop the nonspacing marks) and lower-case, as the file says;
  4. split on whitespace, and make every punctuation character a word of its own;
  5. each word: the longest vocabulary piece from its start, then the longest `##` piece from
     there on; a word with a part that matches nothing, or longer than max_chars_per_word
     characters, is [UNK].

The .mlt layout is convert/bert.py's (docs/formats.md, "WordPiece tokenizers").
"""

import re
import unicodedata

from krafla_twisted.engine import formats

_CJK = ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F), (0x2B740, 0x2B81F),
        (0x2B820, 0x2CEAF), (0xF900, 0xFAFF), (0x2F800, 0x2FA1F))


class WordPieceError(ValueError):
    """A .mlt that is not a WordPiece tokenizer, or a malformed one."""


def _is_cjk(code):
    return any(low <= code <= high for low, high in _CJK)


def _is_punctuation(char):
    code = ord(char)
    if 33 <= code <= 47 or 58 <= code <= 64 or 91 <= code <= 96 or 123 <= code <= 126:
        return True
    return unicodedata.category(char).startswith("P")


def _is_whitespace(char):
    return char in " \t\n\r" or unicodedata.category(char) == "Zs"


def _is_control(char):
    return char not in "\t\n\r" and unicodedata.category(char).startswith("C")


class WordPiece:
    """`WordPiece(path)` -> `.encode(text)` (ids with [CLS]/[SEP]), `.encode_pair(a, b)` (ids and
    token types), `.n_vocab`, `.cls_id`, `.sep_id`, `.decode(ids)`."""

    def __init__(self, path):
        try:
            container = formats.read(path, formats.TOKENIZER_MAGIC)
        except (OSError, formats.FormatError) as e:
            raise WordPieceError(f"{path}: {e}") from None
        meta = container.metadata
        if meta.get("kind") != "wordpiece":
            raise WordPieceError(f"{path}: tokenizer kind {meta.get('kind')!r}, expected wordpiece")
        try:
            text = container.array("token_text").tobytes()
            offsets = container.array("token_offsets")
            self.n_vocab = int(meta["n_vocab"])
            if len(offsets) != self.n_vocab + 1:
                raise WordPieceError(f"{path}: {len(offsets)} token offsets for n_vocab {self.n_vocab}")
            self.tokens = [text[offsets[i]:offsets[i + 1]].decode("utf-8") for i in range(self.n_vocab)]
            self.cls_id, self.sep_id = int(meta["cls_id"]), int(meta["sep_id"])
            self.unk_id, self.pad_id = int(meta["unk_id"]), int(meta["pad_id"])
            self.lowercase, self.strip_accents = bool(meta["lowercase"]), bool(meta["strip_accents"])
            self.chinese_chars = bool(meta["chinese_chars"])
            self.prefix, self.max_chars = str(meta["subword_prefix"]), int(meta["max_chars_per_word"])
        except (KeyError, ValueError, UnicodeDecodeError) as e:
            raise WordPieceError(f"{path}: malformed wordpiece tokenizer ({e})") from None
        for name in ("cls_id", "sep_id", "unk_id", "pad_id"):
            if not 0 <= getattr(self, name) < self.n_vocab:
                raise WordPieceError(f"{path}: {name} {getattr(self, name)} is outside the vocabulary")
        self.ids = {}
        for i, token in enumerate(self.tokens):
            self.ids.setdefault(token, i)
        # BertTokenizerFast's special tokens: the four the file names, and [MASK] (its mask_token)
        self.special_ids = {self.tokens[i]: i for i in (self.pad_id, self.unk_id, self.cls_id, self.sep_id)}
        if "[MASK]" in self.ids:
            self.special_ids.setdefault("[MASK]", self.ids["[MASK]"])
        spellings = sorted(self.special_ids, key=len, reverse=True)
        self._specials = re.compile("(" + "|".join(map(re.escape, spellings)) + ")")

    def normalize(self, text):
        out = []
        for char in text:
            code = ord(char)
            if code == 0 or code == 0xFFFD or _is_control(char):
                continue
            if _is_whitespace(char):
                out.append(" ")
            elif self.chinese_chars and _is_cjk(code):
                out.append(f" {char} ")
            else:
                out.append(char)
        text = "".join(out)
        if self.strip_accents:
            text = "".join(c for c in unicodedata.normalize("NFD", text) if unicodedata.category(c) != "Mn")
        # character by character, as tokenizers does: no final-sigma rule (str.lower() gives 'ς')
        return "".join(c.lower() for c in text) if self.lowercase else text

    def words(self, text):
        """The pre-tokenizer's words of normalised text."""
        words, current = [], []
        for char in text:
            if char.isspace():
                if current:
                    words.append("".join(current))
                    current = []
            elif _is_punctuation(char):
                if current:
                    words.append("".join(current))
                    current = []
                words.append(char)
            else:
                current.append(char)
        if current:
            words.append("".join(current))
        return words

    def word_ids(self, word):
        if len(word) > self.max_chars:
            return [self.unk_id]
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else self.prefix + word[start:end]
                if piece in self.ids:
                    pieces.append(self.ids[piece])
                    break
                end -= 1
            if end == start:
                return [self.unk_id]
            start = end
        return pieces

    def tokenize(self, text):
        """The ids of `text` without the [CLS] and [SEP] around it (a special token spelled in it is
        that token)."""
        ids = []
        for index, part in enumerate(self._specials.split(text)):
            if index % 2:
                ids.append(self.special_ids[part])
            elif part:
                ids.extend(i for word in self.words(self.normalize(part)) for i in self.word_ids(word))
        return ids

    def encode(self, text):
        return [self.cls_id, *self.tokenize(text), self.sep_id]

    def encode_pair(self, first, second):
        """([CLS] first [SEP] second [SEP], token types 0 for the first segment, 1 for the second)."""
        a, b = self.tokenize(first), self.tokenize(second)
        ids = [self.cls_id, *a, self.sep_id, *b, self.sep_id]
        return ids, [0] * (len(a) + 2) + [1] * (len(b) + 1)

    def decode(self, ids):
        text = []
        for i in ids:
            token = self.tokens[i]
            if token.startswith(self.prefix) and text:
                text[-1] += token[len(self.prefix):]
            else:
                text.append(token)
        return " ".join(text)
