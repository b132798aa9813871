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
