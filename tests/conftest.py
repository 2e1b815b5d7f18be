import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).parent
sys.path.insert(0, str(TESTS_DIR))  # shared helpers live in tests/helpers.py



@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    """Tokenized-data caches of the tests (and of the processes they launch) never touch the user's."""
    monkeypatch.setenv("ISOTRAIN_CACHE", str(tmp_path / "cache"))
