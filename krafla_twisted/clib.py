"""Finding and loading libkrafla.so, and the pieces of krafla.h every binding shares.

The library is looked for, in order: $KRAFLA_LIB; the copy `pip install .` puts inside the
package (krafla_twisted/_native/libkrafla.so); the build tree next to the sources
(build/<isa>/libkrafla.so), where <isa> is $KRAFLA_ISA or the best this CPU runs.
"""

import ctypes
import os
import threading
import weakref

from krafla_twisted import header

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
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


def cpu_isa():
    """The best ISA this CPU runs: avx512, avx2 or generic."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return "generic"
    if all(flag in flags for flag in ("avx2", "fma", "f16c")):
        return "avx2"
    return "generic"


def library_path(isa=None):
    isa = isa or os.environ.get("KRAFLA_ISA") or cpu_isa()
    candidates = []
    if os.environ.get("KRAFLA_LIB"):
        candidates.append(os.environ["KRAFLA_LIB"])
    candidates.append(os.path.join(SOURCE_ROOT, "build", isa, "libkrafla.so"))
    candidates.append(os.path.join(PACKAGE_DIR, "_native", "libkrafla.so"))
    for path in candidates:
        if os.path.exists(path):
            return path
    raise KraflaError(f"libkrafla.so not found (looked in {', '.join(candidates)}); run `make` first")


class OwnedHandle:
    """Owns one C handle, freed exactly once: by close(), on leaving a `with` block, or when the
    object is collected. A subclass calls `_own(handle, free)` once its C call succeeded and
    names itself in `_closed_error` for calls made after close()."""

    _handle = None

    def _own(self, handle, free):
        self._handle = handle
        self._finalizer = weakref.finalize(self, free, handle)

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


@prototypes
def _common(lib):
    # const char *kr_version(void); const char *kr_isa(void);
    declare(lib, "kr_version", ctypes.c_char_p)
    declare(lib, "kr_isa", ctypes.c_char_p)
