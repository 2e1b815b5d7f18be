import os
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).parent
sys.path.insert(0, str(TESTS_DIR))  # shared helpers live in tests/helpers.py



@pytest.fixture(scope="session", autouse=True)
def _session_cache(tmp_path_factory):
    """Module-scoped fixtures run before `_isolated_cache`; their runs get a cache of the session."""
    previous = os.environ.get("ISOTRAIN_CACHE")
    os.environ["ISOTRAIN_CACHE"] = str(tmp_path_factory.mktemp("session-cache"))
    yield
    if previous is None:
        os.environ.pop("ISOTRAIN_CACHE", None)
    else:
        os.environ["ISOTRAIN_CACHE"] = previous


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Tokenized-data caches of the tests (and of the processes they launch) never touch the user's."""
    monkeypatch.setenv("ISOTRAIN_CACHE", str(tmp_path / "cache"))
