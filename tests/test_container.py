"""The container format end to end: formats.write -> formats.read -> the C loader (ContainerFile).

The C loader is checked against two independent descriptions of the bytes: the Python reader,
and a field-by-field builder in this file written from docs/formats.md. Every malformed file in
the corpus must be refused by both readers, and random corruptions must be either refused by
both or read identically by both.
"""

import ctypes
import json
import math
import os
import pathlib
import re
import struct
import subprocess
import sys
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from krafla_twisted import clib, container, formats
from krafla_twisted.container import ContainerFile
from tests import strategies

REPO = pathlib.Path(__file__).resolve().parent.parent
HEADER_H = REPO / "engine_c" / "include" / "krafla.h"
KR_ERR_IO, KR_ERR_FORMAT, KR_ERR_UNSUPPORTED = 1, 2, 3


# ------------------------------------------------------------------------------------------
# A byte-level builder written from docs/formats.md, independent of formats.write, so each
# field of a malformed file can be set by hand.

def meta_entry(key, kind, payload, key_length=None):
    key = key.encode() if isinstance(key, str) else key
    return struct.pack("<H", len(key) if key_length is None else key_length) + key + bytes([kind]) + payload


def meta_int(key, value):
    return meta_entry(key, 1, struct.pack("<q", value))


def meta_float(key, value):
    return meta_entry(key, 2, struct.pack("<d", value))


def meta_str(key, text, length=None):
    data = text.encode() if isinstance(text, str) else text
    return meta_entry(key, 3, struct.pack("<I", len(data) if length is None else length) + data)


def meta_ints(key, values, count=None):
    return meta_entry(key, 4, struct.pack(f"<I{len(values)}q", len(values) if count is None else count, *values))


def meta_floats(key, values, count=None):
    return meta_entry(key, 5, struct.pack(f"<I{len(values)}d", len(values) if count is None else count, *values))


def tensor_entry(name, type_code, dims, offset, n_dims=None, name_length=None):
    name = name.encode() if isinstance(name, str) else name
    return (struct.pack("<H", len(name) if name_length is None else name_length) + name
            + struct.pack(f"<II{len(dims)}QQ", type_code, len(dims) if n_dims is None else n_dims, *dims, offset))


