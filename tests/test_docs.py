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



def test_errors_md_lists_every_message_the_code_raises():
    from isotrain.error_catalogue import DOCS_PATH as ERRORS_PATH
    from isotrain.error_catalogue import render

    assert ERRORS_PATH.read_text(encoding="utf-8") == render(), (
        "docs/errors.md is stale; run `python -m isotrain.error_catalogue`"
    )
    text = ERRORS_PATH.read_text(encoding="utf-8")
    for sentence in ("data.packing=true does not apply to RL", "is in use by another run",
                     "the run stopped before this update", "--world-size {world_size} is invalid"):
        assert sentence in text, sentence


def test_a_new_message_changes_the_catalogue(tmp_path, monkeypatch):
    import isotrain.error_catalogue as catalogue

    package = tmp_path / "isotrain"
    package.mkdir()
    (package / "new.py").write_text(
        "from isotrain.errors import ConfigError\n\n\ndef check(x):\n"
        "    message = f'x={x} is wrong; use 1'\n"
        "    if x:\n        raise ConfigError(message)\n"
        "    raise ConfigError(f'y={x!r} is wrong; ' + 'use 2')\n")
    monkeypatch.setattr(catalogue, "PACKAGE", package)
    assert [(e.module, e.function, e.text) for e in catalogue.collect()] == [
        ("isotrain.new", "check", "x={x} is wrong; use 1"), ("isotrain.new", "check", "y={x!r} is wrong; use 2")]


def test_the_docs_site_builds_without_broken_links(tmp_path):
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO_ROOT / "mkdocs.yml"),
                           "-d", str(tmp_path / "site")], capture_output=True, text=True, env={
                               **__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "errors" / "index.html").is_file()
