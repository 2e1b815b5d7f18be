"""The RL batch-size derivation (invariant 7): every derived size, and the exact sentence of every refusal.

    samples per rollout         = P × n
    prompts per rank            = P / DP
    optimizer steps per rollout = P / M × ppo_epochs
    samples per optimizer step  = M × n               (the RL global batch)
    GA steps per rank           = M × n / (DP × micro)
"""

import re

import pytest

from isotrain.config import ParallelConfig, build_config, dump_config, _yaml_load
from isotrain.errors import ConfigError
from isotrain.parallel.dims import resolve_dims
from isotrain.sizes import RLBatchPlan, plan_rl_batches


def make_config(rl: dict, train: dict | None = None, parallel: dict | None = None):
    tree = {"model": {"config": {"model_type": "llama"}}, "data": {"path": "x.jsonl"}, "rl": rl,
            "train": train or {}}
    if parallel is not None:
        tree["parallel"] = parallel
    return build_config(tree, recipe="rl")


def plan(rl: dict, train: dict | None = None, world_size: int = 1, parallel: dict | None = None) -> RLBatchPlan:
    cfg = make_config(rl, train, parallel)
    return plan_rl_batches(cfg, resolve_dims(cfg.parallel, world_size))


# P, n, M (None: unset), ppo_epochs, micro, world size, extra rl/train/parallel settings, then the expected
# samples_per_rollout, prompts_per_rank_per_rollout, optimizer_steps_per_rollout, samples_per_optimizer_step, GA.
TABLE = [
    # The worked example of docs/rl-batch-sizes.md: only GA (and prompts per rank) change with the GPU count.
    pytest.param(64, 8, 16, 2, 4, 8, {}, (512, 8, 8, 128, 4), id="doc-example-8-ranks"),
    pytest.param(64, 8, 16, 2, 4, 2, {}, (512, 32, 8, 128, 16), id="doc-example-2-ranks"),
    pytest.param(64, 8, 16, 2, 4, 1, {}, (512, 64, 8, 128, 32), id="doc-example-1-rank"),
    # M unset means M = P: one optimizer step per rollout and epoch.
    pytest.param(16, 8, None, 1, 8, 1, {}, (128, 16, 1, 128, 16), id="defaults-1-rank"),
    pytest.param(16, 8, None, 1, 8, 4, {}, (128, 4, 1, 128, 4), id="defaults-4-ranks"),
    pytest.param(128, 4, 128, 4, 16, 8, {}, (512, 16, 4, 512, 4), id="M-equals-P-4-epochs"),
    pytest.param(32, 4, 8, 1, 2, 4, {}, (128, 8, 4, 32, 4), id="four-mini-batches"),
    pytest.param(12, 5, 4, 3, 5, 2, {}, (60, 6, 9, 20, 2), id="odd-group-3-epochs"),
    # M smaller than DP: a mini-batch's M × n samples are still split evenly over the ranks.
    pytest.param(8, 16, 1, 1, 4, 4, {}, (128, 2, 8, 16, 1), id="one-prompt-mini-batch"),
    pytest.param(3, 3, 3, 1, 3, 3, {"rl": {"algorithm": "rloo"}}, (9, 1, 1, 9, 1), id="rloo-3-ranks"),
    pytest.param(2, 2, None, 1, 1, 1, {}, (4, 2, 1, 4, 4), id="micro-1"),
    # reinforce_pp has no group baseline, so a group of one is a valid setting.
    pytest.param(6, 1, 2, 1, 1, 2, {"rl": {"algorithm": "reinforce_pp"}}, (6, 3, 3, 2, 1), id="reinforce_pp-n1"),
    # DDP × FSDP2: the DP size is the product of both degrees.
    pytest.param(8, 4, 4, 2, 2, 4, {"parallel": {"dp_replicate": 2, "dp_shard": 2}}, (32, 2, 4, 16, 2),
                 id="hsdp-2x2"),
    pytest.param(8, 4, 4, 2, 2, 4, {"parallel": {"dp_replicate": 1, "dp_shard": -1}}, (32, 2, 4, 16, 2),
                 id="fsdp-4"),
    # train.global_batch_size set by hand is accepted when it equals M × n.
    pytest.param(16, 4, 8, 1, 4, 2, {"train": {"global_batch_size": 32}}, (64, 8, 2, 32, 4),
                 id="explicit-global-batch-equal"),
]


