"""Bad input: each case exits non-zero with one clear line naming the problem, and no traceback."""

from __future__ import annotations

import functools

import pytest

from helpers import isotrain_cli, run_concurrently


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
    "layout mismatch": (["parallel.dp_replicate=2"], "but 1 process was launched; launch 2 processes (torchrun --nproc-per-node 2)"),
    "bad format": (["data.format=csv"], "data.format='csv' is invalid"),
    "missing data file": (["data.path=/nonexistent/data.jsonl"], "/nonexistent/data.jsonl' does not exist"),
}


# Every case below is an independent `isotrain` process: they run side by side, one per CPU core,
# once per module (cli_runs), and each test checks its own process.
OTHER_COMMANDS = ("override without value", "missing config file", "invalid yaml", "all rows malformed",
                  "empty data file", "debug", "config show")


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    """{case: CompletedProcess} of every command of this module."""
    from isotrain.recipes import default_recipe_path

    root = tmp_path_factory.mktemp("cli")
    commands = {name: ["train", *overrides, f"output_dir={root / name / 'run'}"] for name, (overrides, _) in CASES.items()}
    commands["override without value"] = ["train", str(default_recipe_path()), "train.lr"]
    commands["missing config file"] = ["train", str(root / "nope.yaml")]
    commands["invalid yaml"] = ["train", write(root / "bad.yaml", "train:\n  lr: [1,\n")]
    malformed = write(root / "bad.jsonl", '{"prompt": "1+1="}\nnot json\n{"completion": 3}\n')
    commands["all rows malformed"] = ["train", f"data.path={malformed}", f"output_dir={root / 'malformed' / 'run'}"]
    empty = write(root / "empty.jsonl", "")
    commands["empty data file"] = ["train", f"data.path={empty}", f"output_dir={root / 'empty' / 'run'}"]
    commands["debug"] = ["--debug", "train", "train.lrr=1"]
    commands["config show"] = ["config", "show", "train.global_batch_size=64", "train.micro_batch_size=8",
                               "--world-size", "2"]
    assert set(commands) == {*CASES, *OTHER_COMMANDS}
    return run_concurrently({name: functools.partial(isotrain_cli, args) for name, args in commands.items()})


@pytest.mark.parametrize("name", list(CASES))
def test_bad_override(cli_runs, name):
    _, expected = CASES[name]
    assert_clean_error(cli_runs[name], expected)


def assert_clean_error(proc, expected: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and expected in " ".join(lines[0].split()), proc.stderr


def test_override_without_value(cli_runs):
    assert_clean_error(cli_runs["override without value"], "override 'train.lr' is not of the form key.sub=value")


def test_missing_config_file(cli_runs):
    assert_clean_error(cli_runs["missing config file"], "nope.yaml' does not exist")


def test_invalid_yaml(cli_runs):
    assert_clean_error(cli_runs["invalid yaml"], "is not valid YAML at line")


def test_all_rows_malformed_is_an_error(cli_runs):
    assert_clean_error(cli_runs["all rows malformed"], "bad.jsonl")


def test_empty_data_file_is_an_error(cli_runs):
    assert_clean_error(cli_runs["empty data file"], "empty.jsonl")


def test_debug_shows_traceback(cli_runs):
    proc = cli_runs["debug"]
    assert proc.returncode != 0 and "Traceback" in proc.stderr


def test_config_show_prints_derived_sizes(cli_runs):
    proc = cli_runs["config show"]
    assert proc.returncode == 0, proc.stderr
    assert "# grad_accum_steps: 4" in proc.stdout and "# dp_size: 2" in proc.stdout
    assert "global_batch_size: 64" in proc.stdout
