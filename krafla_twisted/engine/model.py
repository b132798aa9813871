"""The C engine through ctypes: `Model` (a loaded .mlb and its thread pool) and `Session` (a KV
cache and the forward pass).

Two layers, as in krafla.h: the raw prototypes of the kr_model_* / kr_session_* functions, then
owning classes that free their handle in `close()` (or at the end of a `with` block), raise
`EngineError` (a `clib.KraflaError`) with the C library's message on a bad status, and hand
buffers to C without copies.

    with Model("SmolLM2-135M-Instruct-Q4_0.mlb", threads=2) as model:
        session = model.session(ctx=2048, kv="f16", batch=32)
        logits = session.eval(prompt_ids)      # np.float32 (n_vocab,), of the last token
        rows = session.eval_all(more_ids)      # np.float32 (len(more_ids), n_vocab), of every token
        other = model.session(ctx=2048, kv="f16", batch=32)
        last, _ = model.eval_batch([(session, [next_id], "last"), (other, prompt_ids, "none")])
        session.truncate(10)                   # keep the first 10 positions of the cache

One eval at a time per model: the thread pool belongs to the model, so sessions of one model
must not evaluate concurrently (the C library refuses a second concurrent eval). To serve several
sequences at once, `Model.eval_batch` runs them in the same forward steps (kr_batch_eval), each
getting the bits it gets alone.

Logits come back as numpy arrays unless the caller gives `out` buffers: any writeable float32
buffer of the right shape (a numpy array, or a row of `logits_rows`). numpy is imported only
to make those arrays, so the server, which passes its own rows, runs without it (about 12 MiB
of resident memory, much beside a small model).
"""

import ctypes
import os
import weakref

from krafla_twisted.engine import clib, header
from krafla_twisted.engine.container import ContainerFile, type_name

# kr_status codes this module maps to exception classes.
KR_ERR_ARGUMENT = header.KR_ERR_ARGUMENT
KR_ERR_CONTEXT = header.KR_ERR_CONTEXT
KR_ERR_STATE = header.KR_ERR_STATE

KV_TYPES = {name.lower(): code for name, code in header.members("KR_KV_").items()}
LOGITS_MODES = {name.lower(): code for name, code in header.members("KR_LOGITS_").items()}  # kr_logits_mode


class EngineError(clib.KraflaError):
    """An error from the engine: a bad model file, a bad argument, a closed handle."""


class InvalidTokenError(EngineError, ValueError):
    """A token id outside [0, n_vocab) or another bad argument to eval / truncate."""


class ContextFullError(EngineError, ValueError):
    """The tokens do not fit in the session's context."""


class ClosedError(EngineError):
    """The model or session was closed."""


class kr_model_info(ctypes.Structure):
    _fields_ = [
        ("arch", ctypes.c_char * 16),
        ("name", ctypes.c_char * 128),
        *[(name, ctypes.c_int32) for name in (
            "n_vocab", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_seq",
            "rope_dims", "rope_style", "activation", "tied_embeddings", "sliding_window",
            "n_sliding_layers", "weight_type", "output_type", "n_threads")],
        *[(name, ctypes.c_float) for name in (
            "norm_eps", "rope_theta", "rope_theta_local", "rope_scale", "embedding_scale", "attn_scale",
            "attn_softcap", "final_softcap")],
        ("n_params", ctypes.c_uint64),
        ("n_bytes", ctypes.c_uint64),
    ]


_model_p = ctypes.c_void_p    # opaque kr_model *
_session_p = ctypes.c_void_p  # opaque kr_session *
_error_p = ctypes.POINTER(clib.kr_error)
_int32_p = ctypes.POINTER(ctypes.c_int32)
_float_p = ctypes.POINTER(ctypes.c_float)


class kr_batch_item(ctypes.Structure):
    _fields_ = [
        ("session", _session_p),
        ("tokens", _int32_p),
        ("n_tokens", ctypes.c_int32),
        ("logits", ctypes.c_int32),
        ("logits_out", _float_p),
    ]


