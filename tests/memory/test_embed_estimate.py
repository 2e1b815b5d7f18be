"""The embedding step's memory estimate (memory/estimate_embed.py) agrees with the recipe's live step, term by term,
on 1 process, FSDP2 2 and 2 replicas (real processes, gloo), in fp32 and bf16, with and without activation
checkpointing; and `isotrain estimate-memory` prints it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers import run_concurrently
from test_estimate import EXACT, _check_terms
from zygote import run_forked_ranks, run_isotrain

WORKER = str(Path(__file__).with_name("embed_memory_worker.py"))
STEP_TERMS = ("activations", "compute copies", "embeddings and gradient cache", "contrastive loss")


def _measure(tmp_path, nproc: int, *layouts: str) -> list[dict]:
    out = tmp_path / f"embed_{'_'.join(layouts)}.json"
    proc = run_forked_ranks(nproc, [str(out), *layouts], script=WORKER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_embed_estimate_matches_measurement_on_every_layout(tmp_path):
    """A BERT-style encoder (pooler frozen, hidden and attention dropout: eager attention, keyed masks) with mean
    pooling and no chunk bound, the same with CLS pooling, 3 texts per forward and the symmetric Matryoshka loss,
    and a Qwen3 decoder with last-token pooling, 2 texts per forward; the first in bf16, the last in bf16 with
    checkpointing; each on 1 process, FSDP2 2 and 2 replicas."""
    results = run_concurrently({"1": lambda: _measure(tmp_path, 1, "1x1"),
                                "2": lambda: _measure(tmp_path, 2, "1x2", "2x1")}, workers=2)
    rows = results["1"] + results["2"]
    assert len(rows) == 5 * (1 + 2 * 2)
    _check_terms(rows)
    for row in rows:
        assert set(STEP_TERMS) <= set(row["measured"]), row["variant"]
        for term in STEP_TERMS:  # the step's terms are exact too, not only within 5 %
            assert row["estimated"][term] == row["measured"][term], (row["variant"], term)
    by = {(row["variant"], row["rank"]): row["measured"] for row in rows}
    single, sharded, replicated = (by[(f"{layout} bert-mean-n1", 1 if layout != "1x1" else 0)]
                                   for layout in ("1x1", "1x2", "2x1"))
    # The layouts really differ: FSDP2 halves the states, both halve the local vectors, the global loss is the same
    # on every rank; the frozen pooler has parameters but no gradient.
    assert sharded["parameters"] < single["parameters"] == replicated["parameters"]
    assert single["gradients"] < single["parameters"]
    assert replicated["embeddings and gradient cache"] < single["embeddings and gradient cache"]
    assert single["contrastive loss"] == replicated["contrastive loss"] == sharded["contrastive loss"]
    chunked = by[("1x1 bert-cls-n2-c48-sym", 0)]
    assert chunked["activations"] < single["activations"]
    # bf16 is applied: autocast keeps bf16 weight copies and smaller activations on one process and on replicas,
    # FSDP2 casts the parameters themselves (no copies); checkpointing keeps the layers' inputs only.
    for layout, rank in (("1x1", 0), ("2x1", 1)):
        bf16 = by[(f"{layout} bert-mean-n1-bf16", rank)]
        assert bf16["compute copies"] > 0 and bf16["activations"] < by[(f"{layout} bert-mean-n1", rank)]["activations"]
    assert by[("1x2 bert-mean-n1-bf16", 1)]["compute copies"] == 0
    assert by[("1x2 bert-mean-n1-bf16", 1)]["FSDP2 all-gather buffers"] < sharded["FSDP2 all-gather buffers"]
    assert by[("1x1 qwen3-last-n0-c32-bf16-ac", 0)]["activations"] < by[("1x1 qwen3-last-n0-c32", 0)]["activations"] / 4


@pytest.mark.parametrize("chunk_tokens", [0, 16, 40, 48, 100, 10_000])
def test_texts_per_forward_is_the_largest_group_of_the_recipe(chunk_tokens):
    """The estimate's texts per forward is the largest group the recipe's own grouping makes of texts that are all
    data.max_seq_len long (embed/encode.py `forward_groups`)."""
    from isotrain.embed.encode import forward_groups
    from isotrain.memory.embed_step import EmbedShapes

    shapes = EmbedShapes(global_samples=8, negatives=2, local_samples=4, micro_samples=2, seq_len=16, hidden=8,
                         chunk_tokens=chunk_tokens)
    groups = forward_groups([shapes.seq_len] * shapes.micro_texts, chunk_tokens)
    assert shapes.texts_per_forward == max(len(group) for group in groups)


EMBED_ARGS = ["--recipe", "embed", "model.config.model_type=bert", "model.config.hidden_size=64",
              "model.config.num_hidden_layers=2", "model.config.num_attention_heads=2",
              "model.config.intermediate_size=128", "model.config.max_position_embeddings=64",
              "model.config.vocab_size=64", "data.max_seq_len=16", "train.micro_batch_size=2",
              "train.global_batch_size=8", "embed.chunk_tokens=32"]


def test_estimate_memory_command_on_an_embed_config():
    proc = run_isotrain(["estimate-memory", *EMBED_ARGS, "parallel.dp_shard=2", "parallel.dp_replicate=1",
                         "model.dtype=bfloat16", "--world-size", "2", "--json"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    names = [term["name"] for term in report["terms"]]
    assert names[:4] == ["parameters", "fp32 master weights", "gradients", "optimizer moments"]
    assert {"FSDP2 all-gather buffers", *STEP_TERMS} <= set(names)
    settings = report["settings"]
    assert settings["step"] == "embed" and settings["dtype"] == "bfloat16" and settings["dp_shard"] == 2
    table = run_isotrain(["estimate-memory", *EMBED_ARGS, "--dtype", "bfloat16",
                          "train.activation_checkpointing=full"])
    assert table.returncode == 0 and "step: embed" in table.stdout and "recomputed layer" in table.stdout, table.stderr
    assert "bfloat16" in table.stdout and "compute copies" in table.stdout
    refused = run_isotrain(["estimate-memory", *EMBED_ARGS, "--dtype", "float8"])
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "--dtype float8 cannot be estimated for isotrain embed" in refused.stderr
    compiled = run_isotrain(["estimate-memory", *EMBED_ARGS, "train.compile=true"])
    assert compiled.returncode == 2 and "train.compile=true is not supported by isotrain embed" in compiled.stderr
    tp = run_isotrain(["estimate-memory", *EMBED_ARGS, "parallel.tp=2", "parallel.dp_replicate=1",
                       "train.global_batch_size=2", "--world-size", "2"])
    assert tp.returncode == 2 and "isotrain embed runs data parallel only" in tp.stderr, tp.stderr[-2000:]
