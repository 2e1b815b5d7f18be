"""The generated config reference cannot drift from the code."""

import subprocess
import sys
from pathlib import Path

from isotrain.config_docs import DOCS_PATH, render_config_reference

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_config_md_matches_the_code():
    assert DOCS_PATH == REPO_ROOT / "docs" / "config.md"
    assert DOCS_PATH.read_text(encoding="utf-8") == render_config_reference(), (
        "docs/config.md is stale; run `python -m isotrain.config_docs`"
    )


def test_check_flag_fails_on_a_stale_file(tmp_path, monkeypatch):
    import isotrain.config_docs as config_docs

    stale = tmp_path / "config.md"
    stale.write_text(render_config_reference().replace("Peak learning rate.", "Old words."))
    monkeypatch.setattr(config_docs, "DOCS_PATH", stale)
    assert config_docs.main(["--check"]) == 1
    stale.write_text(render_config_reference())
    assert config_docs.main(["--check"]) == 0


def test_check_command_passes_on_the_committed_file():
    done = subprocess.run([sys.executable, "-m", "isotrain.config_docs", "--check"], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr

