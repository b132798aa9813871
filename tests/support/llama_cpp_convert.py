"""llama.cpp's own Hugging Face -> GGUF converter, for tests that need GGUFs written by it.

`convert_hf_to_gguf(folder, out)` runs llama.cpp's `convert_hf_to_gguf.py` (with its own
`conversion/` package and `gguf-py`) on a Hugging Face folder, writing an f32 GGUF. The converter
is taken from the `llama-cpp-python` source distribution on the package index (it vendors
llama.cpp), fetched once with `pip download` (so pip's own settings choose the index) and
unpacked into $KRAFLA_HOME/testdata/llama.cpp-convert/; never skipped. No llama.cpp code is in
this repository.
"""

import os
import pathlib
import subprocess
import sys
import tarfile
import tempfile

from krafla_twisted.cli import models

_WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/", "models/ggml-vocab-", "LICENSE")


def converter_dir():
    """The folder holding convert_hf_to_gguf.py (fetched on first use)."""
    dest = models.krafla_home() / "testdata" / "llama.cpp-convert"
    if not (dest / "convert_hf_to_gguf.py").is_file():
        _fetch(dest)
    return dest


def _fetch(dest):
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        subprocess.check_call([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                               "--dest", tmp, "llama-cpp-python"])
        archive = next(pathlib.Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        unpacked = pathlib.Path(tmp) / "unpacked"
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                _, _, inside = member.name.partition("/vendor/llama.cpp/")
                if not inside or not inside.startswith(_WANTED) or not member.isfile():
                    continue
                target = unpacked / inside
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
        if not (unpacked / "convert_hf_to_gguf.py").is_file():
            raise RuntimeError(f"{archive.name} has no vendor/llama.cpp/convert_hf_to_gguf.py")
        try:
            unpacked.rename(dest)
        except OSError:
            if not (dest / "convert_hf_to_gguf.py").is_file():  # another process may have won the race
                raise


def convert_hf_to_gguf(folder, out):
    """Run llama.cpp's converter on `folder`, writing the f32 GGUF `out`; returns out."""
    script = converter_dir() / "convert_hf_to_gguf.py"
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, str(script), str(folder), "--outfile", str(out), "--outtype", "f32"],
                            capture_output=True, text=True, env=env, timeout=900)
    if result.returncode:
        raise RuntimeError(f"llama.cpp's convert_hf_to_gguf.py failed on {folder}:\n{result.stderr[-4000:]}")
    return pathlib.Path(out)
