"""parallel.pp_split (the decoder layers of each pipeline stage) and the zero-bubble schedules' placement: the layers
each stage and each rank hold, and every refusal as the one sentence a user sees (`isotrain config show` checks what
a run checks before any work)."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from helpers import assert_error_sentence
from test_early_checks import cli

from isotrain.errors import ConfigError
from isotrain.parallel.dims import check_pp_fits
from isotrain.parallel.pp import PassThrough, apply_pp, last_stage_rank, rank_stages, stage_layers

RUN = ["model.config.hidden_size=32", "model.config.num_hidden_layers=4", "model.config.intermediate_size=64",
       "parallel.pp=2", "train.global_batch_size=8", "train.micro_batch_size=2", "--world-size", "2"]


def test_a_split_places_its_counts_in_stage_order():
    assert [list(stage_layers(4, 2, s, [3, 1])) for s in range(2)] == [[0, 1, 2], [3]]
    assert [list(stage_layers(6, 4, s, [1, 2, 2, 1])) for s in range(4)] == [[0], [1, 2], [3, 4], [5]]
    # V-shaped schedules: rank r holds stages r and 2·pp - 1 - r, rank 0 the first and the last
    assert [rank_stages(r, 2, 2, "zbv") for r in range(2)] == [[0, 3], [1, 2]]
    assert [rank_stages(r, 3, 2, "dualpipev") for r in range(3)] == [[0, 5], [1, 4], [2, 3]]
    assert [rank_stages(r, 2, 2, "interleaved_zb") for r in range(2)] == [[0, 2], [1, 3]]
    assert (last_stage_rank(2, "zbv"), last_stage_rank(2, "interleaved_zb")) == (0, 1)


def test_apply_pp_keeps_a_ranks_layers_of_the_split_and_its_ends():
    """On meta: [1,2,2,1] under ZBV gives rank 0 stages 0 and 3 (layers 0 and 5, the embedding, norm and head),
    rank 1 stages 1 and 2 (layers 1-4, no embedding, no head)."""
    import torch
    from transformers import AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                  num_hidden_layers=6, vocab_size=64, tie_word_embeddings=False)
    held = []
    for rank in range(2):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        apply_pp(model, rank, 2, 2, [1, 2, 2, 1], "zbv")
        layers = [i for i, layer in enumerate(model.model.layers) if not isinstance(layer, PassThrough)]
        held.append((layers, model.model.embed_tokens is not None, "lm_head.weight" in dict(model.named_parameters())))
    assert held == [([0, 5], True, True), ([1, 2, 3, 4], False, False)]


@pytest.mark.parametrize("overrides, sentence", [
    (["parallel.pp_split=[3,1,0]"], "parallel.pp_split=[3,1,0] has 3 entries, but the pipeline has parallel.pp=2 × "
     "parallel.pp_stages_per_rank=1 = 2 stages; give one decoder-layer count per stage (2 entries), or "
     "parallel.pp_split=null for an even split"),
    (["parallel.pp_split=[2,1]"], "parallel.pp_split=[2,1] places 3 decoder layers, but the model has 4 "
     "(num_hidden_layers=4); make the entries sum to 4"),
    (["parallel.pp_split=[4,0]"], "parallel.pp_split=[4,0] gives stage 1 0 decoder layers, and every stage needs at "
     "least one; make every entry a positive count"),
    (["parallel.pp_split=[5,-1]"], "parallel.pp_split=[5,-1] gives stage 1 -1 decoder layers, and every stage needs "
     "at least one; make every entry a positive count"),
    (["parallel.pp_split=3"], "config value parallel.pp_split=3 is invalid: Input should be a valid list; use a list "
     "of positive decoder-layer counts, one per stage, e.g. parallel.pp_split=[3,1], or null for an even split"),
    (["parallel.pp=1", "parallel.pp_split=[4]", "--world-size", "1"], "parallel.pp_split=[4] needs a pipeline; set "
     "parallel.pp to 2 or more, or parallel.pp_split=null"),
    (["parallel.pp_schedule=zbv"], "parallel.pp_schedule=zbv runs exactly 2 stages on each rank (rank r holds stages "
     "r and 2·pp - 1 - r), but parallel.pp_stages_per_rank=1; set parallel.pp_stages_per_rank=2"),
    (["parallel.pp_schedule=interleaved_zb"], "parallel.pp_schedule=interleaved_zb runs several stages on each rank, "
     "but parallel.pp_stages_per_rank=1; set parallel.pp_stages_per_rank=2 or more, or parallel.pp_schedule=1f1b"),
    (["parallel.pp_schedule=dualpipev", "parallel.pp_stages_per_rank=2", "train.micro_batch_size=4"],
     "parallel.pp_schedule=dualpipev needs at least one micro-batch per stage, 4 for parallel.pp=2, but the batch "
     "plan has 2; lower train.micro_batch_size to at most 2 or use parallel.pp_schedule=zbv"),
    (["parallel.pp_schedule=zbv", "parallel.pp_stages_per_rank=2", "train.compile=true"], "train.compile=true is not "
     "supported with parallel.pp_schedule=zbv yet (a zero-bubble schedule splits each backward in two, which a "
     "compiled layer's backward cannot be); set train.compile=false or parallel.pp_schedule=interleaved_1f1b"),
])
def test_bad_splits_and_zero_bubble_settings_are_one_sentence(capsys, overrides, sentence):
    proc = cli(capsys, ["config", "show", *RUN, *overrides])
    assert_error_sentence(proc, sentence)


def test_config_show_accepts_a_split_and_a_v_schedule(capsys):
    proc = cli(capsys, ["config", "show", *RUN, "parallel.pp_schedule=zbv", "parallel.pp_stages_per_rank=2",
                        "parallel.pp_split=[1,1,1,1]"])
    assert proc.returncode == 0, proc.stderr
    assert "pp_schedule: zbv\n" in proc.stdout and "pp_split:\n  - 1\n" in proc.stdout


def test_moe_models_take_a_split_into_several_stages_per_rank():
    """Every several-stage schedule runs an MoE model (tests/train/test_pipeline_moe.py); the split is checked as for
    a dense one."""
    config = AutoConfig.for_model("qwen3_moe", hidden_size=32, num_attention_heads=4, num_hidden_layers=4,
                                  num_experts=4, mlp_only_layers=[], decoder_sparse_step=1)
    check_pp_fits(2, config, per_rank=2, split=[1, 1, 1, 1])
    with pytest.raises(ConfigError) as err:
        check_pp_fits(2, config, per_rank=2, split=[1, 1, 1, 2])
    assert str(err.value) == ("parallel.pp_split=[1,1,1,2] places 5 decoder layers, but the model has 4 "
                              "(num_hidden_layers=4); make the entries sum to 4")
