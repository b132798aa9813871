"""The C container loader (engine_c/src/format/file.c) through ctypes.

Two layers, as in krafla.h: the raw prototypes of the kr_file_* functions, then
`ContainerFile`, which owns one opened file, reads its metadata and tensor table into Python
values once, and closes it in `close()` (or at the end of a `with` block).

The C loader validates the whole file when it opens it, so everything here comes from a file
that passed those checks; a file that does not raises `clib.KraflaError` with the C message,
which names the file and the problem.
"""

import ctypes
import os

from krafla_twisted.engine import clib, header

MODEL_MAGIC = header.KR_MODEL_MAGIC.encode("ascii")
TOKENIZER_MAGIC = header.KR_TOKENIZER_MAGIC.encode("ascii")
MAX_DIMS = header.KR_MAX_DIMS

# kr_meta_kind
META_INT, META_FLOAT, META_STR = header.KR_META_INT, header.KR_META_FLOAT, header.KR_META_STR
META_INTS, META_FLOATS = header.KR_META_INTS, header.KR_META_FLOATS


class kr_tensor_info(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("type", ctypes.c_int32),
        ("n_dims", ctypes.c_int32),
        ("dims", ctypes.c_uint64 * MAX_DIMS),
        ("n_elements", ctypes.c_uint64),
        ("n_bytes", ctypes.c_uint64),
        ("data", ctypes.c_void_p),
    ]


kr_file_p = ctypes.c_void_p  # opaque kr_file *
_error_p = ctypes.POINTER(clib.kr_error)


@clib.prototypes
def _container(lib):
    declare = clib.declare
    # kr_file *kr_file_open(const char *path, const char *magic, kr_error *err);
    declare(lib, "kr_file_open", kr_file_p, ctypes.c_char_p, ctypes.c_char_p, _error_p)
    # void kr_file_close(kr_file *file);
    declare(lib, "kr_file_close", None, kr_file_p)
    # const char *kr_file_magic(const kr_file *file);  (8 chars, not NUL-terminated)
    declare(lib, "kr_file_magic", ctypes.c_void_p, kr_file_p)
    # uint64_t kr_file_size(const kr_file *file);
    declare(lib, "kr_file_size", ctypes.c_uint64, kr_file_p)
    # int32_t kr_file_n_meta(const kr_file *file);
    declare(lib, "kr_file_n_meta", ctypes.c_int32, kr_file_p)
    # int32_t kr_file_n_tensors(const kr_file *file);
    declare(lib, "kr_file_n_tensors", ctypes.c_int32, kr_file_p)
    # int kr_file_meta(const kr_file *file, int32_t index, const char **key, int32_t *kind,
    #                  int64_t *int_value, double *float_value, const char **str_value,
    #                  uint32_t *str_length_or_count, kr_error *err);
    declare(lib, "kr_file_meta", ctypes.c_int, kr_file_p, ctypes.c_int32, ctypes.POINTER(ctypes.c_char_p),
            ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_double),
            ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint32), _error_p)
    # int64_t kr_file_meta_int_at(const kr_file *file, int32_t index, uint32_t element);
    declare(lib, "kr_file_meta_int_at", ctypes.c_int64, kr_file_p, ctypes.c_int32, ctypes.c_uint32)
    # double kr_file_meta_float_at(const kr_file *file, int32_t index, uint32_t element);
    declare(lib, "kr_file_meta_float_at", ctypes.c_double, kr_file_p, ctypes.c_int32, ctypes.c_uint32)
    # int kr_file_meta_array(const kr_file *file, int32_t index, void *out, uint32_t count, kr_error *err);
    declare(lib, "kr_file_meta_array", ctypes.c_int, kr_file_p, ctypes.c_int32, ctypes.c_void_p, ctypes.c_uint32,
            _error_p)
    # int32_t kr_file_find_meta(const kr_file *file, const char *key);
    declare(lib, "kr_file_find_meta", ctypes.c_int32, kr_file_p, ctypes.c_char_p)
    # int kr_file_get_int(const kr_file *file, const char *key, int64_t fallback, int64_t *out, kr_error *err);
    declare(lib, "kr_file_get_int", ctypes.c_int, kr_file_p, ctypes.c_char_p, ctypes.c_int64,
            ctypes.POINTER(ctypes.c_int64), _error_p)
    # int kr_file_get_float(const kr_file *file, const char *key, double fallback, double *out, kr_error *err);
    declare(lib, "kr_file_get_float", ctypes.c_int, kr_file_p, ctypes.c_char_p, ctypes.c_double,
            ctypes.POINTER(ctypes.c_double), _error_p)
    # int kr_file_get_str(const kr_file *file, const char *key, const char *fallback, const char **out,
    #                     kr_error *err);
    declare(lib, "kr_file_get_str", ctypes.c_int, kr_file_p, ctypes.c_char_p, ctypes.c_char_p,
            ctypes.POINTER(ctypes.c_char_p), _error_p)
    # int kr_file_tensor(const kr_file *file, int32_t index, kr_tensor_info *info, kr_error *err);
    declare(lib, "kr_file_tensor", ctypes.c_int, kr_file_p, ctypes.c_int32, ctypes.POINTER(kr_tensor_info), _error_p)
    # int kr_file_find_tensor(const kr_file *file, const char *name, kr_tensor_info *info, kr_error *err);
    declare(lib, "kr_file_find_tensor", ctypes.c_int, kr_file_p, ctypes.c_char_p, ctypes.POINTER(kr_tensor_info),
            _error_p)
    # int32_t kr_file_find_tensor_index(const kr_file *file, const char *name);
    declare(lib, "kr_file_find_tensor_index", ctypes.c_int32, kr_file_p, ctypes.c_char_p)
    # uint64_t kr_type_size(int32_t type, uint64_t n_elements);
    declare(lib, "kr_type_size", ctypes.c_uint64, ctypes.c_int32, ctypes.c_uint64)
    # const char *kr_type_name(int32_t type);
    declare(lib, "kr_type_name", ctypes.c_char_p, ctypes.c_int32)


