"""`isotrain train` with data.packing=true on families that ignore position-id restarts: the run's probe makes
OPT exact with isotrain's per-document mask (one process, FSDP2 and TP layouts), and refuses BLOOM with one
sentence before any step.

Eight text rows of 9..13 characters (char tokenizer) and max_seq_len=32 pack two documents per sample: the
packed run's one global batch of 4 samples holds the same 8 documents as the unpacked run's batch of 8, so
its first loss (token mean over the same trained tokens, before any update) and gradient norm must agree.
"""

from __future__ import annotations

import functools
import json

import pytest

from helpers import run_concurrently
from zygote import run_forked_ranks, run_isotrain

ROWS = ["alpha beta", "gamma delta!", "epsilon zeta", "eta theta", "iota kappa", "lambda mu", "nu xi omicron",
        "pi rho sigma"]
OPT = ["model.config.model_type=opt", "model.config.hidden_size=64", "model.config.ffn_dim=128",
       "model.config.num_hidden_layers=2", "model.config.num_attention_heads=4", "model.config.word_embed_proj_dim=64",
       "model.config.max_position_embeddings=64", "model.config.dropout=0", "model.config.attention_dropout=0"]
LLAMA = ["model.config.model_type=llama", "model.config.hidden_size=64", "model.config.intermediate_size=128",
         "model.config.num_hidden_layers=2", "model.config.num_attention_heads=4",
         "model.config.num_key_value_heads=2", "model.config.max_position_embeddings=64"]
BLOOM = ["model.config.model_type=bloom", "model.config.hidden_size=64", "model.config.n_layer=2",
         "model.config.n_head=4", "model.attn_implementation=eager"]
PACKED = ["data.packing=true", "train.global_batch_size=4", "train.micro_batch_size=2"]
UNPACKED = ["data.packing=false", "train.global_batch_size=8", "train.micro_batch_size=4"]
REFUSAL = ("data.packing=true would let packed documents attend to each other in BloomForCausalLM, which ignores "
           "the position-id restarts that mark them and cannot take isotrain's per-document attention mask; set "
           "data.packing=false")


def common_overrides(data) -> list[str]:
    return ["tokenizer.type=char", "data.format=text", f"data.path={data}", "data.max_seq_len=32", "train.max_steps=1",
            "eval.path=null", "logging.progress=false", "checkpoint.every_steps=0"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{name: (CompletedProcess, run directory)} of the training runs below, side by side."""
    root = tmp_path_factory.mktemp("packing")
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in ROWS))

    def train(name, nproc, *overrides):
        return run_forked_ranks(nproc, ["train", *common_overrides(data), *overrides, f"output_dir={root / name}"]), \
            root / name

    jobs = {
        "opt fsdp packed": (2, *OPT, *PACKED, "parallel.dp_shard=2"),
        "llama tp packed": (2, *LLAMA, *PACKED, "parallel.tp=2"),
        "llama tp packed varlen": (2, *LLAMA, *PACKED, "parallel.tp=2", "model.attn_implementation=varlen"),
        "llama packed varlen": (1, *LLAMA, *PACKED, "model.attn_implementation=varlen"),
        "opt packed": (1, *OPT, *PACKED),
        "opt unpacked": (1, *OPT, *UNPACKED),
        "llama unpacked": (1, *LLAMA, *UNPACKED),
    }
    return run_concurrently({name: functools.partial(train, name, *args) for name, args in jobs.items()})


def first_row(run) -> dict:
    proc, run_dir = run
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])


@pytest.mark.slow
@pytest.mark.parametrize("packed", ["opt packed", "opt fsdp packed"])
def test_opt_is_masked_and_packed_equals_unpacked(runs, packed):
    got, want = first_row(runs[packed]), first_row(runs["opt unpacked"])
    assert "packing: OPTForCausalLM ignores position-id restarts; isotrain passes a per-document attention mask" \
        in runs[packed][0].stdout
    assert (got["samples_seen"], want["samples_seen"]) == (4, 8)  # two documents in every packed sample
    assert got["trained_tokens"] == want["trained_tokens"]
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)


@pytest.mark.slow
def test_llama_under_tp_keeps_documents_apart_by_positions(runs):
    got, want = first_row(runs["llama tp packed"]), first_row(runs["llama unpacked"])
    assert "packing: LlamaForCausalLM keeps packed documents apart by their position ids" in runs["llama tp packed"][0].stdout
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("packed", ["llama packed varlen", "llama tp packed varlen"])
def test_varlen_cut_documents_give_the_unpacked_loss(runs, packed):
    """model.attn_implementation=varlen (documents cut from the position ids; on CPU each runs through SDPA
    alone), on one process and with the heads split by TP."""
    got, want = first_row(runs[packed]), first_row(runs["llama unpacked"])
    assert (got["samples_seen"], got["trained_tokens"]) == (4, want["trained_tokens"])
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)


def test_bloom_is_refused_before_any_step(tmp_path):
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in ROWS))
    run_dir = tmp_path / "run"
    proc = run_isotrain(["train", *common_overrides(data), *BLOOM, *PACKED, f"output_dir={run_dir}"])
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert " ".join(proc.stderr.split()) == f"error: {REFUSAL}"
    assert not (run_dir / "metrics.jsonl").exists() and not (run_dir / "config.yaml").exists()
