"""The per-stage memory estimate (memory/pipeline.py) with the chunked loss and with mixture-of-experts models (and
expert parallelism) beside a pipeline, against live pipeline ranks; and the pipeline layout it still refuses.

One 4-process launch (PP 2, 3 micro-batches of 2 × 16 tokens per DP rank and step, measured through the real
schedule: memory/measure_pipeline.py) serves every assertion:

- `1x2x1-pp2-c8-v512-bf16`: FSDP2 2, 1F1B, train.loss_chunk_tokens=8, vocabulary 512;
- `2x1x1-pp2-gpipe-c8-v512-fp32`: DDP 2, GPipe (all 3 micro-batches in flight on the last stage), the same loss;
- `moe-1x2x1-ep2-pp2-bf16`: qwen3_moe (4 experts, top-2), EP 2 over the stage's FSDP2 ranks;
- `moe-2x1x1-ep2-pp2-bf16`: EP 2 over the stage's DDP replicas (autocast);
- `moe-1x2x1-pp2-fp32`: FSDP2 2 without EP (its estimate raised a traceback before: grouped_mm on fake fp32);
- `moe-2x1x1-ep2-pp2-zbv-bf16`: ZBV (2 stages per rank, rank 0 the first and the last), EP 2 over DDP replicas;
- `moe-2x1x1-pp2-interleaved-fp32`: interleaved 1F1B (stages r and r + 2), DDP 2, 4 micro-batches.
"""

from __future__ import annotations

import pytest

from test_estimate import _check_terms, _measure

CHUNKED = ("1x2x1-pp2-c8-v512-bf16", "2x1x1-pp2-gpipe-c8-v512-fp32")
MOE = ("moe-1x2x1-ep2-pp2-bf16", "moe-2x1x1-ep2-pp2-bf16", "moe-1x2x1-pp2-fp32")
SEVERAL = ("moe-2x1x1-ep2-pp2-zbv-bf16", "moe-2x1x1-pp2-interleaved-fp32")  # several stages per rank


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> dict:
    rows = _measure(tmp_path_factory.mktemp("pp"), 4, *CHUNKED, *MOE, *SEVERAL)
    assert len(rows) == 4 * (len(CHUNKED) + len(MOE) + len(SEVERAL))
    return {(row["variant"].split(" ")[0], row["rank"]): row for row in rows}  # ranks 0, 1: stage 0; 2, 3: stage 1


def _measured_terms_estimated(row: dict) -> dict:
    return {term: row["estimated"][term] for term in row["measured"]}


@pytest.mark.slow
def test_estimate_matches_live_pipelines_with_the_chunked_loss(live):
    """The last stage computes each micro-batch's loss in chunks inside its forward: each micro-batch in flight keeps
    its trained tokens' final hidden states (labels, weights), and backward recomputes one chunk at a time, so the
    chunk's head/loss tensors and logits count once, not once per micro-batch in flight. Every term as in the other
    pipeline tests (model states to the byte, the rest within 5 %); measured: every term to the byte, but GPipe's
    logits and loss 16 bytes high (the step's one loss denominator, counted per micro-batch)."""
    rows = [live[(layout, rank)] for layout in CHUNKED for rank in range(4)]
    _check_terms(rows)
    one, gpipe = (live[(layout, 2)] for layout in CHUNKED)
    assert _measured_terms_estimated(one) == one["measured"]
    assert 0 <= gpipe["estimated"]["logits and loss"] - gpipe["measured"]["logits and loss"] <= 16
    assert live[(CHUNKED[0], 0)]["measured"]["logits and loss"] == 0
    # One chunk's logits (8 of 32 tokens), not the micro-batch's: under 1F1B below what the unchunked loss holds for
    # one micro-batch's bf16 logits and their fp32 upcast alone.
    assert one["measured"]["logits and loss"] < 32 * 512 * (2 + 4)
    # GPipe holds 3 micro-batches' hidden states (32 tokens × 64, fp32) and one chunk's fp32 logits and log-softmax.
    hidden = 32 * 64 * 4
    assert gpipe["measured"]["logits and loss"] < 3 * hidden + 2 * (8 * 512 * 4) + 3 * 1024