def type_name(code):
    """The C library's name for a tensor type code ("q4_0"), "unknown" for a bad one."""
    return clib.load().kr_type_name(code).decode()


def type_size(code, n_elements):
    """Bytes taken by `n_elements` of type `code` in the C library's reckoning, 0 if invalid."""
    return clib.load().kr_type_size(code, n_elements)


class ContainerFile(clib.OwnedHandle):
    """One .mlb or .mlt file opened and validated by the C loader.

    `magic` (MODEL_MAGIC, TOKENIZER_MAGIC or None for either) makes the loader refuse the other
    kind. After opening: `.magic` (bytes), `.size`, `.metadata` (dict: int, float, str, or lists
    for the array kinds), `.tensors` (list of (name, type_name, shape, n_bytes) in file order).
    Strings are UTF-8 with invalid bytes replaced, as formats.read does.
    """

    def __init__(self, path, magic=None):
        self.path = path
        if magic is not None and magic not in (MODEL_MAGIC, TOKENIZER_MAGIC):
            raise ValueError(f"magic must be {MODEL_MAGIC!r}, {TOKENIZER_MAGIC!r} or None, not {magic!r}")
        self._lib = clib.load()
        err = clib.kr_error()
        handle = self._lib.kr_file_open(os.fsencode(path), magic, ctypes.byref(err))
        if not handle:
            err.check(err.status or 1)
        self._own(handle, self._lib.kr_file_close)
        try:
            self.magic = ctypes.string_at(self._lib.kr_file_magic(handle), 8)
            self.size = self._lib.kr_file_size(handle)
            self.metadata = self._read_metadata()
            self._infos = self._read_tensors()
        except BaseException:
            self.close()
            raise
        self.tensors = [(name, type_name_, shape, n_bytes) for name, type_name_, shape, n_bytes, _ in self._infos]
        self._index = {entry[0]: i for i, entry in enumerate(self._infos)}

    @property
    def handle(self):
        """The raw kr_file pointer (for other bindings); valid until close()."""
        return self._check_open()

    def _closed_error(self):
        return clib.KraflaError(f"{self.path}: the file is closed", clib.KR_ERR_STATE)

    def _read_metadata(self):
        lib, handle = self._lib, self._handle
        metadata = {}
        key, kind = ctypes.c_char_p(), ctypes.c_int32()
        int_value, float_value = ctypes.c_int64(), ctypes.c_double()
        str_value, count = ctypes.c_void_p(), ctypes.c_uint32()
        err = clib.kr_error()
        for index in range(lib.kr_file_n_meta(handle)):
            status = lib.kr_file_meta(handle, index, ctypes.byref(key), ctypes.byref(kind), ctypes.byref(int_value),
                                      ctypes.byref(float_value), ctypes.byref(str_value), ctypes.byref(count),
                                      ctypes.byref(err))
            err.check(status)
            name = key.value.decode("utf-8", "replace")
            if kind.value == META_INT:
                value = int_value.value
            elif kind.value == META_FLOAT:
                value = float_value.value
            elif kind.value == META_STR:
                value = ctypes.string_at(str_value.value, count.value).decode("utf-8", "replace")
            elif kind.value in (META_INTS, META_FLOATS):
                values = ((ctypes.c_int64 if kind.value == META_INTS else ctypes.c_double) * count.value)()
                err.check(lib.kr_file_meta_array(handle, index, values, count.value, ctypes.byref(err)))
                value = values[:]
            else:
                raise clib.KraflaError(f"{self.path}: metadata {name}: kind {kind.value} unknown to this binding", 2)
            metadata[name] = value
        return metadata

    def _read_tensors(self):
        lib, handle = self._lib, self._handle
        infos = []
        info = kr_tensor_info()
        err = clib.kr_error()
        for index in range(lib.kr_file_n_tensors(handle)):
            err.check(lib.kr_file_tensor(handle, index, ctypes.byref(info), ctypes.byref(err)))
            shape = tuple(info.dims[d] for d in range(info.n_dims))
            infos.append((info.name.decode("utf-8", "replace"), type_name(info.type), shape, info.n_bytes, info.data))
        return infos

    def tensor_bytes(self, name):
        """A copy of the named tensor's raw bytes (a numpy uint8 array), read through the C loader's pointer."""
        import numpy  # tests and tools only: a server reads no tensor here, and runs without numpy

        self._check_open()
        if name not in self._index:
            raise KeyError(f"{self.path}: no tensor {name}")
        _, _, _, n_bytes, data = self._infos[self._index[name]]
        return numpy.frombuffer(ctypes.string_at(data, n_bytes), dtype=numpy.uint8)

    def __repr__(self):
        state = "open" if self._handle else "closed"
        return f"<ContainerFile {self.path} {self.magic!r} {len(self.metadata)} metadata, {len(self.tensors)} tensors, {state}>"
