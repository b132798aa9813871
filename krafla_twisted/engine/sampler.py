"""ctypes bindings for the sampler section of krafla.h (engine_c/src/sampler/sampler.c).

`Sampler(params, n_vocab)` owns a kr_sampler: `.sample(logits, history)` returns the next token id.
`logprobs(logits, token, top)` and `mask_logits(logits, allowed)` are the rest of what a reply
does with a row of logits. The raw prototypes come first, then the owning class.
"""

import ctypes

from krafla_twisted.engine import clib


class kr_sampler_params(ctypes.Structure):
    _fields_ = [
        ("temperature", ctypes.c_float),
        ("top_p", ctypes.c_float),
        ("top_k", ctypes.c_int32),
        ("repeat_penalty", ctypes.c_float),
        ("repeat_last_n", ctypes.c_int32),
        ("seed", ctypes.c_uint64),
        ("frequency_penalty", ctypes.c_float),
        ("presence_penalty", ctypes.c_float),
        ("min_p", ctypes.c_float),
    ]


_float_p = ctypes.POINTER(ctypes.c_float)
_double_p = ctypes.POINTER(ctypes.c_double)
_int32_p = ctypes.POINTER(ctypes.c_int32)
_uint32_p = ctypes.POINTER(ctypes.c_uint32)
_error_p = ctypes.POINTER(clib.kr_error)


@clib.prototypes
def _sampler(lib):
    # kr_sampler *kr_sampler_new(const kr_sampler_params *params, int32_t n_vocab, kr_error *err);
    clib.declare(lib, "kr_sampler_new", ctypes.c_void_p, ctypes.POINTER(kr_sampler_params), ctypes.c_int32, _error_p)
    # void kr_sampler_free(kr_sampler *sampler);
    clib.declare(lib, "kr_sampler_free", None, ctypes.c_void_p)
    # int kr_sampler_sample(kr_sampler *sampler, const float *logits, int32_t n_logits,
    #                       const int32_t *history, int32_t n_history, int32_t *token_out, kr_error *err);
    clib.declare(lib, "kr_sampler_sample", ctypes.c_int, ctypes.c_void_p, _float_p, ctypes.c_int32, _int32_p,
                 ctypes.c_int32, _int32_p, _error_p)
    # int kr_sampler_reseed(kr_sampler *sampler, uint64_t seed, kr_error *err);
    clib.declare(lib, "kr_sampler_reseed", ctypes.c_int, ctypes.c_void_p, ctypes.c_uint64, _error_p)
    # int kr_logprobs(const float *logits, int32_t n, int32_t token, int32_t top, int32_t *top_ids,
    #                 double *top_logprobs, double *token_logprob, kr_error *err);
    clib.declare(lib, "kr_logprobs", ctypes.c_int, _float_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, _int32_p,
                 _double_p, _double_p, _error_p)
    # int kr_logits_mask(float *logits, int32_t n, const uint32_t *allowed, kr_error *err);
    clib.declare(lib, "kr_logits_mask", ctypes.c_int, _float_p, ctypes.c_int32, _uint32_p, _error_p)


SEED_MODULUS = 2**64


class Sampler(clib.OwnedHandle):
    """Chooses tokens from logits with one seeded random stream; see krafla.h for the rules.

    `params` is anything with temperature, top_p, top_k, repeat_penalty, repeat_last_n, seed,
    frequency_penalty, presence_penalty and min_p attributes (generate.SamplingParams); seed must be an int here (the caller picks one for None).
    A bad value raises clib.KraflaError with the C library's message.
    """

    def __init__(self, params, n_vocab):
        self._lib = clib.load()
        raw = kr_sampler_params(
            temperature=float(params.temperature),
            top_p=float(params.top_p),
            top_k=_int32(params.top_k, "top_k"),
            repeat_penalty=float(params.repeat_penalty),
            repeat_last_n=_int32(params.repeat_last_n, "repeat_last_n"),
            seed=int(params.seed) % SEED_MODULUS,
            frequency_penalty=float(params.frequency_penalty),
            presence_penalty=float(params.presence_penalty),
            min_p=float(params.min_p),
        )
        err = clib.kr_error()
        handle = self._lib.kr_sampler_new(ctypes.byref(raw), _int32(n_vocab, "n_vocab"), ctypes.byref(err))
        if not handle:
            err.check()
            raise clib.KraflaError("kr_sampler_new failed without a message")
        self._own(handle, self._lib.kr_sampler_free)
        self.n_vocab = int(n_vocab)

    def sample(self, logits, history=()):
        """The next token id for `logits` (n_vocab floats) after `history` (token ids, oldest first)."""
        handle = self._check_open()
        row = clib.float32_row(logits)
        history = clib.int32_array(history)
        token = ctypes.c_int32(-1)
        err = clib.kr_error()
        status = self._lib.kr_sampler_sample(handle, row, len(row), history, len(history), ctypes.byref(token),
                                             ctypes.byref(err))
        err.check(status)
        return token.value

    def reseed(self, seed):
        err = clib.kr_error()
        err.check(self._lib.kr_sampler_reseed(self._check_open(), int(seed) % SEED_MODULUS, ctypes.byref(err)))

    def _closed_error(self):
        return clib.KraflaError("sampler is closed", clib.KR_ERR_STATE)


def logprobs(logits, token, top):
    """The log-softmax of `logits` (a row of n_vocab floats) at `token`, and the `top` most likely
    tokens best first (ties to the lower id): (logprob, ((id, logprob), ...)), in double precision."""
    row = clib.float32_row(logits)
    top = min(int(top), len(row))
    ids, values, value = (ctypes.c_int32 * top)(), (ctypes.c_double * top)(), ctypes.c_double()
    err = clib.kr_error()
    err.check(clib.load().kr_logprobs(row, len(row), _int32(token, "token"), top, ids, values, ctypes.byref(value),
                                      ctypes.byref(err)))
    return value.value, tuple(zip(ids, values))


def mask_logits(logits, allowed):
    """Set to -inf, in place, the logits of every token whose bit in `allowed` (a ctypes uint32
    array, token i at bit i % 32 of word i // 32) is clear; returns `logits`."""
    row = clib.float32_row(logits, copy=False)
    if len(allowed) * 32 < len(row):
        raise ValueError(f"a mask of {len(allowed) * 32} bits for {len(row)} logits")
    err = clib.kr_error()
    err.check(clib.load().kr_logits_mask(row, len(row), allowed, ctypes.byref(err)))
    return logits


def _int32(value, name):
    value = int(value)
    if not -2**31 <= value < 2**31:
        raise ValueError(f"{name} {value} does not fit a 32-bit integer")
    return value
