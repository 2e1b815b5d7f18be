"""Bad input: each case exits non-zero with one clear line naming the problem, and no traceback."""

from __future__ import annotations

import functools

import pytest

from helpers import HANG_S, REPO, TINY_RUN, assert_clean_error, assert_error_sentence, run_concurrently
from zygote import run_forked_ranks


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
    "infinite lr": (["train.lr=.inf"],
                    "config value train.lr=inf is invalid: Input should be a finite number; use a finite number > 0, "
                    "e.g. 3e-4"),
    "nan lr": (["train.lr=nan"],
               "config value train.lr='nan' is invalid: Input should be a finite number; use a finite number > 0, "
               "e.g. 3e-4"),
    "betas out of range": (["train.betas=[1.5,2]"],
                           "train.betas=[1.5, 2.0] is invalid: each AdamW beta must be in [0, 1); use e.g. "
                           "train.betas=[0.9,0.95]"),
    "negative seed": (["train.seed=-1"],
                      "config value train.seed=-1 is invalid: Input should be greater than or equal to 0; use an "
                      "integer from 0 to 4294967295 (2**32 - 1)"),
    "seed too large": ([f"train.seed={2**32}"],
                       "config value train.seed=4294967296 is invalid: Input should be less than or equal to "
                       "4294967295; use an integer from 0 to 4294967295 (2**32 - 1)"),
    "infinite grad clip": (["train.grad_clip=.inf"],
                           "config value train.grad_clip=inf is invalid: Input should be a finite number; use a finite "
                           "number >= 0 (0 disables clipping)"),
}

# A fresh tiny policy on the bundled prompts: each RL run below takes seconds.
TINY_RL = ["rl", "model.name_or_path=null", "model.config.model_type=llama", "model.config.hidden_size=32",
           "model.config.intermediate_size=64", "model.config.num_hidden_layers=2",
           "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "tokenizer.type=char",
           "rl.prompts_per_step=4", "rl.group_size=4", "train.micro_batch_size=8", "train.max_steps=2",
           "eval.path=null", "logging.progress=false"]
FAILING_REWARDS = REPO / "tests" / "rl" / "failing_rewards.py"


# Every case below is an independent `isotrain` process: they run side by side, one per CPU core,
# once per module (cli_runs), and each test checks its own process.
OTHER_COMMANDS = ("override without value", "missing config file", "invalid yaml", "all rows malformed",
                  "empty data file", "debug", "config show", "duplicate section", "diverging lr", "reward always fails",
                  "reward sometimes fails")


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
    commands["duplicate section"] = ["train", write(root / "twice.yaml", "model:\n  config: {model_type: llama}\n"
                                                    "train:\n  lr: 1.0e-3\ndata:\n  packing: true\ntrain:\n  max_steps: 3\n")]
    # lr=1e30: the first update throws the weights to ~1e30, the next step's gradients are NaN.
    commands["diverging lr"] = ["train", *TINY_RUN, "train.lr=1e30", "train.max_steps=4", "checkpoint.every_steps=1",
                                f"output_dir={root / 'diverging' / 'run'}"]
    commands["reward always fails"] = [*TINY_RL, f"rl.reward={FAILING_REWARDS}:always_raises",
                                       "checkpoint.every_steps=1", f"output_dir={root / 'reward-fails' / 'run'}"]
    commands["reward sometimes fails"] = [*TINY_RL, f"rl.reward={FAILING_REWARDS}:raises_on_odd_answers",
                                          f"output_dir={root / 'reward-sometimes' / 'run'}"]
    assert set(commands) == {*CASES, *OTHER_COMMANDS}
    # The training runs take longest: they start first.
    slow = ["diverging lr", "reward always fails", "reward sometimes fails"]
    order = [*slow, *(name for name in commands if name not in slow)]
    # Forked from a process that has imported isotrain (tests/zygote.py): the seconds of imports are paid once, not
    # by each of these 30 commands.
    runs = run_concurrently({name: functools.partial(run_forked_ranks, 1, commands[name]) for name in order})
    runs["root"] = root
    return runs


@pytest.mark.parametrize("name", list(CASES))
def test_bad_override(cli_runs, name):
    _, expected = CASES[name]
    assert_clean_error(cli_runs[name], expected)


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


def test_a_section_written_twice_is_refused(cli_runs):
    path = cli_runs["root"] / "twice.yaml"
    assert_error_sentence(cli_runs["duplicate section"], f"config file {str(path)!r} writes 'train' twice "
                          "(lines 3 and 7); YAML would silently drop the first: merge them into one")


def test_a_non_finite_gradient_stops_before_the_update_and_saves_nothing_non_finite(cli_runs):
    import json

    import torch
    from safetensors.torch import load_file

    assert_error_sentence(cli_runs["diverging lr"], "step 2: the gradient norm is nan; the run stopped before this "
                          "update, so the weights and every saved checkpoint stay finite; lower train.lr or check "
                          "the data")
    run = cli_runs["root"] / "diverging" / "run"
    checkpoints = run / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step-00000001"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step-00000001"]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [1]
    files = sorted(checkpoints.rglob("*.safetensors"))
    assert files
    for path in files:
        for name, tensor in load_file(path).items():
            assert torch.isfinite(tensor.double()).all(), (path, name)
    # The first update really was huge: the guard, not luck, kept the weights finite.
    weights = load_file(checkpoints / "step-00000001" / "model.safetensors")
    assert max(float(t.abs().max()) for t in weights.values()) > 1e20


def test_a_reward_that_always_fails_stops_the_run(cli_runs):
    assert_error_sentence(cli_runs["reward always fails"], "step 1: the reward function failed on all 16 samples of "
                          "this step, first with ValueError: cannot score '64'; fix "
                          f"rl.reward='{FAILING_REWARDS}:always_raises' and run again")
    assert not (cli_runs["root"] / "reward-fails" / "run" / "checkpoints" / "latest").exists()


def test_a_reward_that_sometimes_fails_is_shown_once(cli_runs):
    proc = cli_runs["reward sometimes fails"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    shown = ("the reward function raised KeyError: 'odd answer' on a sample; such samples are scored 0 and counted "
             "in the metric reward_errors")
    assert proc.stdout.count(shown) == 1, proc.stdout
    assert proc.stdout.count("KeyError") == 1


def test_a_config_error_is_reported_before_torch_is_imported():
    """A typo in an override is caught in a fraction of a second: parsing and validating the config import neither
    torch nor transformers (each `isotrain` subcommand imports them only once the config is valid)."""
    import subprocess
    import sys

    code = ("import sys\nfrom isotrain.cli import main\ntry:\n    main(['train', 'train.lrr=0.1'])\n"
            "except SystemExit as exit:\n    print(exit.code, sorted({'torch', 'transformers'} & set(sys.modules)))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=HANG_S)
    assert proc.stdout.split("\n")[0] == "2 []", (proc.stdout, proc.stderr)
    assert "did you mean train.lr?" in proc.stderr
