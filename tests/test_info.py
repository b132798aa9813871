"""`krafla info`: what it prints for good files (checked against the Python reader) and how it
refuses bad ones (exit status 1, the loader's message, never a traceback)."""

import argparse
import io
import json
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

from krafla_twisted.cli import info
from krafla_twisted.engine import formats
from tests.support import real_models
from tests.support.tiny_models import write_tiny_model

REPO = pathlib.Path(__file__).resolve().parent.parent
from tests.support.corpus import corruptions, valid_file, write_corpus


def run_info(*argv):
    """(exit status, stdout, stderr) of `krafla info ARGV` run in this process."""
    parser = argparse.ArgumentParser()
    info.add_arguments(parser)
    out, err = io.StringIO(), io.StringIO()
    status = info.main(parser.parse_args([str(a) for a in argv]), out=out, err=err)
    return status, out.getvalue(), err.getvalue()


class InfoOutputTests:
    def test_text_lists_every_key_and_tensor(self, tmp_path):
        """The text report has one line per metadata key with its value and one row per tensor with
        its type, shape and byte size, all as the Python reader reads the file."""
        path = tmp_path / "tiny.mlb"
        write_tiny_model(path, "qwen2", seed=3, weight_type="q4_0")
        expected = formats.read(path)
        status, out, err = run_info(path)
        assert (status, err) == (0, "")
        lines = out.splitlines()
        assert lines[0] == (f"{path}: krafla model file (KRAFLAMB), {path.stat().st_size} bytes, "
                            f"{len(expected.metadata)} metadata entries, {len(expected.tensors)} tensors")
        metadata_at, tensors_at = lines.index("metadata"), lines.index("tensors")
        metadata_rows = [line.split() for line in lines[metadata_at + 1:tensors_at - 1]]
        tensor_rows = [line.split() for line in lines[tensors_at + 1:-2]]
        assert len(metadata_rows) == len(expected.metadata)
        for row, (key, value) in zip(metadata_rows, expected.metadata.items()):
            shown = json.dumps(value) if isinstance(value, str) else repr(value) if isinstance(value, float) else str(value)
            assert row == [key, *shown.split()], key
        assert tensor_rows[0] == ["name", "type", "shape", "bytes"]
        assert len(tensor_rows) == 1 + len(expected.tensors)
        for row, tensor in zip(tensor_rows[1:], expected.tensors.values()):
            shape = " x ".join(map(str, tensor.shape)).split()
            assert row == [tensor.name, tensor.type.name, *shape, str(tensor.nbytes)], tensor.name
        summary = lines[-1].strip()
        total = sum(t.nbytes for t in expected.tensors.values())
        elements = sum(math.prod(t.shape) for t in expected.tensors.values())
        assert summary == f"{len(expected.tensors)} tensors (f32 11, q4_0 14, q8_0 1), {elements} elements, {total} bytes"

    def test_json_equals_the_python_reader(self, tmp_path):
        """--json prints, per file, the magic, size, metadata and tensor table the Python reader sees."""
        paths = [tmp_path / "a.mlb", tmp_path / "b.mlt"]
        write_tiny_model(paths[0], "gemma3", seed=1, weight_type="q8_0")
        tokenizer = formats.Container(formats.TOKENIZER_MAGIC, {"kind": "bpe", "bos_id": 1})
        tokenizer.add("vocab", formats.U8, (5,), np.frombuffer(b"hello", dtype=np.uint8))
        formats.write(paths[1], tokenizer)
        status, out, err = run_info("--json", *paths)
        assert (status, err) == (0, "")
        for path, line in zip(paths, out.splitlines(), strict=True):
            expected = formats.read(path)
            assert json.loads(line) == {
                "path": str(path), "magic": expected.magic.decode(), "size": path.stat().st_size,
                "metadata": expected.metadata,
                "tensors": [{"name": t.name, "type": t.type.name, "shape": list(t.shape), "bytes": t.nbytes}
                            for t in expected.tensors.values()],
            }

    def test_long_strings_are_cut_with_their_length(self, tmp_path):
        """A long string value (a .mlt's chat_template_jinja) prints its first characters and its
        length, not the whole text; --json keeps it whole."""
        container = write_tiny_model(tmp_path / "a.mlb", "llama", seed=1)
        text = "{% for m in messages %}" + "x" * 500 + "{% endfor %}"
        container.metadata["chat_template_jinja"] = text
        formats.write(tmp_path / "b.mlb", container)
        status, out, _ = run_info(tmp_path / "b.mlb")
        line = next(line for line in out.splitlines() if "chat_template_jinja" in line)
        assert status == 0 and line.endswith(f"... ({len(text)} characters)") and len(line) < 200
        status, out, _ = run_info("--json", tmp_path / "b.mlb")
        assert json.loads(out)["metadata"]["chat_template_jinja"] == text

    def test_hostile_names_are_escaped(self, tmp_path):
        """Terminal control characters in keys, strings and tensor names are printed escaped, and a
        long array is shortened to its first values and its length."""
        c = formats.Container(formats.MODEL_MAGIC, {"\x1b[2Jkey": "value\x1b]0;title\x07", "long": list(range(100))})
        c.add("t\x1b[31m", formats.F32, (1,), [1.0])
        path = tmp_path / "hostile.mlb"
        formats.write(path, c)
        status, out, _ = run_info(path)
        assert status == 0
        assert "\x1b" not in out and "\x07" not in out
        assert "\\x1b[2Jkey" in out and "t\\x1b[31m" in out
        assert "[0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, ...] (100 values)" in out


