"""The per-stage memory estimate beside FSDP2 and TP (memory/pipeline.py) against live gloo runs, term by term.

PP 2 × FSDP2 2 and PP 2 × TP 2 (1F1B, 3 micro-batches per step, fp32; one 4-process launch), measured through the
real schedule as the pipeline estimate tests measure (memory/measure_pipeline.py): each stage's parameters,
gradients and AdamW moments sharded over its dp_shard ranks (FSDP2's padded dim-0 shards) or split by TP's plan
(the vocabulary-parallel embedding's gradient whole until the update), one TP rank's activations and vocabulary
slice of the logits, and torch's receive buffers: every term equal to the byte on every rank. (Measured the same way
and equal to the byte too, kept out of the suite for time: bf16 and activation checkpointing on both layouts, where
FSDP2's stage computes and sends its hidden states in bf16.) FSDP2's transient buffers beside a pipeline are not
modelled: the estimate says so, and interleaved 1F1B beside FSDP2 is refused.
"""

from __future__ import annotations

import pytest

from test_estimate import _check_terms, _measure


@pytest.mark.slow
def test_estimate_matches_measurement_on_pp2_beside_fsdp2_and_tp2(tmp_path):
    rows = _measure(tmp_path, 4, "1x2x1-pp2-fp32", "1x1x2-pp2-fp32")
    assert len(rows) == 2 * 4
    _check_terms(rows)
    by = {(row["variant"].split(" ")[0], row["rank"]): row for row in rows}
    for layout in ("1x2x1-pp2-fp32", "1x1x2-pp2-fp32"):
        first, last = by[(layout, 0)]["measured"], by[(layout, 2)]["measured"]  # ranks 0-1: stage 0; 2-3: stage 1
        assert first["logits and loss"] == 0 < last["logits and loss"], layout
        assert by[(layout, 1)]["measured"] == first and by[(layout, 3)]["measured"] == last, layout
        assert "not_counted" not in by[(layout, 0)]["estimated"]
    tp_first = by[("1x1x2-pp2-fp32", 0)]["measured"]
    assert tp_first["gradients"] > tp_first["parameters"]  # the embedding's gradient arrives whole under TP
    fsdp_first = by[("1x2x1-pp2-fp32", 0)]["measured"]
    assert fsdp_first["gradients"] == fsdp_first["parameters"] < tp_first["parameters"] * 1.01


def test_estimate_names_what_it_leaves_out_beside_fsdp2():
    from isotrain.config import build_config
    from isotrain.memory.estimate import estimate_memory

    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": 64}
    cfg = build_config({"model": {"config": config}, "data": {"max_seq_len": 16},
                        "train": {"micro_batch_size": 2, "global_batch_size": 8},
                        "parallel": {"pp": 2, "dp_shard": 2, "dp_replicate": 1}})
    sharded = estimate_memory(cfg, 4, "float32", vocab_size=64, device="cpu")
    assert "FSDP2's all-gather and reduce-scatter buffers" in sharded.settings["not_counted"]
    whole = estimate_memory(build_config({**cfg.model_dump(include={"model", "data", "train"}),
                                          "parallel": {"pp": 2, "dp_replicate": 1}}), 2, "float32", vocab_size=64,
                            device="cpu")
    assert "not_counted" not in whole.settings
    for stage in range(2):  # each stage's states halved by FSDP2 (to the padding of its dim-0 chunks)
        halves = [next(t.bytes for t in terms if t.name == "optimizer moments")
                  for terms in (sharded.stages[stage], whole.stages[stage])]
        assert halves[0] < 0.55 * halves[1], halves