@clib.prototypes
def _engine(lib):
    declare = clib.declare
    # kr_model *kr_model_open(const char *path, int32_t n_threads, kr_error *err);
    declare(lib, "kr_model_open", _model_p, ctypes.c_char_p, ctypes.c_int32, _error_p)
    # void kr_model_close(kr_model *model);
    declare(lib, "kr_model_close", None, _model_p)
    # int kr_model_get_info(const kr_model *model, kr_model_info *info, kr_error *err);
    declare(lib, "kr_model_get_info", ctypes.c_int, _model_p, ctypes.POINTER(kr_model_info), _error_p)
    # kr_session *kr_session_new(kr_model *model, int32_t n_ctx, int32_t kv_type, int32_t n_batch, kr_error *err);
    declare(lib, "kr_session_new", _session_p, _model_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, _error_p)
    # void kr_session_free(kr_session *session);
    declare(lib, "kr_session_free", None, _session_p)
    # int kr_session_eval(kr_session *session, const int32_t *tokens, int32_t n, float *logits_out, kr_error *err);
    declare(lib, "kr_session_eval", ctypes.c_int, _session_p, _int32_p, ctypes.c_int32, _float_p, _error_p)
    # int kr_session_eval_all(kr_session *session, const int32_t *tokens, int32_t n, float *logits_out, kr_error *err);
    declare(lib, "kr_session_eval_all", ctypes.c_int, _session_p, _int32_p, ctypes.c_int32, _float_p, _error_p)
    # int kr_weight_type_supported(int32_t type);
    declare(lib, "kr_weight_type_supported", ctypes.c_int, ctypes.c_int32)
    # int kr_session_truncate(kr_session *session, int32_t n_tokens, kr_error *err);
    declare(lib, "kr_session_truncate", ctypes.c_int, _session_p, ctypes.c_int32, _error_p)
    # int kr_session_copy_prefix(kr_session *dst, const kr_session *src, int32_t n_tokens, kr_error *err);
    declare(lib, "kr_session_copy_prefix", ctypes.c_int, _session_p, _session_p, ctypes.c_int32, _error_p)
    # int kr_batch_eval(kr_model *model, const kr_batch_item *items, int32_t n_items, kr_error *err);
    declare(lib, "kr_batch_eval", ctypes.c_int, _model_p, ctypes.POINTER(kr_batch_item), ctypes.c_int32, _error_p)
    # int32_t kr_session_n_tokens(const kr_session *session);  (and n_ctx, n_batch, kv_type)
    for name in ("kr_session_n_tokens", "kr_session_n_ctx", "kr_session_n_batch", "kr_session_kv_type"):
        declare(lib, name, ctypes.c_int32, _session_p)


# The ISA the loaded engine library was built for: "avx512", "avx2" or "generic".
library_isa = clib.loaded_isa


def supported_weight_types():
    """The names ("q4_0", "q4_K", ...) of the weight types the loaded library computes on."""
    lib = clib.load()
    return {type_name(code) for code in range(header.KR_TYPE_COUNT) if lib.kr_weight_type_supported(code)}


def logits_rows(count, n_vocab):
    """`count` new rows of n_vocab float32 logits (memoryviews), one after the other in one buffer:
    `out` for Session.eval and Model.eval_batch without numpy. Given as the "last" rows of one
    eval_batch, they let the output head run once for the whole step."""
    flat = memoryview(bytearray(4 * count * n_vocab)).cast("f")
    return [flat[i * n_vocab:(i + 1) * n_vocab] for i in range(count)]


def logits_blocks(counts, n_vocab):
    """Logits buffers for the items of one eval_batch that want `counts[i]` rows (0: none), one
    after the other in one buffer, so that the output head runs once for the step: for each count
    (out, rows), `out` the eval_batch buffer of that item (a row for 1, the block (count, n_vocab)
    otherwise, None for 0) and `rows` its rows as 1-D memoryviews."""
    flat = memoryview(bytearray(4 * sum(counts) * n_vocab))
    row_bytes = 4 * n_vocab
    blocks, start = [], 0
    for count in counts:
        rows = [flat[(start + i) * row_bytes:(start + i + 1) * row_bytes].cast("f") for i in range(count)]
        if count == 0:
            out = None
        elif count == 1:
            out = rows[0]
        else:
            out = flat[start * row_bytes:(start + count) * row_bytes].cast("f", (count, n_vocab))
        blocks.append((out, rows))
        start += count
    return blocks


