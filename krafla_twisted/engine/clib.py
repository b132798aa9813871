"""Finding and loading libkrafla.so, and the pieces of krafla.h every binding shares.

The build makes one library per ISA (build/<isa>/libkrafla.so; `pip install .` ships all three
as krafla_twisted/_native/<isa>/libkrafla.so) and the best one this CPU runs is loaded: avx512
(AVX-512 F/BW/VL and VNNI), else avx2 (AVX2, FMA, F16C), else generic. The library is looked for,
in order: $KRAFLA_LIB (a path, taken as it is); else for the ISA $KRAFLA_ISA names (an error if
the name is unknown or this CPU lacks it), or the best this CPU runs: the build tree next to the
sources, then the copy inside the package. Without $KRAFLA_ISA, an ISA whose library is missing
(a tree where only `make build/avx2/libkrafla.so` was run) falls back to the next best that is there.
"""

import array
import ctypes
import os
import threading
import weakref

from krafla_twisted.engine import header

# krafla_twisted/, one level above this engine/ folder: _native/ sits in it, the source tree above it.
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE_ROOT = os.path.dirname(PACKAGE_DIR)

KR_OK = header.KR_OK
KR_ERR_STATE = header.KR_ERR_STATE
KR_ERROR_MESSAGE_SIZE = header.KR_ERROR_MESSAGE_SIZE


class KraflaError(Exception):
    """An error reported by the C library: `status` is its kr_status code."""

    def __init__(self, message, status=0):
        super().__init__(message)
        self.status = status


class kr_error(ctypes.Structure):
    _fields_ = [("status", ctypes.c_int32), ("message", ctypes.c_char * KR_ERROR_MESSAGE_SIZE)]

    def check(self, status=None):
        """Raise KraflaError if the call failed (by its status return or by this struct)."""
        code = self.status if status is None or status == KR_OK else status
        if code != KR_OK:
            raise KraflaError(self.message.decode("utf-8", "replace") or f"krafla error {code}", code)


# What each ISA's library needs from the CPU (/proc/cpuinfo flag names), best first.
ISA_FLAGS = {
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    "avx2": ("avx2", "fma", "f16c"),
    "generic": (),
}


def cpu_flags():
    """The CPU's feature flags from /proc/cpuinfo (empty when it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


def cpu_isa(flags=None):
    """The best ISA this CPU runs (or the one with these flags): avx512, avx2 or generic."""
    flags = cpu_flags() if flags is None else set(flags)
    return next(isa for isa, needed in ISA_FLAGS.items() if flags.issuperset(needed))


def check_isa(isa, flags=None):
    """KraflaError unless `isa` is a known ISA this CPU (or these flags) runs."""
    if isa not in ISA_FLAGS:
        raise KraflaError(f"KRAFLA_ISA={isa!r} is not one of {', '.join(ISA_FLAGS)}")
    flags = cpu_flags() if flags is None else set(flags)
    missing = [flag for flag in ISA_FLAGS[isa] if flag not in flags]
    if missing:
        raise KraflaError(f"KRAFLA_ISA={isa}: this CPU lacks {', '.join(missing)} "
                          f"(the best it runs is {cpu_isa(flags)})")


def _candidates(isa):
    return [os.path.join(SOURCE_ROOT, "build", isa, "libkrafla.so"),
            os.path.join(PACKAGE_DIR, "_native", isa, "libkrafla.so")]


def library_path(isa=None):
    """The library to load: $KRAFLA_LIB, else the one of `isa` (or $KRAFLA_ISA, or the best this
    CPU runs); KraflaError naming what was looked for when there is none."""
    if os.environ.get("KRAFLA_LIB"):
        path = os.environ["KRAFLA_LIB"]
        if not os.path.exists(path):
            raise KraflaError(f"KRAFLA_LIB={path}: no such file")
        return path
    chosen = isa or os.environ.get("KRAFLA_ISA")
    if chosen:
        check_isa(chosen)
        order = [chosen]
    else:
        isas = list(ISA_FLAGS)
        order = isas[isas.index(cpu_isa()):]
    candidates = [path for name in order for path in _candidates(name)]
    for path in candidates:
        if os.path.exists(path):
            return path
    raise KraflaError(f"libkrafla.so not found (looked in {', '.join(candidates)}); run `make lib` first")


def loaded_isa():
    """The ISA of the library `load()` gives (its kr_isa())."""
    return load().kr_isa().decode("ascii")


class OwnedHandle:
    """Owns one C handle, freed exactly once: by close(), on leaving a `with` block, or when the
    object is collected. A subclass calls `_own(handle, free)` once its C call succeeded and
    names itself in `_closed_error` for calls made after close(). `keep`, the object whose handle
    this one's uses (a session's model), is held by the finalizer: when both are collected at once
    (a reference cycle), this handle is freed before that one, never after."""

    _handle = None

    def _own(self, handle, free, keep=None):
        self._handle = handle
        self._finalizer = weakref.finalize(self, _free_before, free, handle, keep)

    def _closed_error(self):
        return KraflaError(f"{type(self).__name__} is closed", KR_ERR_STATE)

    @property
    def closed(self):
        return self._handle is None

    def _check_open(self):
        """The live handle, or the subclass's closed error."""
        if self._handle is None:
            raise self._closed_error()
        return self._handle

    def close(self):
        """Free the C handle; closing twice is harmless."""
        if self._handle is not None:
            self._handle = None
            self._finalizer()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _free_before(free, handle, _kept):
    # _kept is only held: weakref.finalize keeps its arguments alive until the call
    free(handle)


