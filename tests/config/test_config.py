"""Config loading: overrides, unknown keys, types, and the one batch-size derivation."""

import re

import pytest

from isotrain.config import build_config, load_config, parse_override, read_yaml
from isotrain.errors import ConfigError
from isotrain.parallel.dims import resolve_dims
from isotrain.sizes import plan_batches
from isotrain.config import ParallelConfig

BASE = {"model": {"config": {"model_type": "llama"}}, "data": {"path": "x.jsonl"}}


def cfg_with(**train):
    return build_config({**BASE, "train": train})


def test_default_recipe_loads_with_overrides():
    cfg = load_config(None, ["train.lr=1e-3", "train.max_steps=7", "model.config.hidden_size=64"])
    assert cfg.train.lr == 1e-3 and cfg.train.max_steps == 7
    assert cfg.model.config["hidden_size"] == 64
    assert cfg.data.path.endswith("addition_train.jsonl")


def test_override_value_types_are_parsed():
    assert parse_override("train.lr=3e-4") == ("train.lr", 3e-4)
    assert parse_override("data.packing=true") == ("data.packing", True)
    assert parse_override("output_dir=runs/x") == ("output_dir", "runs/x")


def test_unknown_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r"unknown config key 'train.learning_rate'|did you mean"):
        build_config({**BASE, "train": {"lrr": 1}})
    with pytest.raises(ConfigError, match=r"'train.lrr'; did you mean train.lr\?"):
        build_config({**BASE, "train": {"lrr": 1}})


def test_a_moved_key_names_its_new_place():
    with pytest.raises(ConfigError, match=r"'data.add_special_tokens'; it is now model.add_special_tokens"):
        build_config({**BASE, "data": {**BASE.get("data", {}), "add_special_tokens": ["<x>"]}})


def test_wrong_type_names_field_and_value():
    with pytest.raises(ConfigError, match=r"train.global_batch_size='many' is invalid"):
        cfg_with(global_batch_size="many")


@pytest.mark.parametrize(
    "global_bs,micro_bs,world,ga", [(8, 8, 1, 1), (8, 2, 1, 4), (8, 2, 2, 2), (8, 2, 4, 1), (96, 3, 4, 8)]
)
def test_grad_accum_is_derived(global_bs, micro_bs, world, ga):
    cfg = cfg_with(global_batch_size=global_bs, micro_batch_size=micro_bs)
    plan = plan_batches(cfg, resolve_dims(cfg.parallel, world))
    assert plan.grad_accum_steps == ga
    assert plan.grad_accum_steps * plan.micro_batch_size * plan.dp_size == global_bs


def test_non_divisible_batch_suggests_values():
    cfg = cfg_with(global_batch_size=30, micro_batch_size=4)
    with pytest.raises(ConfigError) as err:
        plan_batches(cfg, resolve_dims(cfg.parallel, 2))
    message = str(err.value)
    assert "train.global_batch_size=30 is not divisible by train.micro_batch_size (4) × DP size (2) = 8" in message
    assert "[24, 32]" in message and "micro_batch_size in [1, 3, 5, 15]" in message


def test_degrees_fill_and_mismatch():
    assert resolve_dims(ParallelConfig(dp_shard=-1, dp_replicate=1), 4).dp_shard == 4
    assert resolve_dims(ParallelConfig(), 3).dp_replicate == 3
    with pytest.raises(ConfigError, match="but 4 processes were launched"):
        resolve_dims(ParallelConfig(dp_replicate=2, dp_shard=1), 4)


def test_the_edges_of_the_value_ranges_are_accepted():
    cfg = load_config(None, ["train.seed=4294967295", "train.betas=[0,0.999]", "train.grad_clip=0", "train.lr=1e30"])
    assert (cfg.train.seed, cfg.train.betas, cfg.train.grad_clip, cfg.train.lr) == (2**32 - 1, (0.0, 0.999), 0.0, 1e30)


@pytest.mark.parametrize("override, expected", [
    ("train.eps=.nan", "config value train.eps=nan is invalid: Input should be a finite number; use a finite number > 0"),
    ("train.betas=[0.9,.inf]", "train.betas=[0.9, inf] is invalid: each AdamW beta must be in [0, 1)"),
    ("rl.critic_lr=.inf", "config value rl.critic_lr=inf is invalid: Input should be a finite number"),
])
def test_non_finite_optimizer_settings_are_refused(override, expected):
    with pytest.raises(ConfigError, match="^" + re.escape(expected)):
        load_config(None, [override], recipe="rl" if override.startswith("rl.") else "train")


@pytest.mark.parametrize("override, expected", [
    ("parallel.timeout_s=0", "config value parallel.timeout_s=0 is invalid: Input should be greater than 0; use a "
     "finite number of seconds > 0, e.g. 600 (longer than a step or a save takes)"),
    ("parallel.timeout_s=.inf", "config value parallel.timeout_s=inf is invalid: Input should be a finite number"),
    ("checkpoint.preempt_grace_s=-5", "config value checkpoint.preempt_grace_s=-5 is invalid: Input should be greater "
     "than 0; use a finite number of seconds > 0, e.g. 90, or null to always save after a signal"),
])
def test_timeouts_must_be_positive_and_finite(override, expected):
    with pytest.raises(ConfigError, match="^" + re.escape(expected)):
        load_config(None, [override])
    cfg = load_config(None, [])
    assert (cfg.parallel.timeout_s, cfg.checkpoint.preempt_grace_s) == (600.0, None)


def test_a_key_written_twice_is_refused_with_its_lines(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("model:\n  config:\n    model_type: llama\ntrain:\n  lr: 1.0e-3\n  seed: 1\n  lr: 2.0e-3\n")
    with pytest.raises(ConfigError, match=re.escape("writes 'lr' twice (lines 5 and 7)")):
        load_config(path)
    path.write_text("model: {config: {model_type: llama}, config: {model_type: qwen2}}\n")
    with pytest.raises(ConfigError, match=re.escape("writes 'config' twice (lines 1 and 1)")):
        load_config(path)


def test_a_yaml_merge_key_may_still_be_overridden(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("optim: &base {lr: 1.0e-3, seed: 1}\ntrain:\n  <<: *base\n  lr: 2.0e-3\n")
    assert read_yaml(path)["train"] == {"lr": 2.0e-3, "seed": 1}
