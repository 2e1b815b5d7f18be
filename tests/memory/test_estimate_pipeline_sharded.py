"""The per-stage memory estimate beside FSDP2 and TP (memory/pipeline.py) against live gloo runs, term by term.

PP 2 × FSDP2 2 in bf16 and PP 2 × TP 2 in fp32 (1F1B, 3 micro-batches per step; one 4-process launch), measured
through the real schedule as the other pipeline estimate tests measure (memory/measure_pipeline.py), with FSDP2's
buffers sampled as without a pipeline (measure.fsdp_buffers): each stage's parameters, gradients and AdamW moments
sharded over its dp_shard ranks (FSDP2's padded dim-0 shards) or split by TP's plan (the vocabulary-parallel
embedding's gradient whole until the update), FSDP2's all-gather and reduce-scatter buffers of the stage (its root:
the embedding, or the norm and head), FSDP2's bf16 compute and bf16 hidden states between the stages, one TP rank's
activations and vocabulary slice of the logits, and torch's receive buffers: every term equal to the byte on every
rank. (fp32 and bf16, with and without activation checkpointing, on both layouts were measured equal to the byte
the same way; they are kept out of the suite for time.)
"""

from __future__ import annotations

import pytest

from test_estimate import FSDP_TERMS, _check_terms, _measure


@pytest.mark.slow
def test_estimate_matches_measurement_on_pp2_beside_fsdp2_and_tp2(tmp_path):
    fsdp, tp = "1x2x1-pp2-bf16", "1x1x2-pp2-fp32"
    rows = _measure(tmp_path, 4, fsdp, tp)
    assert len(rows) == 2 * 4
    _check_terms(rows)
    by = {(row["variant"].split(" ")[0], row["rank"]): row["measured"] for row in rows}
    for layout in (fsdp, tp):  # ranks 0 and 1 hold stage 0, ranks 2 and 3 stage 1
        first, last = by[(layout, 0)], by[(layout, 2)]
        assert first["logits and loss"] == 0 < last["logits and loss"], layout
        assert by[(layout, 1)] == first and by[(layout, 3)] == last, layout
    assert FSDP_TERMS <= set(by[(fsdp, 0)]) and not FSDP_TERMS & set(by[(tp, 0)])
    assert by[(tp, 0)]["gradients"] > by[(tp, 0)]["parameters"]  # the embedding's gradient arrives whole under TP
    assert by[(fsdp, 0)]["compute copies"] == 0 < by[(fsdp, 0)]["FSDP2 all-gather buffers"]
