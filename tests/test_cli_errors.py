"""Bad input: each case exits non-zero with one clear line naming the problem, and no traceback."""

from __future__ import annotations

import pytest

from helpers import isotrain_cli


def write(path, text):
    path.write_text(text)
    return str(path)


CASES = {
    "typo key": (["train.lrr=0.1"], "unknown config key 'train.lrr'; did you mean train.lr?"),
    "wrong type": (["train.max_steps=abc"], "config value train.max_steps='abc' is invalid"),
    "negative lr": (["train.lr=-1"], "train.lr=-1 is invalid: Input should be greater than 0"),
    "bad dtype": (["model.dtype=float64"], "model.dtype='float64' is invalid"),
    "non-divisible batch": (
        ["train.global_batch_size=30", "train.micro_batch_size=4"],
        "train.global_batch_size=30 is not divisible by train.micro_batch_size (4)",
    ),
    "bad model type": (["model.config.model_type=gpt9"], "model.config.model_type='gpt9' is not a transformers model type"),
    "missing model dir": (
        ["model.config=null", "model.name_or_path=/nonexistent/model"],
        "model.name_or_path='/nonexistent/model' is not a model directory",
    ),
    "layout mismatch": (["parallel.dp_replicate=2"], "but 1 processes were launched"),
    "bad format": (["data.format=csv"], "data.format='csv' is invalid"),
    "missing data file": (["data.path=/nonexistent/data.jsonl"], "/nonexistent/data.jsonl' does not exist"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_override(tmp_path, name):
    overrides, expected = CASES[name]
    proc = isotrain_cli(["train", *overrides, f"output_dir={tmp_path / 'run'}"])
    assert_clean_error(proc, expected)


def assert_clean_error(proc, expected: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and expected in " ".join(lines[0].split()), proc.stderr


def test_override_without_value(tmp_path):
    from isotrain.recipes import default_recipe_path

    proc = isotrain_cli(["train", str(default_recipe_path()), "train.lr"])
    assert_clean_error(proc, "override 'train.lr' is not of the form key.sub=value")


def test_missing_config_file(tmp_path):
    assert_clean_error(isotrain_cli(["train", str(tmp_path / "nope.yaml")]), "nope.yaml' does not exist")


def test_invalid_yaml(tmp_path):
    path = write(tmp_path / "bad.yaml", "train:\n  lr: [1,\n")
    assert_clean_error(isotrain_cli(["train", path]), "is not valid YAML at line")


def test_all_rows_malformed_is_an_error(tmp_path):
    data = write(tmp_path / "bad.jsonl", '{"prompt": "1+1="}\nnot json\n{"completion": 3}\n')
    proc = isotrain_cli(["train", f"data.path={data}", f"output_dir={tmp_path / 'run'}"])
    assert_clean_error(proc, "bad.jsonl")


def test_empty_data_file_is_an_error(tmp_path):
    data = write(tmp_path / "empty.jsonl", "")
    proc = isotrain_cli(["train", f"data.path={data}", f"output_dir={tmp_path / 'run'}"])
    assert_clean_error(proc, "empty.jsonl")


def test_debug_shows_traceback(tmp_path):
    proc = isotrain_cli(["--debug", "train", "train.lrr=1"])
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_config_show_prints_derived_sizes():
    proc = isotrain_cli(["config", "show", "train.global_batch_size=64", "train.micro_batch_size=8", "--world-size", "2"])
    assert proc.returncode == 0, proc.stderr
    assert "# grad_accum_steps: 4" in proc.stdout and "# dp_size: 2" in proc.stdout
    assert "global_batch_size: 64" in proc.stdout