class InfoRejectionTests:
    def test_corpus_exits_1_with_the_message(self, tmp_path):
        """Every malformed file of the container corpus gives exit status 1 and one line naming the
        file, and good files given alongside are still printed."""
        good = tmp_path / "good.mlb"
        good.write_bytes(valid_file())
        for name, path in write_corpus(tmp_path).items():
            status, out, err = run_info(good, path)
            assert status == 1, name
            assert out.startswith(f"{good}: krafla model file"), name
            assert err.startswith(f"krafla info: {path}: ") and err.count("\n") == 1, (name, err)

    def test_command_line_never_shows_a_traceback(self, tmp_path):
        """The installed command (python -m krafla_twisted.cli.main info) on bad files: status 1, the
        loader's messages on stderr, no traceback."""
        paths = write_corpus(tmp_path)
        bad = [paths["empty file"], paths["a directory"], paths["a missing file"], paths["tensor past the end"]]
        result = subprocess.run([sys.executable, "-m", "krafla_twisted.cli.main", "info", *map(str, bad)],
                                capture_output=True, text=True, cwd=REPO, timeout=60)
        assert result.returncode == 1
        assert "Traceback" not in result.stderr
        assert result.stderr.splitlines() == [
            f"krafla info: {bad[0]}: 0 bytes is too short for a krafla file",
            f"krafla info: {bad[1]}: not a regular file",
            f"krafla info: {bad[2]}: cannot open: No such file or directory",
            f"krafla info: {bad[3]}: tensor a: 24 bytes at data offset 128 lie outside the file",
        ]

    @settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(case=corruptions())
    def test_corruptions_print_or_refuse(self, tmp_path, case):
        """A corrupted file is either printed (status 0, as the Python reader reads it) or refused
        (status 1 and a message), exactly when the Python reader refuses it."""
        path = tmp_path / "corrupt.mlb"
        path.write_bytes(case[1])
        status, out, err = run_info("--json", path)
        try:
            expected = formats.read(path)
        except formats.FormatError:
            assert (status, out) == (1, "")
            assert err.startswith(f"krafla info: {path}: ")
        else:
            assert (status, err) == (0, "")
            printed = json.loads(out)
            assert [t["name"] for t in printed["tensors"]] == list(expected.tensors)
            assert list(printed["metadata"]) == list(expected.metadata)


class InfoRealModelTests:
    @pytest.mark.parametrize("name", real_models.NAMES)
    def test_pulled_model_and_tokenizer(self, name):
        """`krafla info` on each pulled model and its tokenizer prints every tensor (for the model:
        every block's tensors) exactly as the Python reader reads them."""
        pulled = real_models.real_model(name)
        for path in (pulled.mlb, pulled.mlt):
            expected = formats.read(path)
            status, out, err = run_info(path)
            assert (status, err) == (0, ""), path
            rows = out.splitlines()[out.splitlines().index("tensors") + 2:-2]
            assert [row.split()[0] for row in rows] == list(expected.tensors)
            for row, tensor in zip(rows, expected.tensors.values()):
                assert row.split()[1] == tensor.type.name and row.split()[-1] == str(tensor.nbytes)
        model = formats.read(pulled.mlb)
        n_layers = model.metadata["n_layers"]
        assert f"blk.{n_layers - 1}.ffn_down.weight" in model.tensors
        assert f"blk.{n_layers}.ffn_down.weight" not in model.tensors
