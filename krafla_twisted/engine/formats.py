"""The krafla container: one description shared by the writer and the reader.

Both krafla files use the same container, told apart by their magic:

    .mlb  model:     b"KRAFLAMB"  metadata (hyperparameters) + weight tensors
    .mlt  tokenizer: b"KRAFLATK"  metadata (kind, pre-tokenizer, special ids) + token tables

Layout (little-endian; docs/formats.md has it byte by byte):

    header    magic[8] u32 version u32 n_meta u32 n_tensors u32 reserved
              u64 data_offset u64 file_size                            (40 bytes)
    metadata  n_meta entries:    u16 key_len, key, u8 kind, value
    tensors   n_tensors entries: u16 name_len, name, u32 type, u32 n_dims,
              u64 dims[n_dims] (outermost first, numpy order), u64 offset
    padding   zeros up to data_offset (a multiple of ALIGNMENT)
    data      each tensor at data_offset + offset, offset a multiple of ALIGNMENT

The engine_c loader (engine_c/src/format/file.c) reads the same layout; the magics, limits, kinds
and type codes below are read from engine_c/include/krafla.h (krafla_twisted/engine/header.py), and the
block sizes are checked against the C library's kr_type_size.
"""

import math
import mmap
import os
import struct
from dataclasses import dataclass, field

import numpy as np

from krafla_twisted.engine import header

MODEL_MAGIC = header.KR_MODEL_MAGIC.encode("ascii")
TOKENIZER_MAGIC = header.KR_TOKENIZER_MAGIC.encode("ascii")
VERSION = header.KR_FILE_VERSION
ALIGNMENT = header.KR_ALIGNMENT
HEADER = struct.Struct("<8sIIIIQQ")
MAX_DIMS = header.KR_MAX_DIMS
MAX_NAME = header.KR_MAX_NAME  # bytes in a key or tensor name
MAX_ENTRIES = header.KR_MAX_ENTRIES  # metadata entries or tensors

# Metadata value kinds.
META_INT = header.KR_META_INT  # i64
META_FLOAT = header.KR_META_FLOAT  # f64
META_STR = header.KR_META_STR  # u32 length + UTF-8 bytes
META_INTS = header.KR_META_INTS  # u32 count + i64[count]
META_FLOATS = header.KR_META_FLOATS  # u32 count + f64[count]


@dataclass(frozen=True)
class TensorType:
    """A tensor element type: `block` elements take `block_bytes` bytes."""

    code: int
    name: str
    block: int
    block_bytes: int
    numpy: str | None  # numpy dtype for unquantized types

    def nbytes(self, shape):
        count = math.prod(shape)
        if shape and shape[-1] % self.block:
            raise ValueError(f"{self.name}: last dimension {shape[-1]} is not a multiple of {self.block}")
        return count // self.block * self.block_bytes


# Q8_0: 32 weights = f16 scale d + 32 x int8 q; w = d * q.
# Q4_0: 32 weights = f16 scale d + 16 bytes; byte j holds weight j (low nibble) and weight
#       j + 16 (high nibble); w = d * (nibble - 8). Both are GGUF's layouts.
F32 = TensorType(header.KR_F32, "f32", 1, 4, "<f4")
F16 = TensorType(header.KR_F16, "f16", 1, 2, "<f2")
BF16 = TensorType(header.KR_BF16, "bf16", 1, 2, None)
Q8_0 = TensorType(header.KR_Q8_0, "q8_0", 32, 34, None)
Q4_0 = TensorType(header.KR_Q4_0, "q4_0", 32, 18, None)
I32 = TensorType(header.KR_I32, "i32", 1, 4, "<i4")
U8 = TensorType(header.KR_U8, "u8", 1, 1, "u1")
# ggml's other block layouts, byte for byte as GGUF stores them (docs/formats.md):
# Q4_1: f16 d, f16 m, 16 bytes of nibbles as Q4_0; w = d * nibble + m.
# Q5_0: f16 d, 4 bytes of fifth bits (bit j of weight j), 16 bytes of nibbles; w = d * (q - 16).
# Q5_1: f16 d, f16 m, 4 bytes of fifth bits, 16 bytes of nibbles; w = d * q + m.
# Q4_K, Q5_K: super-blocks of 256 = f16 d, f16 dmin, 12 bytes of 6-bit sub-block scales and
#   mins (8 sub-blocks of 32), [Q5_K: 32 bytes of fifth bits], 128 bytes of nibbles.
# Q6_K: 128 bytes of low nibbles, 64 bytes of high 2 bits, 16 int8 scales (sub-blocks of 16), f16 d.
Q4_1 = TensorType(header.KR_Q4_1, "q4_1", 32, 20, None)
Q5_0 = TensorType(header.KR_Q5_0, "q5_0", 32, 22, None)
Q5_1 = TensorType(header.KR_Q5_1, "q5_1", 32, 24, None)
Q4_K = TensorType(header.KR_Q4_K, "q4_K", 256, 144, None)
Q5_K = TensorType(header.KR_Q5_K, "q5_K", 256, 176, None)
Q6_K = TensorType(header.KR_Q6_K, "q6_K", 256, 210, None)
# The low-bit types (engine_c/src/kernels/lowbit.h):
# Q2_K: 16 bytes of 4-bit scales and mins (sub-blocks of 16), 64 bytes of 2-bit quants, f16 d, f16 dmin.
# Q3_K: 32 bytes of high bits (hmask), 64 bytes of 2-bit quants, 12 bytes of 6-bit scales, f16 d.
# IQ4_NL: f16 d, 16 bytes of nibbles indexing ggml's non-linear grid kvalues_iq4nl.
# IQ4_XS: super-blocks of 256 = f16 d, u16 scales_h, 4 bytes scales_l (6-bit scales of 8 sub-blocks
#   of 32), 128 bytes of nibbles indexing kvalues_iq4nl.
# MXFP4: an E8M0 exponent byte, 16 bytes of e2m1 nibbles (OCP microscaling).
Q2_K = TensorType(header.KR_Q2_K, "q2_K", 256, 84, None)
Q3_K = TensorType(header.KR_Q3_K, "q3_K", 256, 110, None)
IQ4_NL = TensorType(header.KR_IQ4_NL, "iq4_nl", 32, 18, None)
IQ4_XS = TensorType(header.KR_IQ4_XS, "iq4_xs", 256, 136, None)
MXFP4 = TensorType(header.KR_MXFP4, "mxfp4", 32, 17, None)
TENSOR_TYPES = {t.code: t for t in (F32, F16, BF16, Q8_0, Q4_0, I32, U8, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K,
                                    Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4)}
