"""Malformed and corrupted krafla containers, for the tests of both readers and `krafla info`.

A byte-level builder written from docs/formats.md (independent of formats.write, so any field
can be set by hand), a fixed corpus of malformed files each with the fragment the C loader's
message must contain, and a hypothesis strategy of random corruptions of valid files.
"""

import os
import struct
import tempfile

import numpy as np
from hypothesis import strategies as st

from krafla_twisted.engine import formats
from tests import strategies

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
        "tensor type past the last": (with_tensor(tensor_entry("a", len(formats.TENSOR_TYPES), (2, 3), 0)),
                                      f"unknown type {len(formats.TENSOR_TYPES)}"),
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