@pytest.mark.parametrize("prompts, group, mini, epochs, micro, world_size, extra, expected", TABLE)
def test_derived_sizes(prompts, group, mini, epochs, micro, world_size, extra, expected):
    rl = {"prompts_per_step": prompts, "group_size": group, "ppo_epochs": epochs, **extra.get("rl", {})}
    if mini is not None:
        rl["mini_batch_prompts"] = mini
    train = {"micro_batch_size": micro, **extra.get("train", {})}
    got = plan(rl, train, world_size, extra.get("parallel"))

    assert (got.samples_per_rollout, got.prompts_per_rank_per_rollout, got.optimizer_steps_per_rollout,
            got.samples_per_optimizer_step, got.grad_accum_steps) == expected
    # The echoed settings and the identities that tie the derived sizes together.
    assert (got.world_size, got.dp_size, got.prompts_per_step, got.group_size) == (world_size, world_size, prompts, group)
    assert (got.mini_batch_prompts, got.ppo_epochs, got.micro_batch_size) == (mini or prompts, epochs, micro)
    assert got.prompts_per_rank_per_rollout * got.dp_size == prompts
    assert got.grad_accum_steps * micro * got.dp_size == got.samples_per_optimizer_step
    assert got.optimizer_steps_per_rollout * got.samples_per_optimizer_step == got.samples_per_rollout * epochs


def test_the_doc_example_row_by_row():
    got = plan({"prompts_per_step": 64, "group_size": 8, "mini_batch_prompts": 16, "ppo_epochs": 2},
               {"micro_batch_size": 4}, world_size=8)
    assert got.as_rows() == [
        ("world_size", 8), ("dp_size", 8), ("prompts_per_step", 64), ("group_size", 8),
        ("samples_per_rollout", 512), ("prompts_per_rank_per_rollout", 8), ("mini_batch_prompts", 16),
        ("ppo_epochs", 2), ("optimizer_steps_per_rollout", 8), ("samples_per_optimizer_step", 128),
        ("micro_batch_size", 4), ("grad_accum_steps", 4), ("max_off_policy_steps", 0),
    ]


def test_parallel_config_given_directly():
    cfg = make_config({"prompts_per_step": 16, "group_size": 4, "mini_batch_prompts": 8}, {"micro_batch_size": 2})
    degrees = resolve_dims(ParallelConfig(dp_replicate=2, dp_shard=2), 4)
    got = plan_rl_batches(cfg, degrees)
    assert (got.dp_size, got.grad_accum_steps, got.prompts_per_rank_per_rollout) == (4, 4, 4)


def test_default_global_batch_size_is_ignored_by_rl():
    # train.global_batch_size defaults to 8 for SFT; in RL it is null (derived), so left unset it never conflicts
    # with M × n.
    cfg = make_config({"prompts_per_step": 16, "group_size": 8})
    assert cfg.train.global_batch_size is None and "global_batch_size" not in cfg.train.model_fields_set
    assert plan_rl_batches(cfg, resolve_dims(cfg.parallel, 1)).samples_per_optimizer_step == 128


# rl settings, train settings, world size, the full sentence the user sees.
REJECTIONS = [
    pytest.param({"prompts_per_step": 10}, {}, 4,
                 "rl.prompts_per_step=10 cannot be split over 4 data-parallel ranks (each rank generates whole "
                 "groups); use rl.prompts_per_step in [8, 12]", id="P-not-divisible-by-DP"),
    pytest.param({"prompts_per_step": 3}, {}, 4,
                 "rl.prompts_per_step=3 cannot be split over 4 data-parallel ranks (each rank generates whole "
                 "groups); use rl.prompts_per_step in [4]", id="P-smaller-than-DP"),
    pytest.param({"prompts_per_step": 12, "mini_batch_prompts": 5}, {}, 1,
                 "rl.mini_batch_prompts=5 does not divide rl.prompts_per_step=12 into whole mini-batches; "
                 "use rl.mini_batch_prompts in [1, 2, 3, 4, 6, 12]", id="M-not-dividing-P"),
    pytest.param({"prompts_per_step": 8, "mini_batch_prompts": 16}, {}, 1,
                 "rl.mini_batch_prompts=16 is larger than rl.prompts_per_step=8; "
                 "use rl.mini_batch_prompts in [1, 2, 4, 8]", id="M-larger-than-P"),
    pytest.param({"prompts_per_step": 16, "group_size": 6, "mini_batch_prompts": 4}, {"micro_batch_size": 5}, 2,
                 "rl.mini_batch_prompts × rl.group_size = 4 × 6 = 24 sequences per optimizer step do not split "
                 "into micro-batches of train.micro_batch_size=5 on 2 data-parallel ranks; "
                 "use train.micro_batch_size in [1, 2, 3, 4, 6, 12]", id="micro-not-dividing-hint-micro"),
    pytest.param({"prompts_per_step": 8, "group_size": 3, "mini_batch_prompts": 2}, {"micro_batch_size": 1}, 4,
                 "rl.mini_batch_prompts × rl.group_size = 2 × 3 = 6 sequences per optimizer step do not split "
                 "into micro-batches of train.micro_batch_size=1 on 4 data-parallel ranks; "
                 "use rl.mini_batch_prompts in [4, 8]", id="Mn-not-divisible-by-DP"),
    pytest.param({"prompts_per_step": 16, "group_size": 4, "mini_batch_prompts": 8}, {"global_batch_size": 64}, 1,
                 "train.global_batch_size=64 is not used by RL: the global batch is rl.mini_batch_prompts × "
                 "rl.group_size = 32 sequences; remove it or set it to 32", id="explicit-global-batch-differs"),
    pytest.param({"prompts_per_step": 16, "group_size": 4}, {"global_batch_size": 8}, 1,
                 "train.global_batch_size=8 is not used by RL: the global batch is rl.mini_batch_prompts × "
                 "rl.group_size = 64 sequences; remove it or set it to 64", id="explicit-global-batch-equal-to-default"),
]