TENSOR_TYPES_BY_NAME = {t.name: t for t in TENSOR_TYPES.values()}


class FormatError(ValueError):
    """A krafla file that cannot be read: names the file and the problem."""


@dataclass
class Tensor:
    name: str
    type: TensorType
    shape: tuple
    data: np.ndarray  # raw bytes (uint8) for quantized and bf16, typed otherwise
    offset: int = 0

    @property
    def nbytes(self):
        return self.type.nbytes(self.shape)


@dataclass
class Container:
    magic: bytes
    metadata: dict = field(default_factory=dict)
    tensors: dict = field(default_factory=dict)  # name -> Tensor, in file order

    def add(self, name, type, shape, data):
        """Add a tensor; `data` is a typed array of `shape` or the raw encoded bytes."""
        shape = tuple(int(d) for d in shape)
        array = np.ascontiguousarray(data)
        if type.numpy is not None and array.dtype != np.uint8:
            array = array.astype(type.numpy, copy=False).reshape(shape)
        raw = array.view(np.uint8).reshape(-1)
        if raw.size != type.nbytes(shape):
            raise ValueError(f"tensor {name}: {raw.size} bytes for {type.name} {shape}, expected {type.nbytes(shape)}")
        self.tensors[name] = Tensor(name, type, shape, raw)

    def array(self, name):
        """The tensor as numpy: typed arrays for plain types, raw uint8 for block types and bf16."""
        tensor = self.tensors[name]
        if tensor.type.numpy is None:
            return tensor.data
        return tensor.data.view(tensor.type.numpy).reshape(tensor.shape)


def _pack_meta(key, value):
    key_bytes = key.encode()
    head = struct.pack("<H", len(key_bytes)) + key_bytes
    if isinstance(value, bool) or isinstance(value, (int, np.integer)):
        return head + struct.pack("<Bq", META_INT, int(value))
    if isinstance(value, (float, np.floating)):
        return head + struct.pack("<Bd", META_FLOAT, float(value))
    if isinstance(value, str):
        data = value.encode()
        return head + struct.pack("<BI", META_STR, len(data)) + data
    if isinstance(value, (list, tuple, np.ndarray)):
        values = list(value)
        if all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in values):
            return head + struct.pack(f"<BI{len(values)}q", META_INTS, len(values), *values)
        return head + struct.pack(f"<BI{len(values)}d", META_FLOATS, len(values), *map(float, values))
    raise TypeError(f"metadata {key}: cannot store {type(value).__name__}")


def _align(n):
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def write(path, container):
    """Write `container` to `path` atomically (a temporary file renamed into place)."""
    meta = b"".join(_pack_meta(k, v) for k, v in container.metadata.items())
    offset = 0
    table = []
    for tensor in container.tensors.values():
        tensor.offset = offset
        name = tensor.name.encode()
        table.append(struct.pack("<H", len(name)) + name
                     + struct.pack(f"<II{len(tensor.shape)}QQ", tensor.type.code, len(tensor.shape),
                                   *tensor.shape, offset))
        offset = _align(offset + tensor.nbytes)
    table = b"".join(table)
    data_offset = _align(HEADER.size + len(meta) + len(table))
    file_size = data_offset + offset
    header = HEADER.pack(container.magic, VERSION, len(container.metadata), len(container.tensors), 0,
                         data_offset, file_size)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(header + meta + table)
        f.write(b"\0" * (data_offset - f.tell()))
        for tensor in container.tensors.values():
            f.write(b"\0" * (data_offset + tensor.offset - f.tell()))
            f.write(tensor.data.tobytes())
        f.write(b"\0" * (file_size - f.tell()))
    os.replace(tmp, path)


