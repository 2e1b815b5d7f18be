"""parallel.pp, parallel.pp_schedule and parallel.pp_microbatches: where PP takes its ranks, the even split of the
decoder layers, and every refusal as the one sentence a user sees (`isotrain config show` checks what a run checks
before any work)."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from helpers import assert_error_sentence
from test_early_checks import cli

from isotrain.config import ParallelConfig, build_config, load_config
from isotrain.errors import ConfigError
from isotrain.parallel.dims import check_pp_fits, resolve_dims
from isotrain.parallel.pp import stage_layers
from isotrain.sizes import plan_batches

TINY = ["model.config.hidden_size=32", "model.config.num_hidden_layers=2", "model.config.intermediate_size=64",
        "model.config.tie_word_embeddings=false"]


def test_pp_takes_ranks_of_its_own_and_the_batch_plan_is_that_of_one_process():
    dims = resolve_dims(ParallelConfig(pp=2), 2)  # dp_replicate=-1 takes no ranks beside PP
    assert (dims.pp, dims.dp_replicate, dims.world_size, dims.dp_size, dims.pp_schedule) == (2, 1, 2, 1, "1f1b")
    cfg = load_config(None, ["parallel.pp=2", "train.global_batch_size=8", "train.micro_batch_size=2"])
    plan = plan_batches(cfg, resolve_dims(cfg.parallel, 2))
    assert (plan.dp_size, plan.grad_accum_steps, plan.samples_per_rank_per_step) == (1, 4, 8)
    with pytest.raises(ConfigError) as err:
        resolve_dims(ParallelConfig(pp=2, dp_replicate=1), 4)
    assert str(err.value) == ("parallel.pp × dp_replicate × dp_shard × tp = 2 × 1 × 1 × 1 = 2 but 4 processes "
                              "were launched; make the product equal the number of processes")


def test_pp_with_data_and_tensor_parallelism_keeps_the_batch_plan_of_dp_alone():
    """PP 2 on 4 ranks: dp_replicate=-1 takes the other 2 (DDP 2), or dp_shard=-1 does (FSDP2 2); the sampler and GA
    see DP = 2, whatever the number of stages."""
    ddp = resolve_dims(ParallelConfig(pp=2), 4)
    assert (ddp.pp, ddp.dp_replicate, ddp.dp_shard, ddp.dp_size, ddp.fsdp) == (2, 2, 1, 2, False)
    fsdp = resolve_dims(ParallelConfig(pp=2, dp_replicate=1, dp_shard=-1), 4)
    assert (fsdp.pp, fsdp.dp_replicate, fsdp.dp_shard, fsdp.dp_size, fsdp.fsdp) == (2, 1, 2, 2, True)
    cfg = load_config(None, ["parallel.pp=2", "parallel.dp_shard=2", "parallel.dp_replicate=1",
                             "train.global_batch_size=8", "train.micro_batch_size=2"])
    plan = plan_batches(cfg, resolve_dims(cfg.parallel, 4))
    assert (plan.dp_size, plan.grad_accum_steps, plan.samples_per_rank_per_step) == (2, 2, 4)
    tp = resolve_dims(ParallelConfig(pp=2, tp=2), 8)  # a 3-D mesh: PP 2 × DDP 2 × TP 2
    assert (tp.pp, tp.dp_replicate, tp.tp, tp.dp_size, tp.world_size) == (2, 2, 2, 2, 8)
    with pytest.raises(ConfigError) as err:
        resolve_dims(ParallelConfig(pp=2), 3)
    assert str(err.value) == ("parallel.pp=2 needs a multiple of 2 processes, but 3 processes were launched; launch a "
                              "multiple of 2 (torchrun --nproc-per-node 2) or lower that degree")


def test_layers_split_evenly_in_order():
    assert [list(stage_layers(4, 2, s)) for s in range(2)] == [[0, 1], [2, 3]]
    assert [list(stage_layers(5, 3, s)) for s in range(3)] == [[0, 1], [2, 3], [4]]
    assert [list(stage_layers(2, 2, s)) for s in range(2)] == [[0], [1]]


@pytest.mark.parametrize("settings, sentence", [
    (dict(pp=2, pp_schedule="interleaved_1f1b"), "parallel.pp_schedule=interleaved_1f1b runs several stages on each "
     "rank, but parallel.pp_stages_per_rank=1; set parallel.pp_stages_per_rank=2 or more, or parallel.pp_schedule=1f1b"),
    (dict(pp=2, pp_stages_per_rank=2), "parallel.pp_stages_per_rank=2 needs parallel.pp_schedule=interleaved_1f1b "
     "(parallel.pp_schedule=1f1b runs one stage per rank); set parallel.pp_schedule=interleaved_1f1b or "
     "parallel.pp_stages_per_rank=1"),
    (dict(pp_stages_per_rank=2), "parallel.pp_stages_per_rank=2 needs a pipeline; set parallel.pp to 2 or more, or "
     "parallel.pp_stages_per_rank=1"),
    (dict(pp=2, cp=2), "parallel.pp=2 with parallel.cp=2 is not supported yet (pipeline parallelism composes with "
     "data, tensor and expert parallelism only); set parallel.cp=1 and use parallel.dp_shard, parallel.dp_replicate or "
     "parallel.tp for the other ranks, or parallel.pp=1"),
    (dict(pp=2, pp_schedule="zbv", pp_stages_per_rank=2, dp_shard=2, dp_replicate=1), "parallel.pp_schedule=zbv "
     "with FSDP2 (parallel.dp_shard=2) is not supported yet; set parallel.dp_shard=1 and use parallel.dp_replicate for "
     "the other ranks, or parallel.pp_schedule=interleaved_1f1b"),
    (dict(pp=2, ep=4), "parallel.ep=4 does not divide the data-parallel size dp_replicate × dp_shard = 2 × 1 = 2, "
     "out of which the expert-parallel groups are carved; use a parallel.ep that divides 2, or launch a multiple of 4 "
     "data-parallel ranks"),
])
def test_unbuilt_combinations_are_refused(settings, sentence):
    with pytest.raises(ConfigError) as err:
        resolve_dims(ParallelConfig(**settings), 4)
    assert str(err.value) == sentence


@pytest.mark.parametrize("sizes, pp, sentence", [
    (dict(num_hidden_layers=2), 3, "parallel.pp=3 needs at least 3 decoder layers, one per stage, but the model has 2 "
     "(num_hidden_layers=2); use a parallel.pp of at most 2"),
])
def test_models_that_do_not_split_are_refused(sizes, pp, sentence):
    sizes = {"hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 4, **sizes}
    config = AutoConfig.for_model(sizes.pop("model_type", "llama"), **sizes)
    with pytest.raises(ConfigError) as err:
        check_pp_fits(pp, config)
    assert str(err.value) == sentence


def test_moe_models_split_into_stages_of_one_or_several_per_rank():
    """One stage per rank or several, with dense layers or without: accepted (tests/train/test_moe_equivalence.py,
    test_pipeline_moe.py); a model with fewer layers than stages is refused as a dense one is."""
    config = AutoConfig.for_model("qwen3_moe", hidden_size=32, num_attention_heads=4, num_hidden_layers=4,
                                  num_experts=4, mlp_only_layers=[], decoder_sparse_step=1)
    check_pp_fits(2, config)
    check_pp_fits(2, AutoConfig.for_model("qwen3_moe", hidden_size=32, num_attention_heads=4, num_hidden_layers=4,
                                          num_experts=4, mlp_only_layers=[0, 1]))
    check_pp_fits(2, config, per_rank=2)
    with pytest.raises(ConfigError) as err:
        check_pp_fits(2, config, per_rank=3)
    assert str(err.value) == ("parallel.pp=2 × parallel.pp_stages_per_rank=3 = 6 stages need at least 6 decoder "
                              "layers, one per stage, but the model has 4 (num_hidden_layers=4); use a "
                              "parallel.pp_stages_per_rank of at most 2")


@pytest.mark.parametrize("overrides, sentence", [
    (["parallel.pp_microbatches=3"], "parallel.pp_microbatches=3 does not divide the 8 samples each data-parallel "
     "rank trains per step (train.global_batch_size / DP size); use one of [1, 2, 4, 8]"),
    (["parallel.pp_microbatches=2"], "parallel.pp_microbatches=2 differs from the batch plan's 4 gradient-accumulation "
     "micro-batches, which the pipeline runs; set train.micro_batch_size=4 or leave parallel.pp_microbatches unset"),
    (["parallel.pp_schedule=zb2p"], "config value parallel.pp_schedule='zb2p' is invalid: Input should be '1f1b', "
     "'gpipe', 'interleaved_1f1b', 'interleaved_zb', 'zbv' or 'dualpipev'; use parallel.pp_schedule=1f1b, "
     "parallel.pp_schedule=gpipe, parallel.pp_schedule=interleaved_1f1b or interleaved_zb (with "
     "parallel.pp_stages_per_rank=2 or more), or parallel.pp_schedule=zbv or dualpipev (with "
     "parallel.pp_stages_per_rank=2)"),
    (["model.config.num_hidden_layers=4", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2",
      "train.micro_batch_size=8",
      "train.global_batch_size=24"], "parallel.pp_schedule=interleaved_1f1b runs the micro-batches in rounds of "
     "parallel.pp=2, but the batch plan has 3; choose train.micro_batch_size so that train.global_batch_size / "
     "(train.micro_batch_size × DP size) is a multiple of 2"),
    (["train.micro_batch_size=8"], "parallel.pp_schedule=1f1b needs at least one micro-batch per stage, but the batch "
     "plan has 1 for parallel.pp=2; lower train.micro_batch_size to at most 4 or use parallel.pp_schedule=gpipe"),
])
def test_microbatches_that_do_not_fit_are_refused(capsys, overrides, sentence):
    proc = cli(capsys, ["config", "show", *TINY, "parallel.pp=2", "train.global_batch_size=8",
                        "train.micro_batch_size=2", *overrides, "--world-size", "2"])
    assert_error_sentence(proc, sentence)


def test_config_show_prints_the_pp_degree_and_accepts_matching_microbatches(capsys):
    proc = cli(capsys, ["config", "show", *TINY, "parallel.pp=2", "parallel.pp_schedule=gpipe",
                        "parallel.pp_microbatches=4", "train.global_batch_size=8", "train.micro_batch_size=2",
                        "--world-size", "2"])
    assert proc.returncode == 0, proc.stderr
    assert "  pp: 2\n  pp_schedule: gpipe\n  pp_stages_per_rank: 1\n  pp_microbatches: 4\n" in proc.stdout
    assert "# pp: 2\n" in proc.stdout and "# grad_accum_steps: 4\n" in proc.stdout


def test_config_show_refuses_more_interleaved_stages_than_layers(capsys):
    proc = cli(capsys, ["config", "show", *TINY, "parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b",
                        "parallel.pp_stages_per_rank=2", "train.global_batch_size=8", "train.micro_batch_size=2",
                        "--world-size", "2"])
    assert_error_sentence(proc, "parallel.pp=2 × parallel.pp_stages_per_rank=2 = 4 stages need at least 4 decoder "
                          "layers, one per stage, but the model has 2 (num_hidden_layers=2); use "
                          "parallel.pp_schedule=1f1b with parallel.pp_stages_per_rank=1")


def test_estimate_memory_estimates_pipeline_stages_and_refuses_interleaved_fsdp2(capsys):
    args = ["estimate-memory", *TINY, "parallel.pp=2", "train.global_batch_size=8", "train.micro_batch_size=2",
            "--world-size", "2"]
    proc = cli(capsys, args)
    assert proc.returncode == 0, proc.stderr
    assert "stage 0 MiB" in proc.stdout and "stage 1 MiB" in proc.stdout
    proc = cli(capsys, [*args[:-2], "model.config.num_hidden_layers=4", "parallel.pp_schedule=interleaved_1f1b",
                        "parallel.pp_stages_per_rank=2", "parallel.dp_shard=2", "--world-size", "4"])
    assert_error_sentence(proc, "isotrain estimate-memory does not estimate parallel.pp_schedule=interleaved_1f1b "
                          "beside FSDP2 (parallel.dp_shard=2) yet, whose stages keep their parameters and gradients "
                          "gathered through the step; estimate it with parallel.pp_schedule=1f1b, or with "
                          "parallel.dp_shard=1")


def test_config_show_refuses_more_stages_than_layers(capsys):
    proc = cli(capsys, ["config", "show", *TINY, "parallel.pp=3", "train.global_batch_size=6",
                        "train.micro_batch_size=2", "--world-size", "3"])
    assert_error_sentence(proc, "parallel.pp=3 needs at least 3 decoder layers, one per stage, but the model has 2 "
                          "(num_hidden_layers=2); use a parallel.pp of at most 2")


@pytest.mark.parametrize("recipe, section, sentence", [
    ("rl", {}, "parallel.pp=2 is built for isotrain train only; the RL trainer's rollouts and losses run the whole "
     "model on one rank: set parallel.pp=1"),
    ("embed", {}, "parallel.pp=2 is built for isotrain train only; isotrain embed pools the last hidden states on one "
     "rank: set parallel.pp=1"),
])
def test_recipes_and_settings_without_pipelines_refuse_pp(recipe, section, sentence):
    tree = {"model": {"config": {"model_type": "llama"}}, "data": {"path": "x.jsonl"}, "parallel": {"pp": 2}, **section}
    with pytest.raises(ConfigError, match=sentence.replace("(", r"\(").replace(")", r"\)")):
        build_config(tree, recipe)


def test_packing_is_built_with_pp():
    """data.packing under parallel.pp: the packing probe runs through the stages
    (tests/train/test_pipeline_parallel.py)."""
    tree = {"model": {"config": {"model_type": "llama"}}, "data": {"path": "x.jsonl", "packing": True},
            "parallel": {"pp": 2}}
    cfg = build_config(tree, "train")
    assert (cfg.data.packing, cfg.parallel.pp) == (True, 2)