@pytest.mark.slow
def test_estimate_matches_live_moe_pipelines_with_expert_parallelism(live):
    """Each stage's experts split over its EP group (whole experts, out of FSDP2), its router terms (the stage's
    layers' router logits, their fp32 probabilities) per micro-batch in flight, the routing pre-pass's forward-only
    schedule (its receive buffers and the hidden states its stages keep: pipeline buffers twice), and EP's local
    expert copies in the compute dtype, made by every micro-batch's forward (1F1B: 2 in flight on stage 0, 1 on
    stage 1), beside autocast's once-per-step copies: every term equal to the byte on every rank."""
    rows = [live[(layout, rank)] for layout in MOE for rank in range(4)]
    _check_terms(rows)
    for row in rows:
        assert _measured_terms_estimated(row) == row["measured"], (row["variant"], row["rank"])
    ep, ddp, no_ep = (live[(layout, 0)]["measured"] for layout in MOE)
    assert ep["router logits and terms"] > 0 and ep["FSDP2 all-gather buffers"] < no_ep["FSDP2 all-gather buffers"]
    # EP in bf16: stage 0's 2 micro-batches in flight each hold a copy of its layer's 2 local experts (gate_up
    # [2, 64, 64] + down [2, 64, 32]), beside (over DDP replicas) autocast's one copy of its layer's attention (q, o
    # [64, 64], k, v [32, 64]) and router ([4, 64]) weights; FSDP2 computes the rest in bf16 without copies.
    experts = 2 * (64 * 64 + 64 * 32) * 2
    assert ddp["compute copies"] == (2 * 64 * 64 + 2 * 32 * 64 + 4 * 64) * 2 + 2 * experts
    assert ep["compute copies"] == 2 * experts == 2 * live[(MOE[0], 2)]["measured"]["compute copies"]


@pytest.mark.slow
def test_estimate_matches_live_moe_pipelines_of_several_stages_per_rank(live):
    """ZBV and interleaved 1F1B: the estimate walks torch's order of each rank's two stages, each micro-batch's
    position ids and router mask counted once while any of its stages holds them (the rank's stages receive the same
    tensors), what a stage view saves after its HandOff (transformers' own aux loss, dropped with its output) left
    out, and the routing pre-pass's forward-only schedule holding no logits on the last stage (it formed and kept
    every micro-batch's before: 3 micro-batches' logits more than the estimate on the last stage's ranks). Every
    term equal to the byte on every rank."""
    rows = [live[(layout, rank)] for layout in SEVERAL for rank in range(4)]
    _check_terms(rows)
    for row in rows:
        assert _measured_terms_estimated(row) == row["measured"], (row["variant"], row["rank"])
    zbv, interleaved = SEVERAL
    # The last stage: rank 0 under ZBV, rank 1 (DP ranks 2, 3) under interleaved 1F1B.
    assert live[(zbv, 0)]["measured"]["logits and loss"] > 0 == live[(zbv, 2)]["measured"]["logits and loss"]
    assert live[(interleaved, 2)]["measured"]["logits and loss"] > 0 == live[(interleaved, 0)]["measured"][
        "logits and loss"]
    assert all(live[(layout, 0)]["measured"]["router logits and terms"] > 0 for layout in SEVERAL)


def test_interleaved_pipelines_beside_fsdp2_are_refused_by_their_sentence():
    from isotrain.config import build_config
    from isotrain.errors import ConfigError
    from isotrain.memory.estimate import estimate_memory

    model = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
             "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": 64}
    cfg = build_config({"model": {"config": model}, "data": {"max_seq_len": 16},
                        "train": {"micro_batch_size": 2, "global_batch_size": 8},
                        "parallel": {"pp": 2, "dp_replicate": 1, "dp_shard": 2, "pp_schedule": "interleaved_1f1b",
                                     "pp_stages_per_rank": 2}})
    with pytest.raises(ConfigError, match=r"interleaved_1f1b beside FSDP2 \(parallel.dp_shard=2\)"):
        estimate_memory(cfg, 4, vocab_size=64)