_lock = threading.Lock()
_libraries = {}


def load(isa=None):
    """The loaded library (one per path), with every prototype in `_PROTOTYPES` declared."""
    path = library_path(isa)
    with _lock:
        if path not in _libraries:
            lib = ctypes.CDLL(path)
            for declare in _declarers:
                declare(lib)
            _libraries[path] = lib
        return _libraries[path]


_declarers = []


def prototypes(declare):
    """Register a function that sets argtypes/restype on the library; each binding module has one."""
    _declarers.append(declare)
    for lib in _libraries.values():
        declare(lib)
    return declare


def declare(lib, name, restype, *argtypes):
    function = getattr(lib, name)
    function.restype = restype
    function.argtypes = list(argtypes)


# Rows of floats and arrays of token ids go to C as buffers (the buffer protocol), not as numpy
# arrays: numpy arrays are such buffers, and the server, which never needs numpy, passes
# memoryviews and array.array instead (see engine.logits_rows).


def writeable_float32(values):
    """A memoryview of `values` when it is a writeable C-contiguous float32 buffer (a numpy array,
    a memoryview of one, an array.array('f')), which C may write in place; else None."""
    try:
        view = memoryview(values)
    except TypeError:
        return None
    if view.format not in ("f", "<f", "=f") or not view.c_contiguous or view.readonly:
        return None
    return view


def float32_array(view):
    """A ctypes float array over the memory of `view` (from writeable_float32)."""
    return (ctypes.c_float * (view.nbytes // 4)).from_buffer(view)


def float32_row(values, name="logits", copy=True):
    """`values` as a ctypes float array over the same memory when it is a writeable, C-contiguous
    1-D float32 buffer: C reads and writes in place. Any other sequence of numbers is copied
    (ValueError instead with copy=False); more than one dimension is ValueError."""
    shape = getattr(values, "shape", None)
    if shape is not None and len(shape) != 1:
        raise ValueError(f"{name} must be one row, got shape {shape}")
    view = writeable_float32(values)
    if view is None:
        if not copy:
            raise ValueError(f"{name} must be a writeable C-contiguous row of float32")
        view = memoryview(array.array("f", values))
    return float32_array(view)


def int32_array(values):
    """`values` (a sequence or a buffer of integers) as a new ctypes int32 array; OverflowError
    for a value outside int32, TypeError for one that is not an integer."""
    ids = array.array("i", values)
    return (ctypes.c_int32 * len(ids)).from_buffer(ids)


@prototypes
def _common(lib):
    # const char *kr_version(void); const char *kr_isa(void);
    declare(lib, "kr_version", ctypes.c_char_p)
    declare(lib, "kr_isa", ctypes.c_char_p)
