"""The heavy check of the numpy reference against Hugging Face transformers (torch, CPU).

These tests need the packages of tests/reference/requirements.txt, which the main test
environment does not install: `make test-reference` (or `tox -e reference`) builds the
.venv-reference environment and sets KRAFLA_REFERENCE=1. Without that variable this folder is
not collected, so a plain `pytest tests` in the main environment does not trip over a missing
torch; with it, a missing package is an import error, never a skip.
"""

import os

if os.environ.get("KRAFLA_REFERENCE") != "1":
    collect_ignore_glob = ["test_*.py"]

# Everything is local (GGUF files in the krafla cache, folders the tests write): never ask a hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
