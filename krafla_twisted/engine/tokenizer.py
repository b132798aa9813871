"""The tokenizer: ctypes bindings for engine_c/src/tokenizer/tokenizer.c and the `Tokenizer` class.

    tok = Tokenizer("SmolLM2-135M-Instruct-Q4_0.mlt")
    ids = tok.encode("Hello")                 # plain text: "<|im_start|>" stays text
    ids = tok.encode("<|im_start|>", special=True)  # control-token spellings become tokens
    tok.decode(ids) -> bytes

Text may be `str` (encoded as UTF-8; a lone surrogate becomes U+FFFD) or `bytes` (passed as
they are: NUL and invalid UTF-8 bytes are kept and round-trip through the byte tokens).
A Tokenizer is immutable once open; any thread may use it.
"""

import codecs
import ctypes


from krafla_twisted.engine import clib, header

KIND_BPE, KIND_SPM = 1, 2  # kr_tokenizer_info.kind
# kr_token_type
NORMAL, UNKNOWN, CONTROL = header.KR_TOKEN_NORMAL, header.KR_TOKEN_UNKNOWN, header.KR_TOKEN_CONTROL
USER_DEFINED, UNUSED, BYTE = header.KR_TOKEN_USER_DEFINED, header.KR_TOKEN_UNUSED, header.KR_TOKEN_BYTE


class kr_tokenizer_info(ctypes.Structure):
    _fields_ = [
        ("n_vocab", ctypes.c_int32),
        ("kind", ctypes.c_int32),
        ("bos_id", ctypes.c_int32),
        ("eos_id", ctypes.c_int32),
        ("unk_id", ctypes.c_int32),
        ("pad_id", ctypes.c_int32),
        ("add_bos", ctypes.c_int32),
        ("add_eos", ctypes.c_int32),
        ("add_space_prefix", ctypes.c_int32),
        ("n_eot", ctypes.c_int32),
        ("pre", ctypes.c_char * 16),
    ]


_ERR = ctypes.POINTER(clib.kr_error)
_I32P = ctypes.POINTER(ctypes.c_int32)
_I64P = ctypes.POINTER(ctypes.c_int64)


@clib.prototypes
def _declare(lib):
    declare = clib.declare
    # kr_tokenizer *kr_tokenizer_open(const char *path, kr_error *err);
    declare(lib, "kr_tokenizer_open", ctypes.c_void_p, ctypes.c_char_p, _ERR)
    # void kr_tokenizer_close(kr_tokenizer *tok);
    declare(lib, "kr_tokenizer_close", None, ctypes.c_void_p)
    # int kr_tokenizer_get_info(const kr_tokenizer *tok, kr_tokenizer_info *info, kr_error *err);
    declare(lib, "kr_tokenizer_get_info", ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(kr_tokenizer_info), _ERR)
    # int32_t kr_tokenizer_eot_ids(const kr_tokenizer *tok, int32_t *ids, int32_t capacity);
    declare(lib, "kr_tokenizer_eot_ids", ctypes.c_int32, ctypes.c_void_p, _I32P, ctypes.c_int32)
    # int kr_tokenizer_is_eot(const kr_tokenizer *tok, int32_t id);
    declare(lib, "kr_tokenizer_is_eot", ctypes.c_int, ctypes.c_void_p, ctypes.c_int32)
    # int kr_tokenizer_encode(const kr_tokenizer *tok, const char *text, int64_t n_text, int32_t add_bos,
    #                         int32_t add_eos, int32_t special, int32_t *tokens, int64_t capacity,
    #                         int64_t *n_tokens, kr_error *err);
    declare(lib, "kr_tokenizer_encode", ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64, ctypes.c_int32,
            ctypes.c_int32, ctypes.c_int32, _I32P, ctypes.c_int64, _I64P, _ERR)
    # int kr_tokenizer_decode(const kr_tokenizer *tok, const int32_t *ids, int64_t n_ids, int32_t special,
    #                         char *out, int64_t capacity, int64_t *n_bytes, kr_error *err);
    declare(lib, "kr_tokenizer_decode", ctypes.c_int, ctypes.c_void_p, _I32P, ctypes.c_int64, ctypes.c_int32,
            ctypes.c_char_p, ctypes.c_int64, _I64P, _ERR)
    # const char *kr_tokenizer_token_piece(const kr_tokenizer *tok, int32_t id, int64_t *length);
    declare(lib, "kr_tokenizer_token_piece", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, _I64P)
    # const char *kr_tokenizer_token_text(const kr_tokenizer *tok, int32_t id, int64_t *length);
    declare(lib, "kr_tokenizer_token_text", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int32, _I64P)
    # int32_t kr_tokenizer_find(const kr_tokenizer *tok, const char *text, int64_t n_text);
    declare(lib, "kr_tokenizer_find", ctypes.c_int32, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64)
    # int32_t kr_tokenizer_token_type(const kr_tokenizer *tok, int32_t id);
    declare(lib, "kr_tokenizer_token_type", ctypes.c_int32, ctypes.c_void_p, ctypes.c_int32)
    # int kr_tokenizer_pretokenize(const kr_tokenizer *tok, const char *text, int64_t n_text, int64_t *ends,
    #                              int64_t capacity, int64_t *n_words, kr_error *err);
    declare(lib, "kr_tokenizer_pretokenize", ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64, _I64P,
            ctypes.c_int64, _I64P, _ERR)
    # int32_t kr_unicode_class(uint32_t codepoint);
    declare(lib, "kr_unicode_class", ctypes.c_int32, ctypes.c_uint32)


