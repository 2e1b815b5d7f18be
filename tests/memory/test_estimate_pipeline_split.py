"""The per-stage memory estimate under parallel.pp_split and the zero-bubble schedules (memory/pipeline.py), against
live pipeline ranks (tests/memory/memory_worker.py) and against the stages' own parameters."""

from __future__ import annotations

import pytest
import torch

from test_estimate import _check_terms, _measure

CONFIG = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": 64}


def _stages(split, schedule="1f1b", per_rank=1):
    from isotrain.config import build_config
    from isotrain.memory.estimate import estimate_memory

    cfg = build_config({"model": {"config": CONFIG}, "data": {"max_seq_len": 16},
                        "train": {"micro_batch_size": 2, "global_batch_size": 8},
                        "parallel": {"pp": 2, "dp_replicate": 1, "pp_schedule": schedule,
                                     "pp_stages_per_rank": per_rank, "pp_split": split}})
    estimate = estimate_memory(cfg, 2, vocab_size=64)
    return [{t.name: t.bytes for t in terms} for terms in estimate.stages]


def test_estimate_follows_an_uneven_split():
    """[3,1] moves one decoder layer from stage 1 to stage 0: its parameters (fp32) and its activations of the
    micro-batches in flight (1F1B: 2 on stage 0, 1 on stage 1) move with it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    even, uneven = _stages(None), _stages([3, 1])
    mapping = dict(CONFIG)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(mapping.pop("model_type"), **mapping))
    layer_bytes = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    assert uneven[0]["parameters"] - even[0]["parameters"] == layer_bytes
    assert even[1]["parameters"] - uneven[1]["parameters"] == layer_bytes
    # one layer's activations of one micro-batch: a quarter of what the even stage 1 holds for its 2 layers plus
    # what the head saves is not activations, so compare the stages' differences: 2 in flight on 0, 1 on 1
    gained, lost = (uneven[0]["activations"] - even[0]["activations"], even[1]["activations"]
                    - uneven[1]["activations"])
    assert gained == 2 * lost > 0


def test_zero_bubble_estimates_walk_torch_order():
    """The V-shaped schedules put the head and the loss on rank 0: its logits term, none on rank 1."""
    for schedule in ("zbv", "dualpipev", "interleaved_zb"):
        stages = _stages(None, schedule, per_rank=2)
        logits = [stage["logits and loss"] for stage in stages]
        assert (logits[0] > 0 == logits[1]) if schedule != "interleaved_zb" else (logits[0] == 0 < logits[1])


@pytest.mark.slow
def test_estimate_matches_live_split_and_zero_bubble_pipelines(tmp_path):
    """fp32 on 2 processes: PP 2 1F1B with parallel.pp_split=[3,1], ZBV (2 one-layer stages per rank in a V) and
    interleaved zero bubble (rank 1 holds 4 micro-batch stages at once, 3 if a micro-batch's activations were freed
    by its input backward rather than its weight backward), each rank measured through a real step's schedule and
    compared with the estimate of its own stages (model states to the byte, the rest within 5 %)."""
    rows = _measure(tmp_path, 2, "1x1x1-pp2-split3+1-fp32", "1x1x1-pp2-zbv-fp32", "1x1x1-pp2-izb-fp32")
    assert len(rows) == 3 * 2
    _check_terms(rows)
    by = {(row["variant"].split(" ")[0], row["rank"]): row["measured"] for row in rows}
    split = [by[("1x1x1-pp2-split3+1-fp32", rank)] for rank in (0, 1)]
    assert split[0]["parameters"] > split[1]["parameters"]
    zbv = [by[("1x1x1-pp2-zbv-fp32", rank)] for rank in (0, 1)]
    assert zbv[0]["logits and loss"] > 0 == zbv[1]["logits and loss"]
