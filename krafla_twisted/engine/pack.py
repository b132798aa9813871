"""Weight repacking at load (engine_c/src/model/pack.c), for `Model(path, pack=..., pack_cache=...)`.

`pack=True` copies every q8_0/q4_0/k-quant matrix into the packed layout the AVX2 tiles read as one stream
(the same results bit for bit); `pack_cache=True` keeps that copy in MODEL.mlb.pack, keyed by the
model's checksum, the ISA and the layout version, and maps it on the next load; a stale or corrupt
cache is rebuilt, never trusted. `status(model)` says what happened; `warning(model)` is the line to
log when a cache was asked for and could not be written (the model then runs packed in memory).
"""

import ctypes
import os

from krafla_twisted.engine import clib, header

PACK_OFF, PACK_ON, PACK_CACHE = header.KR_PACK_OFF, header.KR_PACK_ON, header.KR_PACK_CACHE
# kr_pack_status
NOT_PACKED, PACKED_IN_MEMORY = header.KR_PACK_STATUS_NONE, header.KR_PACK_STATUS_MEMORY
CACHE_MAPPED, CACHE_BUILT = header.KR_PACK_STATUS_CACHE_MAPPED, header.KR_PACK_STATUS_CACHE_BUILT
CACHE_FAILED = header.KR_PACK_STATUS_CACHE_FAILED
STATUS_NAMES = {NOT_PACKED: "not packed", PACKED_IN_MEMORY: "packed in memory", CACHE_MAPPED: "cache mapped",
                CACHE_BUILT: "cache rebuilt", CACHE_FAILED: "cache not written, packed in memory"}


@clib.prototypes
def _pack(lib):
    # int kr_model_pack(kr_model *model, int32_t mode, const char *cache_path, kr_error *err);
    clib.declare(lib, "kr_model_pack", ctypes.c_int, ctypes.c_void_p, ctypes.c_int32, ctypes.c_char_p,
                 ctypes.POINTER(clib.kr_error))
    # int32_t kr_model_pack_status(const kr_model *model, char *note, size_t size);
    clib.declare(lib, "kr_model_pack_status", ctypes.c_int32, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t)


def cache_path(model_path):
    """Where the packed-weight cache of a model lives: beside it."""
    return os.fspath(model_path) + ".pack"


def apply(lib, handle, model_path, pack=True, pack_cache=False):
    """Pack a freshly opened model's weights (before any session). Raises clib.KraflaError."""
    if pack_cache and not pack:
        raise ValueError("--pack-cache (pack_cache) keeps packed weights: it cannot go with --no-pack (pack=False)")
    mode = PACK_CACHE if pack_cache else PACK_ON if pack else PACK_OFF
    path = os.fsencode(cache_path(model_path)) if pack_cache else None
    error = clib.kr_error()
    lib.kr_model_pack(handle, mode, path, ctypes.byref(error))
    error.check()


def status(model):
    """(code, note) of what packing did for `model` (an engine.Model): see STATUS_NAMES."""
    note = ctypes.create_string_buffer(512)
    code = model._lib.kr_model_pack_status(model.handle, note, len(note))
    return code, note.value.decode("utf-8", "replace")


def warning(model):
    """The line to log when --pack-cache could not write the cache (naming why), else None."""
    code, note = status(model)
    if code != CACHE_FAILED:
        return None
    return f"--pack-cache: {note} (the model runs, and packs again at the next start)"