def copy_logits(row):
    """A copy of a row of logits (any float32 buffer) in a buffer of its own, as a memoryview."""
    return memoryview(bytearray(row)).cast("f")


def _new_logits(shape):
    """A new float32 numpy array for logits no `out` was given for (numpy is imported here only)."""
    import numpy

    return numpy.empty(shape, dtype=numpy.float32)


def _out_pointer(out, shape, what):
    """A ctypes float array over `out`, or ValueError unless it is a writeable C-contiguous float32
    buffer of `shape` (C writes there)."""
    view = clib.writeable_float32(out)
    if view is None or view.shape != shape:
        raise ValueError(f"{what} must be a writeable C-contiguous float32 array of shape {shape}")
    return clib.float32_array(view)


def _raise(error):
    """Raise the exception class for a failed kr_error."""
    message = error.message.decode("utf-8", "replace") or f"krafla error {error.status}"
    cls = {KR_ERR_ARGUMENT: InvalidTokenError, KR_ERR_CONTEXT: ContextFullError}.get(error.status, EngineError)
    raise cls(message, error.status)


class Model(clib.OwnedHandle):
    """A .mlb model loaded by the C engine, with a pool of `threads` threads.

    `info` is the file's metadata as a dict; `n_vocab`, `max_seq`, `name`, `arch` come from it.
    """

    def __init__(self, path, threads=1, pack=True, pack_cache=False):
        self.path = os.fspath(path)
        if not isinstance(threads, int) or isinstance(threads, bool):
            raise TypeError(f"threads must be an integer, not {type(threads).__name__}")
        self._lib = clib.load()
        error = clib.kr_error()
        handle = self._lib.kr_model_open(os.fsencode(self.path), threads, ctypes.byref(error))
        if not handle:
            _raise(error)
        self._own(handle, self._lib.kr_model_close)
        self._sessions = weakref.WeakSet()
        # speed hook: weight repacking (krafla_twisted/engine/pack.py); pack=False runs on the file's layout
        from krafla_twisted.engine import pack as _pack
        try:
            _pack.apply(self._lib, handle, self.path, pack=pack, pack_cache=pack_cache)
        except BaseException:
            self.close()
            raise
        raw = kr_model_info()
        self._lib.kr_model_get_info(handle, ctypes.byref(raw), None)
        self.threads = threads
        self.n_vocab = raw.n_vocab
        self.max_seq = raw.max_seq
        self.arch = raw.arch.decode()
        self.weight_type = type_name(raw.weight_type)
        self.n_params = raw.n_params
        self.n_layers, self.n_kv_heads, self.head_dim = raw.n_layers, raw.n_kv_heads, raw.head_dim
        self.n_bytes = raw.n_bytes
        with ContainerFile(self.path) as container:
            self.info = dict(container.metadata)
        self.name = self.info.get("name") or os.path.splitext(os.path.basename(self.path))[0]

    def _closed_error(self):
        return ClosedError(f"model {self.path} is closed", KR_ERR_STATE)

    @property
    def handle(self):
        """The kr_model * for other C calls; raises if closed."""
        return self._check_open()

    def session(self, ctx=None, kv="f32", batch=32):
        """A new Session: a KV cache of `ctx` positions (default: the engine's, the model's
        max_seq at most KR_DEFAULT_MAX_CTX) of type `kv` (a KV_TYPES name), evaluating `batch`
        tokens per step."""
        handle = self._check_open()
        if kv not in KV_TYPES:
            raise ValueError(f"KV cache type {kv!r} is not one of {', '.join(KV_TYPES)}")
        if ctx is None:
            ctx = 0  # the engine's default
        elif not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 1:
            raise ValueError(f"context must be a positive integer, not {ctx!r}")
        if not isinstance(batch, int) or batch < 1:
            raise ValueError(f"batch must be a positive integer, not {batch!r}")
        error = clib.kr_error()
        session = self._lib.kr_session_new(handle, ctx, KV_TYPES[kv], batch, ctypes.byref(error))
        if not session:
            _raise(error)
        result = Session(self, session, kv)
        self._sessions.add(result)
        return result

    def eval_batch(self, items):
        """Run several sessions of this model in the same forward steps (kr_batch_eval).

        `items` is a sequence of (session, token_ids, logits) or (session, token_ids, logits, out):
        token_ids are appended to the session as by Session.eval, `logits` is "none" (prefill),
        "last" (the last token's, np.float32 (n_vocab,)) or "all" (every token's,
        (len(token_ids), n_vocab)); `out`, a writeable C-contiguous float32 buffer of that shape,
        receives them instead of a new array (when the items' logits rows lie one after the other in
        memory, as the rows of one array in item order, the output head runs once for all of them
        instead of once per item). Returns one entry per item: None for "none", else
        the logits, each bit for bit what the session gets evaluated alone. A session appears at
        most once; on any error no session changes."""
        handle = self._check_open()
        items = list(items)
        if not items:
            raise InvalidTokenError("eval_batch needs at least one (session, token_ids, logits) item",
                                    KR_ERR_ARGUMENT)
        raw = (kr_batch_item * len(items))()
        keep, results = [], []
        for index, item in enumerate(items):
            if not isinstance(item, (tuple, list)) or len(item) not in (3, 4):
                raise InvalidTokenError(f"item {index}: expected (session, token_ids, logits[, out]), got {item!r}",
                                        KR_ERR_ARGUMENT)
            session, token_ids, mode = item[:3]
            out = item[3] if len(item) == 4 else None
            if not isinstance(session, Session) or session.model is not self:
                raise InvalidTokenError(f"item {index}: {session!r} is not a session of {self!r}", KR_ERR_ARGUMENT)
            if mode not in LOGITS_MODES:
                raise InvalidTokenError(f"item {index}: logits {mode!r} is not one of {', '.join(LOGITS_MODES)}",
                                        KR_ERR_ARGUMENT)
            tokens = session._token_array(token_ids, f"eval_batch item {index}")
            shape = {"none": None, "last": (self.n_vocab,), "all": (len(tokens), self.n_vocab)}[mode]
            if out is None and shape:
                out = _new_logits(shape)
            raw[index].session = session._check_open()
            raw[index].tokens = tokens
            raw[index].n_tokens = len(tokens)
            raw[index].logits = LOGITS_MODES[mode]
            raw[index].logits_out = _out_pointer(out, shape, f"item {index}: out") if out is not None else None
            keep.append(tokens)
            results.append(out)
        error = clib.kr_error()
        if self._lib.kr_batch_eval(handle, raw, len(items), ctypes.byref(error)):
            _raise(error)
        return results

    def close(self):
        """Close every session of this model, then the model. Closing twice is harmless."""
        if self._handle is None:
            return
        for session in list(self._sessions):
            session.close()
        super().close()

    def __repr__(self):
        state = "closed" if self.closed else f"{self.arch}, {self.weight_type}, {self.threads} threads"
        return f"<krafla Model {self.name} ({state})>"