class _Cursor:
    def __init__(self, buf, pos, path):
        self.buf, self.pos, self.path = buf, pos, path

    def take(self, fmt):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise FormatError(f"{self.path}: truncated at byte {self.pos}")
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return values

    def text(self, length, what):
        if not 1 <= length <= MAX_NAME:
            raise FormatError(f"{self.path}: {what} of {length} bytes (1 to {MAX_NAME} allowed)")
        (data,) = self.take(f"{length}s")
        if b"\0" in data:
            raise FormatError(f"{self.path}: {what} contains a NUL byte")
        try:
            return data.decode()
        except UnicodeDecodeError:
            raise FormatError(f"{self.path}: {what} is not UTF-8") from None


def read(path, magic=None):
    """Read a krafla file; tensors are zero-copy views of a read-only mmap."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < HEADER.size:
            raise FormatError(f"{path}: {size} bytes is too short for a krafla file")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return parse(buf, path, magic)


def parse(buf, path="<buffer>", magic=None):
    if len(buf) < HEADER.size:
        raise FormatError(f"{path}: {len(buf)} bytes is too short for a krafla file")
    file_magic, version, n_meta, n_tensors, _, data_offset, file_size = HEADER.unpack_from(buf, 0)
    if file_magic not in (MODEL_MAGIC, TOKENIZER_MAGIC) or (magic and file_magic != magic):
        raise FormatError(f"{path}: bad magic {file_magic!r}")
    if version != VERSION:
        raise FormatError(f"{path}: version {version}, this krafla reads version {VERSION}")
    if file_size != len(buf):
        raise FormatError(f"{path}: header says {file_size} bytes, file has {len(buf)}")
    if n_meta > MAX_ENTRIES or n_tensors > MAX_ENTRIES:
        raise FormatError(f"{path}: {n_meta} metadata entries / {n_tensors} tensors is over the limit")
    if data_offset % ALIGNMENT or data_offset > file_size:
        raise FormatError(f"{path}: data offset {data_offset} is misaligned or past the end")
    container = Container(file_magic)
    cursor = _Cursor(buf, HEADER.size, path)
    for _ in range(n_meta):
        (key_len,) = cursor.take("<H")
        key = cursor.text(key_len, "metadata key")
        (kind,) = cursor.take("<B")
        if kind == META_INT:
            (value,) = cursor.take("<q")
        elif kind == META_FLOAT:
            (value,) = cursor.take("<d")
        elif kind == META_STR:
            (length,) = cursor.take("<I")
            (raw,) = cursor.take(f"{length}s")
            value = raw.decode("utf-8", "replace")
        elif kind in (META_INTS, META_FLOATS):
            (count,) = cursor.take("<I")
            if cursor.pos + 8 * count > len(buf):
                raise FormatError(f"{path}: metadata {key}: {count} values run past the end")
            value = list(cursor.take(f"<{count}{'q' if kind == META_INTS else 'd'}"))
        else:
            raise FormatError(f"{path}: metadata {key}: unknown kind {kind}")
        if key in container.metadata:
            raise FormatError(f"{path}: metadata key {key} appears twice")
        container.metadata[key] = value
    for _ in range(n_tensors):
        (name_len,) = cursor.take("<H")
        name = cursor.text(name_len, "tensor name")
        type_code, n_dims = cursor.take("<II")
        if type_code not in TENSOR_TYPES:
            raise FormatError(f"{path}: tensor {name}: unknown type {type_code}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise FormatError(f"{path}: tensor {name}: {n_dims} dimensions")
        shape = cursor.take(f"<{n_dims}Q")
        (offset,) = cursor.take("<Q")
        tensor_type = TENSOR_TYPES[type_code]
        if any(d == 0 or d > 1 << 40 for d in shape):
            raise FormatError(f"{path}: tensor {name}: bad shape {shape}")
        try:
            nbytes = tensor_type.nbytes(shape)
        except ValueError as e:
            raise FormatError(f"{path}: tensor {name}: {e}") from None
        if offset % ALIGNMENT or data_offset + offset + nbytes > file_size:
            raise FormatError(f"{path}: tensor {name}: {nbytes} bytes at offset {offset} run past the end")
        if name in container.tensors:
            raise FormatError(f"{path}: tensor {name} appears twice")
        start = data_offset + offset
        data = np.frombuffer(buf, dtype=np.uint8, count=nbytes, offset=start)
        container.tensors[name] = Tensor(name, tensor_type, tuple(shape), data, offset)
    if cursor.pos > data_offset:
        raise FormatError(f"{path}: tables run into the data at {data_offset}")
    return container
