"""Shared fixtures. Keep each fixture small; helpers with real logic live in tests/support/."""

import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def testdata_dir():
    """../shared/testdata beside the repository, or $KRAFLA_TESTDATA."""
    path = pathlib.Path(os.environ.get("KRAFLA_TESTDATA", REPO.parent / "shared" / "testdata"))
    if not path.is_dir():
        raise RuntimeError(f"test data not found at {path}; set KRAFLA_TESTDATA")
    return path


@pytest.fixture(scope="session")
def testdata():
    return testdata_dir()
