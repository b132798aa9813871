"""The scripts of bench/ imported as modules, for the tests of their arithmetic and choices (they
import each other from beside themselves, so bench/ goes on the path while a test uses one)."""

import contextlib
import importlib
import os
import sys

from tests.support.server import REPO


@contextlib.contextmanager
def bench_module(name):
    """bench/NAME.py as a module, with bench/ on sys.path until the block ends."""
    bench = os.path.join(REPO, "bench")
    sys.path.insert(0, bench)
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(bench)