class Session(clib.OwnedHandle):
    """A KV cache over one Model: eval tokens, read the last token's logits, truncate."""

    def __init__(self, model, handle, kv):
        self.model = model
        self._lib = model._lib
        self._own(handle, self._lib.kr_session_free, keep=model)
        self.kv = kv
        self.n_ctx = self._lib.kr_session_n_ctx(handle)
        self.batch = self._lib.kr_session_n_batch(handle)

    def _closed_error(self):
        return ClosedError("session is closed", KR_ERR_STATE)

    @property
    def n_tokens(self):
        """Positions in the KV cache."""
        return self._lib.kr_session_n_tokens(self._check_open())

    @property
    def handle(self):
        """The kr_session * for other C calls (e.g. the sampler); raises if closed."""
        return self._check_open()

    def eval(self, token_ids, logits=True, out=None):
        """Run token_ids (a sequence or numpy array of ints) after the cached ones; return the
        last token's logits as np.float32 (n_vocab,), or None with logits=False (prefill only).
        With `out` (a writeable C-contiguous float32 buffer of n_vocab: a numpy array, a row of
        logits_rows), the logits are written there and `out` is returned instead."""
        handle = self._check_open()
        if logits and out is None:
            out = _new_logits(self.model.n_vocab)
        pointer = _out_pointer(out, (self.model.n_vocab,), "out") if out is not None else None
        tokens = self._token_array(token_ids, "eval")
        error = clib.kr_error()
        status = self._lib.kr_session_eval(handle, tokens, len(tokens), pointer, ctypes.byref(error))
        if status:
            _raise(error)
        return out

    def eval_all(self, token_ids):
        """Run token_ids after the cached ones and return every token's logits as np.float32
        (len(token_ids), n_vocab): row i is what eval gives when token_ids[i] is its last token,
        bit for bit (perplexity and scoring)."""
        handle = self._check_open()
        tokens = self._token_array(token_ids, "eval_all")
        shape = (len(tokens), self.model.n_vocab)
        out = _new_logits(shape)
        error = clib.kr_error()
        status = self._lib.kr_session_eval_all(handle, tokens, len(tokens), _out_pointer(out, shape, "out"),
                                               ctypes.byref(error))
        if status:
            _raise(error)
        return out

    def _token_array(self, token_ids, method):
        """token_ids (a 1-D sequence or buffer of integers) as a ctypes int32 array, or
        InvalidTokenError naming the bad value (the C library checks the vocabulary's range)."""
        shape = getattr(token_ids, "shape", None)
        if shape is not None and len(shape) != 1:
            raise InvalidTokenError(f"{method} needs a non-empty 1-D sequence of token ids, got shape {shape}",
                                    KR_ERR_ARGUMENT)
        try:
            tokens = clib.int32_array(token_ids)
        except (TypeError, OverflowError):
            raise self._bad_token(token_ids) from None
        if not len(tokens):
            raise InvalidTokenError(f"{method} needs a non-empty 1-D sequence of token ids, got none", KR_ERR_ARGUMENT)
        return tokens

    def _bad_token(self, token_ids):
        """The InvalidTokenError for the first id that is not an integer or does not fit int32."""
        try:
            values = list(token_ids)
        except TypeError:
            return InvalidTokenError(f"token ids must be a sequence of integers, not {type(token_ids).__name__}",
                                     KR_ERR_ARGUMENT)
        for index, value in enumerate(values):
            if isinstance(value, bool) or not hasattr(value, "__index__"):
                return InvalidTokenError(f"token ids must be integers, not {type(value).__name__}", KR_ERR_ARGUMENT)
            if not 0 <= value < self.model.n_vocab:
                return InvalidTokenError(f"token id {int(value)} at index {index} is outside [0, {self.model.n_vocab})",
                                         KR_ERR_ARGUMENT)
        return InvalidTokenError("token ids must be integers", KR_ERR_ARGUMENT)

    def truncate(self, n_tokens):
        """Forget every position from n_tokens on (0 <= n_tokens <= self.n_tokens)."""
        handle = self._check_open()
        error = clib.kr_error()
        if self._lib.kr_session_truncate(handle, int(n_tokens), ctypes.byref(error)):
            _raise(error)

    def copy_prefix(self, source, n_tokens):
        """Hold the first n_tokens positions of `source` (another Session of the same model and KV
        type) instead of what this session held: their keys and values are copied, and what is
        evaluated next gives the bits it would after evaluating those tokens here. KraflaError
        (KR_ERR_UNSUPPORTED) for Qwen3.5, whose recurrent state exists only for the last position."""
        handle = self._check_open()
        if not isinstance(source, Session) or source.model is not self.model:
            raise InvalidTokenError(f"{source!r} is not a session of {self.model!r}", KR_ERR_ARGUMENT)
        error = clib.kr_error()
        if self._lib.kr_session_copy_prefix(handle, source._check_open(), int(n_tokens), ctypes.byref(error)):
            _raise(error)

    def __repr__(self):
        if self.closed:
            return "<krafla Session (closed)>"
        return f"<krafla Session {self.n_tokens}/{self.n_ctx} tokens, kv {self.kv}, batch {self.batch}>"
