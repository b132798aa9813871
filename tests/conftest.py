"""Shared fixtures. Keep each fixture small; helpers with real logic live in tests/support/."""

import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
TESTDATA = REPO / "tests" / "data"


def testdata_dir():
    """tests/data: the templates, vocabularies and tables the suite reads (tests/data/README.md)."""
    return TESTDATA


@pytest.fixture(scope="session")
def testdata():
    return testdata_dir()


@pytest.fixture(scope="session")
def qwen_chat_server():
    """The default model served with `--chat qwen` (a template with a tool format), for the tests of
    tool calls and structured output in several modules: one server for the whole run."""
    from tests.support.real_models import real_model
    from tests.support.server import ServerProcess  # imported here: it imports twisted's reactor

    model = real_model("smollm2-135m")
    process = ServerProcess([str(model.mlb), "-z", str(model.mlt), "--chat", "qwen", "-t", "2"]).start()
    yield process
    process.stop()