def build(meta=(), tensors=(), data=b"", *, magic=b"KRAFLAMB", version=1, n_meta=None, n_tensors=None,
          data_offset=None, file_size=None, reserved=0, tail=b""):
    """A container from raw table entries and a data blob; any header field can be forced."""
    tables = b"".join(meta) + b"".join(tensors)
    natural_offset = -(-(40 + len(tables)) // 64) * 64
    body_offset = natural_offset if data_offset is None else data_offset
    body = tables + b"\0" * max(0, natural_offset - 40 - len(tables))
    # Data goes at the header's data_offset when that lies past the tables, else right after them.
    if body_offset > 40 + len(body):
        body += b"\0" * (body_offset - 40 - len(body))
    size = 40 + len(body) + len(data) + len(tail)
    header = struct.pack("<8sIIIIQQ", magic, version, len(meta) if n_meta is None else n_meta,
                         len(tensors) if n_tensors is None else n_tensors, reserved, body_offset,
                         size if file_size is None else file_size)
    return header + body + data + tail


def exact_tables(tables, n_meta, n_tensors):
    """A header and `tables` that end exactly at data_offset, with no data: any read past the
    tables is past the end of the file as well."""
    assert (40 + len(tables)) % 64 == 0, len(tables)
    size = 40 + len(tables)
    return struct.pack("<8sIIIIQQ", b"KRAFLAMB", 1, n_meta, n_tensors, 0, size, size) + tables


def patched(data, offset, fmt, value):
    """`data` with one header field overwritten."""
    data = bytearray(data)
    struct.pack_into(fmt, data, offset, value)
    return bytes(data)


def valid_parts():
    """The entries and data of a small valid model file: metadata of every kind, two tensors."""
    meta = [meta_str("arch", "llama"), meta_int("n_layers", 3), meta_float("norm_eps", 1e-5),
            meta_ints("layer_types", [0, 1, 0]), meta_floats("scales", [0.5, -2.0])]
    tensors = [tensor_entry("a", 0, (2, 3), 0), tensor_entry("b", 4, (1, 32), 64)]
    data = np.arange(6, dtype="<f4").tobytes() + b"\0" * 40 + bytes(range(18)) + b"\0" * 46
    return meta, tensors, data


def valid_file():
    meta, tensors, data = valid_parts()
    return build(meta, tensors, data)


# ------------------------------------------------------------------------------------------
# Helpers


def c_read(path, magic=None):
    """('ok', metadata, tensors, {name: bytes}) or ('error', status, message) from the C loader."""
    try:
        with ContainerFile(path, magic) as f:
            return ("ok", f.metadata, f.tensors, {name: f.tensor_bytes(name).tobytes() for name, *_ in f.tensors})
    except clib.KraflaError as e:
        return ("error", e.status, str(e))


def py_read(path, magic=None):
    """The same shape of answer from the Python reader."""
    try:
        c = formats.read(path, magic)
    except (formats.FormatError, OSError) as e:
        return ("error", None, str(e))
    tensors = [(t.name, t.type.name, tuple(t.shape), t.nbytes) for t in c.tensors.values()]
    return ("ok", c.metadata, tensors, {t.name: t.data.tobytes() for t in c.tensors.values()})


def comparable(metadata):
    """Metadata with floats as their bit patterns, so NaN from a corruption compares equal."""
    def one(value):
        if isinstance(value, float):
            return ("f", struct.pack("<d", value))
        if isinstance(value, list):
            return [one(v) for v in value]
        return value
    return {k: one(v) for k, v in metadata.items()}


def assert_same(c_answer, py_answer):
    assert c_answer[0] == py_answer[0], f"C: {c_answer[:3]!r}\nPython: {py_answer[:3]!r}"
    if c_answer[0] == "ok":
        assert comparable(c_answer[1]) == comparable(py_answer[1])
        assert list(c_answer[1]) == list(py_answer[1])  # same order
        assert c_answer[2] == py_answer[2]
        assert c_answer[3] == py_answer[3]


def write_bytes(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    return path


# ------------------------------------------------------------------------------------------


class ConstantsTests:
    def header_defines(self):
        text = HEADER_H.read_text()
        defines = dict(re.findall(r"^#define\s+(KR_\w+)\s+(.+?)\s*(?://.*)?$", text, re.M))
        enums = {name: int(value) for name, value in re.findall(r"\b(KR_[A-Z0-9_]+)\s*=\s*(\d+)", text)}
        return defines, enums

    def test_header_constants_match_formats(self):
        """krafla.h's magics, version, alignment and limits equal formats.py's (parsed from the header)."""
        defines, _ = self.header_defines()
        assert defines["KR_MODEL_MAGIC"] == json.dumps(formats.MODEL_MAGIC.decode())
        assert defines["KR_TOKENIZER_MAGIC"] == json.dumps(formats.TOKENIZER_MAGIC.decode())
        assert int(defines["KR_FILE_VERSION"]) == formats.VERSION
        assert int(defines["KR_ALIGNMENT"]) == formats.ALIGNMENT
        assert int(defines["KR_MAX_DIMS"]) == formats.MAX_DIMS
        assert int(defines["KR_MAX_NAME"]) == formats.MAX_NAME
        assert defines["KR_MAX_ENTRIES"] == "(1u << 20)" and formats.MAX_ENTRIES == 1 << 20
        assert formats.HEADER.size == 40

    def test_header_enums_match_formats(self):
        """The metadata kinds and tensor type codes in krafla.h equal formats.py's."""
        _, enums = self.header_defines()
        kinds = {"KR_META_INT": formats.META_INT, "KR_META_FLOAT": formats.META_FLOAT, "KR_META_STR": formats.META_STR,
                 "KR_META_INTS": formats.META_INTS, "KR_META_FLOATS": formats.META_FLOATS}
        for name, value in kinds.items():
            assert enums[name] == value, name
        for tensor_type in formats.TENSOR_TYPES.values():
            assert enums["KR_" + tensor_type.name.upper()] == tensor_type.code, tensor_type.name
        assert enums["KR_TYPE_COUNT"] == len(formats.TENSOR_TYPES)

    def test_type_sizes_match_formats(self):
        """The C library's name, block and block size of every type equal formats.py's."""
        for tensor_type in formats.TENSOR_TYPES.values():
            assert container.type_name(tensor_type.code) == tensor_type.name
            assert container.type_size(tensor_type.code, tensor_type.block * 7) == 7 * tensor_type.block_bytes
            if tensor_type.block > 1:
                assert container.type_size(tensor_type.code, tensor_type.block + 1) == 0
        assert container.type_name(len(formats.TENSOR_TYPES)) == "unknown"
        assert container.type_size(-1, 1) == 0
        assert container.type_size(formats.F32.code, 1 << 62) == 0  # bytes overflow 64 bits


class RoundTripTests:
    def every_kind(self):
        c = formats.Container(formats.MODEL_MAGIC)
        c.metadata.update({
            "int": 42, "negative": -(2**63), "largest": 2**63 - 1,
            "float": 0.1, "negative zero": -0.0, "infinity": math.inf, "tiny": 5e-324,
            "string": "Hello, wörld ✓ 𝄞", "empty string": "",
            "ints": [0, -1, 2**62], "floats": [1.5, -math.inf, 1e300], "empty": [],
            "k" * formats.MAX_NAME: 1, "ключ": "значение",
        })
        rng = np.random.default_rng(7)
        for tensor_type, shape in [(formats.F32, (3,)), (formats.F32, (1, 1, 1, 1)), (formats.F16, (5, 7)),
                                   (formats.BF16, (2, 3, 5)), (formats.Q8_0, (3, 64)), (formats.Q4_0, (1, 1, 1, 32)),
                                   (formats.Q4_0, (7, 96)), (formats.I32, (11,)), (formats.U8, (13, 1))]:
            raw = rng.integers(0, 256, tensor_type.nbytes(shape), dtype=np.uint8)
            c.add(f"{tensor_type.name}.{'x'.join(map(str, shape))}", tensor_type, shape, raw)
        return c

    def check(self, path, original):
        assert_same(c_read(path), py_read(path))
        status, metadata, tensors, data = c_read(path)
        assert status == "ok"
        assert comparable(metadata) == comparable(original.metadata)
        assert tensors == [(t.name, t.type.name, t.shape, t.nbytes) for t in original.tensors.values()]
        assert data == {t.name: t.data.tobytes() for t in original.tensors.values()}

    def test_every_kind_and_type(self, tmp_path):
        """Metadata of every kind (extremes, unicode, empty) and tensors of every type and odd shapes
        survive writer -> Python reader -> C loader with identical values and bytes."""
        original = self.every_kind()
        path = tmp_path / "every.mlb"
        formats.write(path, original)
        self.check(path, original)

    def test_builder_and_writer_agree(self, tmp_path):
        """formats.write produces exactly the bytes of the field-by-field builder written from
        docs/formats.md, and both readers read the builder's file the same way."""
        meta, tensors, data = valid_parts()
        built = write_bytes(tmp_path, "built.mlb", build(meta, tensors, data))
        c = formats.Container(formats.MODEL_MAGIC, {"arch": "llama", "n_layers": 3, "norm_eps": 1e-5,
                                                   "layer_types": [0, 1, 0], "scales": [0.5, -2.0]})
        c.add("a", formats.F32, (2, 3), np.arange(6, dtype=np.float32))
        c.add("b", formats.Q4_0, (1, 32), np.arange(18, dtype=np.uint8))
        written = tmp_path / "written.mlb"
        formats.write(written, c)
        assert written.read_bytes() == built.read_bytes()
        self.check(built, c)

    def test_tensor_data_is_aligned(self, tmp_path):
        """Every tensor the C loader hands out starts on a 64-byte boundary of the mapping."""
        original = self.every_kind()
        path = tmp_path / "every.mlb"
        formats.write(path, original)
        with ContainerFile(path) as f:
            for name, type_name, shape, n_bytes, data in f._infos:
                assert data % formats.ALIGNMENT == 0, name

    def test_empty_container(self, tmp_path):
        """A tokenizer file with no metadata and no tensors is valid and reads as empty."""
        path = tmp_path / "empty.mlt"
        formats.write(path, formats.Container(formats.TOKENIZER_MAGIC))
        with ContainerFile(path) as f:
            assert (f.magic, f.metadata, f.tensors, f.size) == (formats.TOKENIZER_MAGIC, {}, [], 64)

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(original=strategies.containers())
    def test_random_containers(self, tmp_path, original):
        """Random containers (names, metadata kinds, types, shapes) read back identically in both readers."""
        path = tmp_path / "random.mlb"
        formats.write(path, original)
        self.check(path, original)
        with ContainerFile(path) as f:
            assert f.magic == original.magic


class ContainerFileTests:
    def test_magic_filter(self, tmp_path):
        """Asking for a model refuses a tokenizer file and the other way round, naming what was expected."""
        model = write_bytes(tmp_path, "m.mlb", valid_file())
        tokenizer = tmp_path / "t.mlt"
        formats.write(tokenizer, formats.Container(formats.TOKENIZER_MAGIC, {"kind": "bpe"}))
        assert ContainerFile(model, container.MODEL_MAGIC).metadata["arch"] == "llama"
        with pytest.raises(clib.KraflaError, match=r"m\.mlb: expected a tokenizer"):
            ContainerFile(model, container.TOKENIZER_MAGIC)
        with pytest.raises(clib.KraflaError, match=r"t\.mlt: expected a model"):
            ContainerFile(tokenizer, container.MODEL_MAGIC)
        with pytest.raises(formats.FormatError):
            formats.read(tokenizer, formats.MODEL_MAGIC)

    def test_close_and_context_manager(self, tmp_path):
        """close() releases the file once (twice is harmless); a closed file refuses reads."""
        path = write_bytes(tmp_path, "m.mlb", valid_file())
        with ContainerFile(path) as f:
            assert f.handle
            assert f.tensor_bytes("a").view("<f4").tolist() == [0, 1, 2, 3, 4, 5]
        with pytest.raises(clib.KraflaError, match="closed"):
            f.tensor_bytes("a")
        f.close()
        assert f.metadata["n_layers"] == 3  # already read values stay usable
        with pytest.raises(KeyError):
            ContainerFile(path).tensor_bytes("missing")

    def test_typed_lookups(self, tmp_path):
        """kr_file_get_int/_float/_str return values, fall back for missing keys and refuse the wrong kind."""
        path = write_bytes(tmp_path, "m.mlb", valid_file())
        lib = clib.load()
        with ContainerFile(path) as f:
            err = clib.kr_error()
            out_int, out_float, out_str = ctypes.c_int64(), ctypes.c_double(), ctypes.c_char_p()
            assert lib.kr_file_get_int(f.handle, b"n_layers", -1, ctypes.byref(out_int), ctypes.byref(err)) == 0
            assert out_int.value == 3
            assert lib.kr_file_get_int(f.handle, b"missing", -7, ctypes.byref(out_int), ctypes.byref(err)) == 0
            assert out_int.value == -7
            assert lib.kr_file_get_float(f.handle, b"n_layers", 0, ctypes.byref(out_float), ctypes.byref(err)) == 0
            assert out_float.value == 3.0
            assert lib.kr_file_get_str(f.handle, b"arch", None, ctypes.byref(out_str), ctypes.byref(err)) == 0
            assert out_str.value == b"llama"
            status = lib.kr_file_get_int(f.handle, b"arch", 0, ctypes.byref(out_int), ctypes.byref(err))
            assert status == KR_ERR_FORMAT and "arch should be an integer" in err.message.decode()
            assert lib.kr_file_get_str(f.handle, b"n_layers", None, ctypes.byref(out_str), ctypes.byref(err)) != 0
            assert lib.kr_file_find_tensor_index(f.handle, b"b") == 1
            assert lib.kr_file_find_tensor_index(f.handle, b"c") == -1
            info = container.kr_tensor_info()
            assert lib.kr_file_find_tensor(f.handle, b"c", ctypes.byref(info), ctypes.byref(err)) == KR_ERR_FORMAT
            assert "tensor c is missing" in err.message.decode()
            assert lib.kr_file_tensor(f.handle, 2, ctypes.byref(info), ctypes.byref(err)) != 0
            assert lib.kr_file_meta_int_at(f.handle, 3, 1) == 1
            assert lib.kr_file_meta_float_at(f.handle, 4, 1) == -2.0
            assert lib.kr_file_meta_int_at(f.handle, 3, 3) == 0  # past the end: 0, not a read
            values = (ctypes.c_int64 * 2)()
            assert lib.kr_file_meta_array(f.handle, 3, values, 2, ctypes.byref(err)) != 0  # wrong count
            assert lib.kr_file_meta_array(f.handle, 0, values, 0, ctypes.byref(err)) != 0  # not an array

    def test_float_metadata_as_int_saturates(self, tmp_path):
        """Integer views of NaN and huge floats are defined (0, saturated), not undefined behaviour."""
        path = write_bytes(tmp_path, "m.mlb", build([meta_floats("x", [math.nan, 1e300, -1e300, 2.9])]))
        lib = clib.load()
        with ContainerFile(path) as f:
            assert [lib.kr_file_meta_int_at(f.handle, 0, i) for i in range(4)] == [0, 2**63 - 1, -(2**63), 2]


# ------------------------------------------------------------------------------------------
# The corpus of malformed files: name -> (bytes, a fragment the C loader's message must hold).

def corpus():
    meta, tensors, data = valid_parts()
    good = build(meta, tensors, data)
    one_tensor = [tensor_entry("a", 0, (2, 3), 0)]
    f32_data = np.arange(6, dtype="<f4").tobytes() + b"\0" * 40

    def with_tensor(entry, data=f32_data + b"\0" * 64):
        return build(meta, [entry], data)

    def with_meta(entry):
        return build([entry], one_tensor, f32_data)

    cases = {
        "empty file": (b"", "too short"),
        "39 bytes": (good[:39], "too short"),
        "bad magic": (b"KRAFLAXX" + good[8:], "bad magic"),
        "gguf magic": (b"GGUF\3\0\0\0" + good[8:], "bad magic"),
        "version 0": (build(meta, tensors, data, version=0), "version 0"),
        "version 2": (build(meta, tensors, data, version=2), "version 2"),
        "truncated by one byte": (good[:-1], "truncated or padded"),
        "truncated to the header": (good[:40], "truncated or padded"),
        "padded by one byte": (good + b"\0", "truncated or padded"),
        "file_size too large": (build(meta, tensors, data, file_size=len(good) + 64), "truncated or padded"),
        "file_size 2^64-1": (build(meta, tensors, data, file_size=2**64 - 1), "truncated or padded"),
        "data_offset misaligned": (build(meta, tensors, data, data_offset=200), "data offset 200"),
        "data_offset past end": (patched(good, 24, "<Q", 64 * 1000), "data offset 64000"),
        "data_offset 2^63": (patched(good, 24, "<Q", 2**63), "data offset"),
        "data_offset zero": (build(meta, tensors, data, data_offset=0), "data offset 0"),
        "data_offset inside the tables": (build(meta, tensors, data, data_offset=64), "cannot fit|truncated|past the end"),
        "n_meta over the limit": (build(meta, tensors, data, n_meta=2**20 + 1), "exceed the limit"),
        "n_tensors over the limit": (build(meta, tensors, data, n_tensors=2**32 - 1), "exceed the limit"),
        "n_meta at the limit in a small file": (build(meta, tensors, data, n_meta=2**20), "cannot fit"),
        "n_tensors at the limit in a small file": (build(meta, tensors, data, n_tensors=2**20), "cannot fit"),
        "one metadata entry too many": (build(meta, tensors, data, n_meta=len(meta) + 1), "tensor|truncated|metadata"),
        "one tensor too many": (build(meta, tensors, data, n_tensors=3), "truncated|tensor"),
        "key length over 1024": (with_meta(meta_int("k" * 1025, 1)), "1025 bytes \\(1 to 1024"),
        "key length 65535 past the end": (with_meta(struct.pack("<H", 65535) + b"k"), "65535"),
        "key length zero": (with_meta(meta_int("", 1)), "metadata name of 0 bytes"),
        "NUL in a key": (with_meta(meta_int("a\0b", 1)), "NUL"),
        "key not UTF-8": (with_meta(meta_int(b"\xff\xfe", 1)), "not UTF-8"),
        "key with a UTF-16 surrogate": (with_meta(meta_int(b"\xed\xa0\x80", 1)), "not UTF-8"),
        "key with an overlong encoding": (with_meta(meta_int(b"\xc0\xaf", 1)), "not UTF-8"),
        "tensor name length over 1024": (with_tensor(tensor_entry("t" * 1025, 0, (2, 3), 0)), "1025 bytes"),
        "tensor name length zero": (with_tensor(tensor_entry("", 0, (2, 3), 0)), "tensor name of 0 bytes"),
        "NUL in a tensor name": (with_tensor(tensor_entry("a\0", 0, (2, 3), 0)), "NUL"),
        "tensor name not UTF-8": (with_tensor(tensor_entry(b"\x80", 0, (2, 3), 0)), "not UTF-8"),
        "metadata kind 0": (with_meta(meta_entry("x", 0, struct.pack("<q", 1))), "unknown kind 0"),
        "metadata kind 6": (with_meta(meta_entry("x", 6, struct.pack("<q", 1))), "unknown kind 6"),
        "metadata kind 255": (with_meta(meta_entry("x", 255, struct.pack("<q", 1))), "unknown kind 255"),
        "tensor type 7": (with_tensor(tensor_entry("a", 7, (2, 3), 0)), "unknown type 7"),
        "tensor type 2^32-1": (with_tensor(tensor_entry("a", 2**32 - 1, (2, 3), 0)), "unknown type"),
        "n_dims 0": (with_tensor(tensor_entry("a", 0, (), 0)), "0 dimensions"),
        "n_dims 5": (with_tensor(tensor_entry("a", 0, (1, 1, 1, 2, 3), 0)), "5 dimensions"),
        "n_dims 2^32-1": (with_tensor(tensor_entry("a", 0, (2, 3), 0, n_dims=2**32 - 1)), "dimensions"),
        "a zero dimension": (with_tensor(tensor_entry("a", 0, (2, 0), 0)), "dimension 1 is 0"),
        "a dimension of 2^40+1": (with_tensor(tensor_entry("a", 6, (2**40 + 1,), 0)), "dimension 0 is"),
        "dims whose product overflows": (with_tensor(tensor_entry("a", 6, (2**40, 2**40, 2**40, 2**40), 0)), "dimension"),
        "dims whose product is exactly 2^64": (with_tensor(tensor_entry("a", 6, (2**32, 2**32), 0)), "dimension 1"),
        "dims whose byte size overflows": (with_tensor(tensor_entry("a", 0, (2**40, 2**22), 0)), "more than 2\\^64 bytes"),
        "dims far larger than the file": (with_tensor(tensor_entry("a", 0, (2**40, 2**20), 0)), "outside the file"),
        "q4_0 last dimension 33": (with_tensor(tensor_entry("a", 4, (2, 33), 0)), "not a multiple of q4_0"),
        "q8_0 last dimension 16": (with_tensor(tensor_entry("a", 3, (16,), 0)), "not a multiple of q8_0"),
        "q8_0 block in the outer dimension only": (with_tensor(tensor_entry("a", 3, (32, 2), 0)), "not a multiple"),
        "tensor past the end": (with_tensor(tensor_entry("a", 0, (2, 3), 128)), "outside the file"),
        "tensor one byte past the end": (with_tensor(tensor_entry("a", 6, (129,), 0), b"\0" * 128),
                                         "outside the file"),
        "tensor offset wraps around": (with_tensor(tensor_entry("a", 0, (2, 3), 2**64 - 64)), "outside the file"),
        "tensor offset misaligned": (with_tensor(tensor_entry("a", 0, (2, 3), 8)), "offset 8 is not a multiple of 64"),
        "tables overrun data_offset": (build(meta + [meta_str("pad", "p" * 40)], tensors, data,
                                             data_offset=128 + 64), "past the end|truncated"),
        "string length past the end": (with_meta(meta_str("s", "abc", length=2**32 - 1)), "string runs past"),
        "string length one too many": (exact_tables(meta_str("s", "x" * 16, length=17), 1, 0), "string runs past"),
        "ints count past the end": (with_meta(meta_ints("v", [1, 2], count=2**31)), "array of 2147483648"),
        "floats count past the end": (with_meta(meta_floats("v", [1.0], count=2**32 - 1)), "array of 4294967295"),
        "truncated inside a key": (exact_tables(struct.pack("<H", 30) + b"k" * 22, 1, 0), "runs past the end of the tables"),
        "truncated before the kind": (exact_tables(struct.pack("<H", 22) + b"k" * 22, 1, 0), "truncated"),
        "truncated inside a tensor entry": (exact_tables(tensor_entry("a" * 60, 0, (2, 3), 0)[:88], 0, 1), "truncated"),
        "truncated inside a string": (exact_tables(meta_str("s", "x" * 16, length=2**31), 1, 0), "string runs past"),
        "duplicate metadata key": (build([meta_int("x", 1), meta_int("x", 2)], one_tensor, f32_data), "appears twice"),
        "duplicate tensor name": (build(meta, [tensor_entry("a", 0, (2, 3), 0), tensor_entry("a", 0, (2, 3), 0)],
                                        f32_data), "appears twice"),
        "all zeros": (b"\0" * 128, "bad magic"),
        "all ones": (b"\xff" * 128, "bad magic"),
    }
    return cases


def write_corpus(directory):
    """Each corpus case as a file in `directory`, plus a directory and a missing path: name -> path."""
    paths = {}
    for index, (name, (data, _)) in enumerate(corpus().items()):
        paths[name] = directory / f"case{index:02d}.mlb"
        paths[name].write_bytes(data)
    (directory / "a directory.mlb").mkdir()
    paths["a directory"] = directory / "a directory.mlb"
    paths["a missing file"] = directory / "missing.mlb"
    return paths


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


class CorpusTests:
    def expected_fragment(self, name):
        fragments = {"a directory": "not a regular file", "a missing file": "No such file"}
        return fragments.get(name) or corpus()[name][1]

    def test_long_paths_and_names_in_messages(self, tmp_path):
        """A long path is shown by its last 240 bytes and a long name by its first 200, so the
        problem itself always fits in the loader's 512-byte message."""
        directory = tmp_path / ("d" * 200) / ("e" * 200)
        directory.mkdir(parents=True)
        path = write_bytes(directory, "f" * 200 + ".mlb", build([meta_entry("k" * 1024, 9, b"")]))
        with pytest.raises(clib.KraflaError) as error:
            ContainerFile(path)
        assert str(error.value) == f"...{str(path)[-240:]}: metadata {'k' * 200}: unknown kind 9"
        with pytest.raises(clib.KraflaError, match=r"^/.*/missing\.mlb: cannot open"):
            ContainerFile(tmp_path / "missing.mlb")  # a short path is shown whole

    def test_corpus_is_valid_apart_from_the_defect(self, tmp_path):
        """The base file the corpus is built from reads fine in both readers (so each rejection
        below is for its defect)."""
        path = write_bytes(tmp_path, "good.mlb", valid_file())
        answer = c_read(path)
        assert answer[0] == "ok", answer
        assert_same(answer, py_read(path))

    def test_c_loader_rejects_every_case_in_a_subprocess(self, corpus_dir):
        """Every malformed file makes the C loader return an error naming the file and the defect;
        run in a child process so a crash fails this test instead of killing pytest."""
        script = (
            "import json, sys\n"
            "from krafla_twisted import clib\n"
            "from krafla_twisted.container import ContainerFile\n"
            "answers = {}\n"
            "for name, path in json.loads(sys.stdin.read()).items():\n"
            "    try:\n"
            "        ContainerFile(path).close()\n"
            "        answers[name] = ['ok', 0, '']\n"
            "    except clib.KraflaError as e:\n"
            "        answers[name] = ['error', e.status, str(e)]\n"
            "print(json.dumps(answers))\n"
        )
        request = json.dumps({name: str(path) for name, path in corpus_dir.items()})
        result = subprocess.run([sys.executable, "-c", script], input=request, capture_output=True, text=True,
                                cwd=REPO, timeout=120)
        assert result.returncode == 0, f"the C loader crashed (status {result.returncode}): {result.stderr[-2000:]}"
        answers = json.loads(result.stdout)
        assert set(answers) == set(corpus_dir)
        for name, (outcome, status, message) in answers.items():
            assert outcome == "error", f"{name}: accepted"
            assert status in (KR_ERR_IO, KR_ERR_FORMAT, KR_ERR_UNSUPPORTED), f"{name}: status {status}"
            assert str(corpus_dir[name]) in message, f"{name}: {message}"
            assert re.search(self.expected_fragment(name), message), f"{name}: {message}"

    def test_python_reader_rejects_every_case(self, corpus_dir):
        """formats.read refuses every malformed file with FormatError (or OSError for what is not
        a readable file)."""
        for name, path in corpus_dir.items():
            expected = OSError if name in ("a directory", "a missing file") else formats.FormatError
            with pytest.raises(expected):
                formats.read(path)


# ------------------------------------------------------------------------------------------
# Hypothesis corruptions of valid files.

base_files = st.one_of(st.just(None), strategies.containers())


@st.composite
def corruptions(draw):
    """(valid file bytes, corrupted bytes): byte flips (mostly in the header and tables, where
    they matter), a truncation, an insertion, a deletion, or the file spliced into itself."""
    original = draw(base_files)
    if original is None:
        data = valid_file()
    else:
        data = _container_bytes(original)
    tables_end = struct.unpack_from("<Q", data, 24)[0]
    corrupted = bytearray(data)
    kind = draw(st.sampled_from(["flip", "flip", "set", "truncate", "insert", "delete", "splice"]))
    if kind in ("flip", "set"):
        for _ in range(draw(st.integers(1, 4))):
            limit = len(corrupted) - 1 if draw(st.integers(0, 9)) == 0 else max(0, min(tables_end, len(corrupted)) - 1)
            position = draw(st.integers(0, limit))
            if kind == "flip":
                corrupted[position] ^= 1 << draw(st.integers(0, 7))
            else:
                corrupted[position] = draw(st.sampled_from([0, 1, 0x7F, 0x80, 0xFF, draw(st.integers(0, 255))]))
    elif kind == "truncate":
        del corrupted[draw(st.integers(0, len(corrupted) - 1)):]
    elif kind == "insert":
        position = draw(st.integers(0, len(corrupted)))
        corrupted[position:position] = draw(st.binary(min_size=1, max_size=80))
    elif kind == "splice":  # a whole valid file inserted into itself
        position = draw(st.integers(0, len(corrupted)))
        corrupted[position:position] = data
    else:
        start = draw(st.integers(0, len(corrupted) - 1))
        del corrupted[start:start + draw(st.integers(1, 64))]
    return data, bytes(corrupted)


def _container_bytes(original):
    """The bytes formats.write makes of `original`."""
    with tempfile.TemporaryDirectory(prefix="kr-corrupt-") as directory:
        path = os.path.join(directory, "base.mlb")
        formats.write(path, original)
        with open(path, "rb") as f:
            return f.read()


class CorruptionTests:
    @settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(case=corruptions())
    def test_corruptions_are_read_consistently_or_rejected(self, tmp_path, case):
        """A corrupted file is either refused by both readers or read identically by both (a flip in
        tensor data or a string is still a valid file); the C loader never crashes."""
        original, corrupted = case
        assume(corrupted != original)
        path = write_bytes(tmp_path, "corrupt.mlb", corrupted)
        c_answer, py_answer = c_read(path), py_read(path)
        assert_same(c_answer, py_answer)
        if c_answer[0] == "error":
            assert c_answer[1] in (KR_ERR_FORMAT, KR_ERR_UNSUPPORTED)
            assert str(path) in c_answer[2]
