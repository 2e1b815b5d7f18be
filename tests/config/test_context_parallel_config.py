"""parallel.cp and parallel.cp_style (ulysses, ring): where CP takes its ranks, what it leaves to DP, and every
refusal as the one sentence a user sees (`isotrain config show`, which checks what a run checks before any work)."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from helpers import assert_error_sentence
from test_early_checks import cli

from isotrain.config import ParallelConfig, build_config, load_config
from isotrain.errors import ConfigError
from isotrain.parallel.dims import check_cp_fits, resolve_dims
from isotrain.sizes import plan_batches

TINY = ["model.config.hidden_size=32", "model.config.num_hidden_layers=1", "model.config.intermediate_size=64"]


def test_cp_takes_ranks_of_its_own_and_dp_stays_pure():
    dims = resolve_dims(ParallelConfig(cp=2), 4)  # dp_replicate=-1 takes the rest
    assert (dims.dp_replicate, dims.dp_shard, dims.cp, dims.world_size, dims.dp_size) == (2, 1, 2, 4, 2)
    cfg = load_config(None, ["parallel.cp=2", "train.global_batch_size=8", "train.micro_batch_size=2"])
    plan = plan_batches(cfg, resolve_dims(cfg.parallel, 4))
    assert (plan.dp_size, plan.grad_accum_steps, plan.samples_per_rank_per_step) == (2, 2, 4)
    with pytest.raises(ConfigError,
                       match=r"^parallel.dp_replicate × dp_shard × cp × tp = 1 × 2 × 2 × 1 = 4 but 2 processes were"):
        resolve_dims(ParallelConfig(dp_replicate=1, dp_shard=2, cp=2), 2)
    with pytest.raises(ConfigError, match=r"^parallel.cp=2 needs a multiple of 2 processes, but 3 processes were"):
        resolve_dims(ParallelConfig(cp=2), 3)


def test_cp_takes_mixture_of_experts_models_and_expert_parallelism():
    """The router terms sum their loads over DP × CP, the EP groups are carved per CP (and TP) coordinate
    (tests/train/test_moe_equivalence.py)."""
    dims = resolve_dims(ParallelConfig(cp=2, ep=2), 4)
    assert (dims.dp_size, dims.cp, dims.ep) == (2, 2, 2)
    dims = resolve_dims(ParallelConfig(cp=2, ep=2, tp=2), 8)
    assert (dims.dp_size, dims.cp, dims.ep, dims.tp) == (2, 2, 2, 2)
    config = AutoConfig.for_model("qwen3_moe", hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                  num_experts=4)
    for style in ("ulysses", "ring"):
        check_cp_fits(2, config, style)


def test_ring_is_accepted_and_cp_1_ignores_it():
    assert resolve_dims(ParallelConfig(cp_style="ring"), 2).cp == 1
    dims = resolve_dims(ParallelConfig(cp=4, cp_style="ring"), 4)
    assert (dims.cp, dims.cp_style, dims.dp_size) == (4, "ring", 1)


def test_ring_takes_more_ranks_than_heads():
    """Ring attention keeps every head on every rank: CP 4 (or 3) of a model with 2 heads and 1 KV head."""
    config = AutoConfig.for_model("llama", hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    for cp in (3, 4):
        check_cp_fits(cp, config, "ring")
    with pytest.raises(ConfigError, match=r"^parallel.cp=4 does not divide the model's attention heads"):
        check_cp_fits(4, config, "ulysses")


@pytest.mark.parametrize("sizes, sentence", [
    (dict(attention_dropout=0.1), "parallel.cp_style=ring computes attention without dropout, and this model has "
     "attention_dropout=0.1; set model.config.attention_dropout=0 or parallel.cp_style=ulysses"),
    (dict(model_type="mistral", sliding_window=16), "parallel.cp=2 attends over whole sequences, and this mistral "
     "model has a sliding window of 16 tokens; set parallel.cp=1"),
])
def test_models_that_ring_does_not_split_are_refused(sizes, sentence):
    sizes = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, **sizes}
    config = AutoConfig.for_model(sizes.pop("model_type", "llama"), **sizes)
    with pytest.raises(ConfigError) as err:
        check_cp_fits(2, config, "ring")
    assert str(err.value) == sentence


@pytest.mark.parametrize("sizes, cp, sentence", [
    (dict(num_attention_heads=4, num_key_value_heads=2), 3, "parallel.cp=3 does not divide the model's attention "
     "heads (num_attention_heads=4), which Ulysses splits over the context-parallel ranks; use a parallel.cp that "
     "divides 4, or parallel.cp_style=ring"),
    (dict(num_attention_heads=6, num_key_value_heads=3, hidden_size=48), 2, "parallel.cp=2 neither divides nor is a "
     "multiple of the model's key/value heads (num_key_value_heads=3); use a parallel.cp that divides 3 or is a "
     "multiple of it, or parallel.cp_style=ring"),
    (dict(model_type="mistral", sliding_window=16), 2, "parallel.cp=2 attends over whole sequences, and this mistral "
     "model has a sliding window of 16 tokens; set parallel.cp=1"),
])
def test_models_that_do_not_split_are_refused(sizes, cp, sentence):
    sizes = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, **sizes}
    config = AutoConfig.for_model(sizes.pop("model_type", "llama"), **sizes)
    with pytest.raises(ConfigError) as err:
        check_cp_fits(cp, config)
    assert str(err.value) == sentence


def test_cp_with_tp_splits_each_tp_rank_s_heads():
    dims = resolve_dims(ParallelConfig(cp=2, tp=2), 8)
    assert (dims.dp_replicate, dims.tp, dims.cp, dims.dp_size) == (2, 2, 2, 2)
    config = AutoConfig.for_model("llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=2)
    check_cp_fits(2, config, "ulysses", tp=2)  # 2 heads and 1 KV head (repeated) per TP rank
    check_cp_fits(4, config, "ring", tp=2)
    with pytest.raises(ConfigError) as err:
        check_cp_fits(4, config, "ulysses", tp=2)
    assert str(err.value) == ("parallel.cp=4 does not divide the attention heads of a tensor-parallel rank "
                              "(num_attention_heads=4 / parallel.tp=2 = 2), which Ulysses splits over the "
                              "context-parallel ranks; use a parallel.cp that divides 2 or parallel.cp_style=ring")
    config = AutoConfig.for_model("llama", hidden_size=48, num_attention_heads=12, num_key_value_heads=6)
    with pytest.raises(ConfigError) as err:
        check_cp_fits(2, config, "ulysses", tp=2)
    assert str(err.value) == ("parallel.cp=2 neither divides nor is a multiple of the key/value heads of a "
                              "tensor-parallel rank (num_key_value_heads=6 / parallel.tp=2 = 3); use a parallel.cp "
                              "that divides 3 or is a multiple of it, or parallel.cp_style=ring")


def test_fewer_kv_heads_than_the_degree_are_accepted():
    check_cp_fits(4, AutoConfig.for_model("llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=2))
    check_cp_fits(4, AutoConfig.for_model("llama", hidden_size=32, num_attention_heads=4, num_key_value_heads=1))


def test_config_show_prints_the_cp_degree(capsys):
    proc = cli(capsys, ["config", "show", *TINY, "parallel.cp=2", "parallel.dp_shard=2", "parallel.dp_replicate=1",
                        "train.micro_batch_size=4", "--world-size", "4"])
    assert proc.returncode == 0, proc.stderr
    assert "  cp: 2\n  cp_style: ulysses\n" in proc.stdout
    assert "# dp_shard: 2\n# tp: 1\n# cp: 2\n# world_size: 4\n# dp_size: 2\n" in proc.stdout


def test_config_show_accepts_ring_with_more_ranks_than_heads(capsys):
    proc = cli(capsys, ["config", "show", *TINY, "model.config.num_attention_heads=2",
                        "model.config.num_key_value_heads=1", "parallel.cp=4", "parallel.cp_style=ring",
                        "--world-size", "4"])
    assert proc.returncode == 0, proc.stderr
    assert "  cp: 4\n  cp_style: ring\n" in proc.stdout


def test_config_show_refuses_heads_that_do_not_split(capsys):
    proc = cli(capsys, ["config", "show", *TINY, "model.config.num_attention_heads=4", "parallel.cp=3",
                        "--world-size", "3"])
    assert_error_sentence(proc, "parallel.cp=3 does not divide the model's attention heads (num_attention_heads=4), "
                          "which Ulysses splits over the context-parallel ranks; use a parallel.cp that divides 4, or "
                          "parallel.cp_style=ring")


def test_config_show_refuses_another_attention_kernel(capsys):
    proc = cli(capsys, ["config", "show", *TINY, "model.config.num_attention_heads=4", "parallel.cp=2",
                        "model.attn_implementation=eager", "--world-size", "2"])
    assert_error_sentence(proc, "parallel.cp=2 runs its own attention over SDPA, not model.attn_implementation=eager; "
                          "leave model.attn_implementation unset or set it to sdpa")


def test_embed_refuses_cp_and_rl_takes_it():
    tree = {"model": {"config": {"model_type": "llama"}}, "data": {"path": "x.jsonl"}, "parallel": {"cp": 2}}
    sentence = ("parallel.cp=2 is built for isotrain train only; isotrain embed pools whole sequences on one rank: set "
                "parallel.cp=1")
    with pytest.raises(ConfigError, match=sentence):
        build_config(tree, "embed")
    assert build_config(tree, "rl").parallel.cp == 2  # the RL trainer's forwards run under CP (rl/pieces.py)
