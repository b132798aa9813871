"""krafla: an OpenAI-compatible server for language models on your own CPU."""

import os

__version__ = "0.7.0"

# krafla's own numpy work is on small arrays; the engine's threads do the heavy lifting. numpy's
# OpenBLAS starts a thread per core at import, and those threads spin for a while on cores the
# engine needs (1.5 to 2.5% of a prompt's CPU samples under perf with -t 2). One BLAS thread,
# unless the environment says otherwise; set before anything in the package imports numpy.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
