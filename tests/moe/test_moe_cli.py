"""`isotrain train` and `isotrain rl` on an MoE model: metrics.jsonl and TensorBoard carry the router values;
`moe.*` on a dense model is refused in one sentence before any work (train, rl, embed)."""

from __future__ import annotations

import json

import pytest

from helpers import run_concurrently
from zygote import run_isotrain
from test_cli_errors import TINY_RL, assert_error_sentence
from test_early_checks import cli

TINY_MOE = ["model.config.model_type=qwen3_moe", "model.config.hidden_size=32", "model.config.intermediate_size=64",
            "model.config.num_hidden_layers=2", "model.config.num_experts=4", "model.config.num_experts_per_tok=2",
            "model.config.moe_intermediate_size=32", "model.config.head_dim=8", "train.global_batch_size=16",
            "train.micro_batch_size=4", "train.max_steps=2", "eval.path=null", "logging.progress=false",
            "data.packing=true"]


@pytest.mark.slow
def test_moe_run_logs_router_metrics_and_dense_run_refuses_moe_keys(tmp_path):
    moe_run, dense_run = tmp_path / "moe", tmp_path / "dense"
    runs = run_concurrently({
        "moe": lambda: run_isotrain(["train", *TINY_MOE, "moe.z_loss_coef=0.001", "logging.tensorboard=true",
                                     f"output_dir={moe_run}"]),
        "dense": lambda: run_isotrain(["train", "moe.aux_loss_coef=0.01", f"output_dir={dense_run}"]),
    })
    assert runs["moe"].returncode == 0, runs["moe"].stderr[-3000:]
    rows = [json.loads(line) for line in (moe_run / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2]
    for row in rows:
        assert row["aux_loss"] > 0 and row["z_loss"] > 0 and row["load_ratio"] >= 1
        assert len(row["expert_share"]) == 2 and all(len(layer) == 4 for layer in row["expert_share"])
        assert all(abs(sum(layer) - 1) < 1e-3 for layer in row["expert_share"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(moe_run / "tensorboard")).Reload()
    tags = set(events.Tags()["scalars"])
    expected = {"train/aux_loss", "train/load_ratio", "expert_share_layer_0/expert_0", "expert_share_layer_1/expert_3"}
    assert expected <= tags

    dense = runs["dense"]
    assert dense.returncode != 0 and "Traceback" not in dense.stderr
    assert ("error: moe.aux_loss_coef=0.01 is set but the model (llama) has no mixture-of-experts layers; remove "
            "moe.aux_loss_coef or train an MoE model") in " ".join(dense.stderr.split())
    assert not (dense_run / "metrics.jsonl").exists()


RL_MOE = [*TINY_RL, "model.config.model_type=qwen3_moe", "model.config.head_dim=8", "model.config.num_experts=4",
          "model.config.num_experts_per_tok=2", "model.config.moe_intermediate_size=32"]


def _dense_refusal(model_type: str, key: str = "aux_loss_coef", value: str = "0.01") -> str:
    return (f"moe.{key}={value} is set but the model ({model_type}) has no mixture-of-experts layers; remove "
            f"moe.{key} or train an MoE model")


@pytest.mark.slow
def test_moe_rl_run_logs_router_metrics(tmp_path):
    # Two optimizer steps per rollout, each of two micro-batches: the routing pre-pass runs in every update.
    proc = run_isotrain(["rl", *RL_MOE[1:], "moe.z_loss_coef=0.001", "rl.mini_batch_prompts=2",
                         "train.micro_batch_size=4", f"output_dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(row["step"], row["optimizer_steps"]) for row in rows] == [(1, 2), (2, 4)]
    for row in rows:
        assert row["aux_loss"] > 0 and row["z_loss"] > 0 and row["load_ratio"] >= 1
        assert len(row["expert_share"]) == 2 and all(len(layer) == 4 for layer in row["expert_share"])
        assert all(abs(sum(layer) - 1) < 1e-3 for layer in row["expert_share"])
        # The logged loss is the whole objective: the router terms are in it (rewards may all be equal: pg 0).
        assert row["loss"] != row["pg_loss"]


def test_dense_rl_policy_refuses_moe_keys(capsys, tmp_path):
    run = tmp_path / "run"
    assert_error_sentence(cli(capsys, [*TINY_RL, "moe.aux_loss_scope=micro_batch", f"output_dir={run}"]),
                          _dense_refusal("llama", "aux_loss_scope", "'micro_batch'"))
    assert not run.exists()  # refused before any work


def test_dense_embedder_refuses_moe_keys(capsys, tmp_path):
    bert = ["model.config.model_type=bert", "model.config.hidden_size=32", "model.config.num_hidden_layers=2",
            "model.config.num_attention_heads=2", "model.config.intermediate_size=64", "eval.path=null"]
    proc = cli(capsys, ["embed", *bert, "moe.z_loss_coef=0.01", f"data.path={tmp_path / 'pairs.jsonl'}",
                        f"output_dir={tmp_path / 'run'}"])
    # isotrain embed reads no moe section at all (its loss has no router terms): the schema refuses it by name.
    assert_error_sentence(proc, "config section 'moe' belongs to isotrain train and isotrain rl, not isotrain embed; "
                                "remove moe.z_loss_coef")
    assert not (tmp_path / "run").exists()  # refused before any work


def test_embed_refuses_router_settings_it_cannot_train(capsys, tmp_path):
    """isotrain embed's loss has no router terms, so moe.* is refused even for an MoE model."""
    proc = cli(capsys, ["embed", *TINY_MOE, "moe.aux_loss_coef=0.01", "eval.path=null",
                        f"data.path={tmp_path / 'pairs.jsonl'}", f"output_dir={tmp_path / 'run'}"])
    assert_error_sentence(proc, "config section 'moe' belongs to isotrain train and isotrain rl, not isotrain embed; "
                                "remove moe.aux_loss_coef")
    assert not (tmp_path / "run").exists()
