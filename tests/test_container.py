"""The container format end to end: formats.write -> formats.read -> the C loader (ContainerFile).

The C loader is checked against two independent descriptions of the bytes: the Python reader,
and a field-by-field builder written from docs/formats.md (tests/support/corpus.py). Every malformed file in
the corpus must be refused by both readers, and random corruptions must be either refused by
both or read identically by both.
"""

import ctypes
import json
import math
import pathlib
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings

from krafla_twisted.engine import clib, container, formats, header
from krafla_twisted.engine.container import ContainerFile
from tests import strategies
from tests.support.corpus import (build, corpus, corruptions, meta_entry, meta_floats, valid_file, valid_parts,
                                  write_corpus)

REPO = pathlib.Path(__file__).resolve().parent.parent
KR_ERR_IO, KR_ERR_FORMAT, KR_ERR_UNSUPPORTED = header.KR_ERR_IO, header.KR_ERR_FORMAT, header.KR_ERR_UNSUPPORTED


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
        with pytest.raises(ValueError, match="magic must be"):
            ContainerFile(model, b"KRAF")  # the C loader compares 8 bytes

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
            "from krafla_twisted.engine import clib\n"
            "from krafla_twisted.engine.container import ContainerFile\n"
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
