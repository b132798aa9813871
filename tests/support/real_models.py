"""The three real models, pulled once into the krafla cache and shared by every test run.

`real_model(name, type="q4_0")` returns a `krafla_twisted.cli.models.PulledModel`: the q4_0 files
(`krafla pull --type q4_0`), or other types (None: the file's own types, what `krafla pull` keeps),
converted once from the cached, checksummed GGUF.
The cache is $KRAFLA_HOME or ~/.cache/krafla, so only the first run downloads (about 840 MB for
all three) and converts; a lock makes concurrent test processes wait for one pull.
"""

import functools

import gguf

from krafla_twisted.cli import models

# The three small models the suite runs on; the catalogue has more (qwen2.5-coder-1.5b, 1.1 GB), which
# the tests do not pull.
NAMES = ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m")


def real_model(name, type="q4_0"):
    """The PulledModel (mlb, mlt, chat, name) of a known model with its matrices as `type` (None:
    the published file's own types, its blocks copied)."""
    return models.pull(name, progress=False, type_name=type)


@functools.lru_cache(maxsize=None)
def source_gguf(name):
    """The checked GGUF the real model's files are converted from (downloaded if need be); its sha256
    (up to 490 MB read) is checked once per test process."""
    return models.fetch_source(name, progress=False)


@functools.lru_cache(maxsize=None)
def gguf_reader(name):
    """A shared gguf-py reader of the source GGUF (reading the 262144-token vocabulary takes seconds)."""
    return gguf.GGUFReader(source_gguf(name))
