"""The three real models, pulled once into the krafla cache and shared by every test run.

`real_model(name, type="q4_0")` returns a `krafla_twisted.models.PulledModel`: the q4_0 files
are what `krafla pull` makes; other types are converted once from the cached, checksummed GGUF.
The cache is $KRAFLA_HOME or ~/.cache/krafla, so only the first run downloads (about 840 MB for
all three) and converts; a lock makes concurrent test processes wait for one pull.
"""

from krafla_twisted import models

NAMES = tuple(models.KNOWN_MODELS)


def real_model(name, type="q4_0"):
    return models.pull(name, progress=False, type_name=type)


def source_gguf(name):
    """The checked GGUF the model was converted from (pulled first if need be)."""
    real_model(name)
    return models.model_dir(name) / models.KNOWN_MODELS[name].source