def _text_bytes(text):
    if isinstance(text, (bytes, bytearray, memoryview)):
        return bytes(text)
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates (e.g. from JSON "\ud800") become U+FFFD
        return text.encode("utf-16-le", "surrogatepass").decode("utf-16-le", "replace").encode("utf-8")


def _tristate(flag):
    return -1 if flag is None else int(bool(flag))


class Tokenizer(clib.OwnedHandle):
    """A .mlt tokenizer (byte-level BPE or SentencePiece), per docs/formats.md."""

    def __init__(self, mlt_path):
        self._lib = clib.load()
        self.path = str(mlt_path)
        err = clib.kr_error()
        handle = self._lib.kr_tokenizer_open(self.path.encode(), ctypes.byref(err))
        if not handle:
            err.check(err.status or 1)
        self._own(handle, self._lib.kr_tokenizer_close)
        info = kr_tokenizer_info()
        err.check(self._lib.kr_tokenizer_get_info(handle, ctypes.byref(info), ctypes.byref(err)))
        self.n_vocab = info.n_vocab
        self.kind = "bpe" if info.kind == KIND_BPE else "spm"
        self.pre = info.pre.decode()
        self.bos_id = info.bos_id if info.bos_id >= 0 else None
        self.eos_id = info.eos_id if info.eos_id >= 0 else None
        self.unk_id = info.unk_id if info.unk_id >= 0 else None
        self.add_bos = bool(info.add_bos)
        self.add_eos = bool(info.add_eos)
        self.add_space_prefix = bool(info.add_space_prefix)
        eot = (ctypes.c_int32 * max(info.n_eot, 1))()
        self._lib.kr_tokenizer_eot_ids(handle, eot, info.n_eot)
        self.eot_ids = frozenset(eot[:info.n_eot])

    def _closed_error(self):
        return clib.KraflaError(f"{self.path}: tokenizer is closed", clib.KR_ERR_STATE)

    def encode(self, text, add_bos=None, special=False, add_eos=None):
        """Token ids of `text`. add_bos/add_eos None: as the file says. special=True lets exact
        control-token spellings become those tokens; with False they are plain text."""
        data = _text_bytes(text)
        handle = self._check_open()
        err = clib.kr_error()
        count = ctypes.c_int64()
        capacity = len(data) + 8
        while True:
            out = (ctypes.c_int32 * capacity)()
            status = self._lib.kr_tokenizer_encode(
                handle, data, len(data), _tristate(add_bos), _tristate(add_eos), int(bool(special)),
                out, capacity, ctypes.byref(count), ctypes.byref(err))
            err.check(status)
            if count.value <= capacity:
                return out[:count.value]
            capacity = count.value

    def decode(self, ids, special=False):
        """The bytes of `ids`; control tokens give nothing unless special=True."""
        handle = self._check_open()
        try:
            array = clib.int32_array(ids)
        except OverflowError:
            raise ValueError(f"token id out of range for this vocabulary of {self.n_vocab}") from None
        err = clib.kr_error()
        size = ctypes.c_int64()
        capacity = 16 * len(array) + 16
        while True:
            out = ctypes.create_string_buffer(capacity)
            status = self._lib.kr_tokenizer_decode(handle, array, len(array), int(bool(special)),
                                                   out, capacity, ctypes.byref(size), ctypes.byref(err))
            if status:
                raise ValueError(err.message.decode("utf-8", "replace"))
            if size.value <= capacity:
                return out.raw[:size.value]
            capacity = size.value

    def _string(self, function, token_id):
        length = ctypes.c_int64()
        if not 0 <= token_id < self.n_vocab:
            raise ValueError(f"token id {token_id} is outside the vocabulary of {self.n_vocab}")
        pointer = function(self._check_open(), token_id, ctypes.byref(length))
        return ctypes.string_at(pointer, length.value)

    def token_bytes(self, token_id):
        """What the token stands for (a control token: its spelling, e.g. b'<|im_end|>')."""
        return self._string(self._lib.kr_tokenizer_token_piece, token_id)

    def token_text(self, token_id):
        """The token as the vocabulary spells it (GPT-2 byte alphabet, or U+2581 for spaces)."""
        return self._string(self._lib.kr_tokenizer_token_text, token_id)

    def token_type(self, token_id):
        """GGUF token type: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte."""
        return self._lib.kr_tokenizer_token_type(self._check_open(), token_id)

    def is_control(self, token_id):
        return self.token_type(token_id) in (CONTROL, UNKNOWN)

    def token_id(self, text):
        """The id of the vocabulary entry spelled exactly `text` (for special tokens such as
        "<|im_start|>"), or None."""
        data = _text_bytes(text)
        token = self._lib.kr_tokenizer_find(self._check_open(), data, len(data))
        return token if token >= 0 else None

    def pretokenize(self, text):
        """The pre-tokens of `text` (BPE split rules only, no special tokens), as bytes."""
        data = _text_bytes(text)
        err = clib.kr_error()
        count = ctypes.c_int64()
        capacity = len(data) + 1
        ends = (ctypes.c_int64 * capacity)()
        err.check(self._lib.kr_tokenizer_pretokenize(self._check_open(), data, len(data), ends, capacity,
                                                     ctypes.byref(count), ctypes.byref(err)))
        starts = [0] + ends[:count.value - 1]
        return [data[a:b] for a, b in zip(starts, ends[:count.value])]

    def streaming_decoder(self, special=False):
        return StreamingDecoder(self, special)


class StreamingDecoder:
    """Turns tokens into text one at a time: `push` returns only whole UTF-8 characters (a
    character split across tokens waits for its last byte); invalid bytes become U+FFFD."""

    def __init__(self, tokenizer, special=False):
        self._tokenizer = tokenizer
        self._special = special
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id):
        return self._utf8.decode(self._tokenizer.decode([token_id], special=self._special))

    def flush(self):
        """Whatever is held back: an unfinished character at the end becomes U+FFFD."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


def unicode_class(codepoint):
    """Class bits the pre-tokenizers give a codepoint: 1 letter, 2 number, 4 mark, 8 space,
    16 upper-case letter (Lu, Lt), 32 lower-case letter (Ll)."""
    return clib.load().kr_unicode_class(codepoint & 0xFFFFFFFF)
