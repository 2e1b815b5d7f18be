"""`commit`, the one rename-into-place protocol: a file or directory appears whole under its name or not at all."""

from __future__ import annotations

import pytest

from isotrain.checkpoint.files import atomic_write_text, write_text
from isotrain.disk import commit


def test_a_file_replaces_the_old_one_in_one_rename(tmp_path):
    (tmp_path / "latest").write_text("step-00000001\n")
    atomic_write_text(tmp_path / "latest", "step-00000002\n")
    assert (tmp_path / "latest").read_text() == "step-00000002\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]  # no temporary file left


def test_a_directory_takes_the_name_and_an_old_one_is_set_aside_then_deleted(tmp_path):
    final = tmp_path / "step-00000002"
    final.mkdir()
    write_text(final / "stale.json", "{}")
    tmp = tmp_path / "step-00000002.tmp-abc"
    tmp.mkdir()
    write_text(tmp / "manifest.json", "new")
    commit(tmp, final, aside="old-abc")
    assert sorted(p.name for p in final.iterdir()) == ["manifest.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]


def test_without_aside_a_non_empty_directory_is_kept_and_the_rename_fails(tmp_path):
    # The data cache relies on this: when two ranks build the same entry, the first one stays.
    entry, tmp = tmp_path / "entry", tmp_path / ".tmp-entry"
    for directory, text in ((entry, "first"), (tmp, "second")):
        directory.mkdir()
        write_text(directory / "stats.json", text)
    with pytest.raises(OSError):
        commit(tmp, entry)
    assert (entry / "stats.json").read_text() == "first"
    assert (tmp / "stats.json").read_text() == "second"


def test_an_empty_directory_is_replaced(tmp_path):
    # `ckpt export` accepts an existing empty output directory.
    out, tmp = tmp_path / "out", tmp_path / "out.tmp-1"
    out.mkdir()
    tmp.mkdir()
    write_text(tmp / "config.json", "{}")
    commit(tmp, out)
    assert [p.name for p in out.iterdir()] == ["config.json"] and not tmp.exists()