@pytest.mark.parametrize("rl, train, world_size, message", REJECTIONS)
def test_rejections_name_the_fields_and_valid_values(rl, train, world_size, message):
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        plan(rl, train, world_size)


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "dr_grpo", "rloo", "reinforce_pp_baseline"])
def test_group_of_one_is_rejected_with_a_group_baseline(algorithm):
    message = (f"rl.group_size=1 gives every sample an advantage of 0 with rl.algorithm={algorithm} (the baseline "
               "is the group's own reward); use rl.group_size of 2 or more")
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        plan({"algorithm": algorithm, "group_size": 1})


def test_group_of_one_is_accepted_without_a_group_baseline():
    got = plan({"algorithm": "reinforce_pp", "group_size": 1, "prompts_per_step": 16}, {"micro_batch_size": 4})
    assert (got.samples_per_rollout, got.grad_accum_steps) == (16, 4)


@pytest.mark.parametrize("section, key, value", [
    ("rl", "group_size", 0),
    ("rl", "group_size", -2),
    ("rl", "prompts_per_step", 0),
    ("rl", "prompts_per_step", -1),
    ("rl", "mini_batch_prompts", 0),
    ("rl", "ppo_epochs", 0),
    ("train", "micro_batch_size", 0),
])
def test_zero_or_negative_sizes_name_the_field(section, key, value):
    tree = {"model": {"config": {"model_type": "llama"}}, "data": {"path": "x.jsonl"}, section: {key: value}}
    message = f"config value {section}.{key}={value} is invalid: Input should be greater than 0"
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        build_config(tree, recipe="rl")


@pytest.mark.parametrize("rl", [{"prompts_per_step": 16, "group_size": 4},
                                {"prompts_per_step": 16, "group_size": 4, "mini_batch_prompts": 4, "ppo_epochs": 2},
                                {"algorithm": "dapo", "prompts_per_step": 8, "group_size": 2, "max_new_tokens": 40}])
def test_resolved_config_round_trips(rl):
    # A run writes dump_config(cfg) to <output_dir>/config.yaml as it is: the derived global batch is not written
    # back (it stays null), and reading the file again plans the same batches and presets.
    cfg = make_config(rl, {"micro_batch_size": 4})
    degrees = resolve_dims(cfg.parallel, 2)
    before = plan_rl_batches(cfg, degrees)
    assert cfg.train.global_batch_size is None
    text = dump_config(cfg)
    again = build_config(_yaml_load(text), recipe="rl")
    assert plan_rl_batches(again, degrees) == before
    assert again == cfg and dump_config(again) == text


# --- rl.algorithm presets: defaults for the fields left unset; explicit values win ---

@pytest.mark.parametrize("max_new_tokens", [16, 100, 1024])
def test_dapo_preset(max_new_tokens):
    rl = make_config({"algorithm": "dapo", "max_new_tokens": max_new_tokens}).rl
    assert (rl.clip_low, rl.clip_high) == (0.2, 0.28)
    assert rl.dynamic_sampling is True
    assert rl.loss_agg == "token-mean"
    assert rl.overlong_buffer == max_new_tokens // 4
    assert rl.advantage == "grpo" and rl.norm_adv_by_std is True


def test_explicit_values_win_over_the_dapo_preset():
    rl = make_config({"algorithm": "dapo", "clip_high": 0.3, "dynamic_sampling": False, "overlong_buffer": 0,
                      "loss_agg": "seq-mean-token-mean"}).rl
    assert rl.clip_high == 0.3
    # falsy explicit values are settings too, not "unset"
    assert rl.dynamic_sampling is False and rl.overlong_buffer == 0
    assert rl.loss_agg == "seq-mean-token-mean"
    assert rl.clip_low == 0.2  # still from the preset


def test_dr_grpo_preset():
    rl = make_config({"algorithm": "dr_grpo"}).rl
    assert rl.loss_agg == "seq-mean-token-sum-norm"
    assert rl.norm_adv_by_std is False
    assert rl.advantage == "dr_grpo"


def test_grpo_is_the_default_preset():
    rl = make_config({}).rl
    assert rl.algorithm == "grpo"
    assert (rl.loss_agg, rl.norm_adv_by_std, rl.clip_high, rl.kl_coef, rl.dynamic_sampling) == (
        "seq-mean-token-mean", True, 0.2, 0.0, False)


@pytest.mark.parametrize("algorithm", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_presets_put_kl_in_the_reward(algorithm):
    rl = make_config({"algorithm": algorithm}).rl
    assert (rl.kl_coef, rl.kl_in_reward, rl.loss_agg) == (0.001, True, "token-mean")
