"""`isotrain embed` end to end on a tiny BERT (fresh, trained tokenizer): metrics, layouts (replicated and FSDP2),
SIGKILL + resume."""

import json

import pytest
import torch

from isotrain.checkpoint.manifest import verify_checkpoint
from isotrain.errors import ConfigError

from helpers import model_weights, run_concurrently
from zygote import kill_forked_after_commit, run_forked_ranks, run_isotrain

BERT = ["model.config.model_type=bert", "model.config.hidden_size=32", "model.config.num_hidden_layers=2",
        "model.config.num_attention_heads=2", "model.config.intermediate_size=64",
        "model.config.max_position_embeddings=64", "tokenizer.vocab_size=300", "data.max_seq_len=32", "eval.path=null"]


def overrides(data, run_dir):
    return [*BERT, f"data.path={data}", f"output_dir={run_dir}", "train.global_batch_size=8", "train.max_steps=4",
            "train.lr=1e-3", "train.warmup_steps=0", "train.deterministic=true", "embed.hard_negatives=1",
            "embed.symmetric=true", "embed.matryoshka_dims=[32,16]", "checkpoint.every_steps=2", "logging.progress=false"]


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_layouts_sigkill_and_resume(data, tmp_path):
    """Every run is forked from the zygote (tests/zygote.py: real processes and gloo, real SIGKILL, no interpreter
    start-up); how an ordinary torchrun launch meets, dies and resumes is tests/checkpoint/test_restart.py's."""
    one, two, sharded = tmp_path / "one", tmp_path / "two", tmp_path / "sharded"
    args_one = ["embed", *overrides(data, tmp_path / "killed"), "train.micro_batch_size=2"]

    def launch_two():  # 2 ranks × GA 2, SIGKILLed once step 2 is committed, then resumed on ONE process
        kill_forked_after_commit(2, ["embed", *overrides(data, two), "train.micro_batch_size=2"], two, 2)
        return run_isotrain(["embed", *overrides(data, two), "train.micro_batch_size=4"])

    def launch_sharded():  # FSDP2 over 2 ranks × GA 2, SIGKILLed once step 2 is committed, resumed sharded × GA 1
        args = ["embed", *overrides(data, sharded), "parallel.dp_shard=2"]
        kill_forked_after_commit(2, [*args, "train.micro_batch_size=2"], sharded, 2)
        return run_forked_ranks(2, [*args, "train.micro_batch_size=4"])

    done = run_concurrently({
        # Async saves, only the last checkpoint kept: the same run as the synchronous ones.
        "one": lambda: run_isotrain(["embed", *overrides(data, one), "train.micro_batch_size=2",
                                     "checkpoint.async=true", "checkpoint.keep_last=1"]),
        "two": launch_two,
        "sharded": launch_sharded,
    }, workers=2)
    assert done["one"].returncode == 0, done["one"].stderr[-3000:]
    assert done["two"].returncode == 0, done["two"].stderr[-3000:]
    assert done["sharded"].returncode == 0, done["sharded"].stderr[-3000:]
    assert "FSDP2 over 2 rank(s)" in done["sharded"].stdout and "resum" in done["sharded"].stdout.lower()
    assert "skipped 1 of 41 rows: line 41: missing 'positive'" in done["one"].stdout
    assert sorted(p.name for p in (one / "checkpoints").iterdir() if p.name.startswith("step-")) == ["step-00000004"]
    assert verify_checkpoint(one / "checkpoints" / "step-00000004") == []
    assert verify_checkpoint(sharded / "checkpoints" / "step-00000004") == []
    reference = rows(one)
    want = model_weights(one / "model")
    for run_dir in (two, sharded):
        resumed = rows(run_dir)
        assert [r["step"] for r in reference] == [1, 2, 3, 4] == [r["step"] for r in resumed]
        for a, b in zip(reference, resumed):
            assert (a["tokens_seen"], a["samples_seen"]) == (b["tokens_seen"], b["samples_seen"])
            assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
        # Step 1 is the same global batch from the same weights on 1 × GA 4, 2 × GA 2 and FSDP2 2 × GA 2: loss and
        # gradient norm agree.
        assert abs(reference[0]["loss"] - resumed[0]["loss"]) <= 1e-6 * reference[0]["loss"]
        assert abs(reference[0]["grad_norm"] - resumed[0]["grad_norm"]) <= 1e-6 * reference[0]["grad_norm"]
        got = model_weights(run_dir / "model")
        assert want.keys() == got.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5)
    # The sharded run's model is a sentence-transformers directory like the replicated run's.
    for name in ("modules.json", "sentence_bert_config.json", "config_sentence_transformers.json", "1_Pooling/config.json"):
        assert (sharded / "model" / name).read_bytes() == (one / "model" / name).read_bytes()

    # SIGKILL after checkpoint 2 and resume on the same layout: byte-identical final weights.
    killed = tmp_path / "killed"
    kill_forked_after_commit(1, args_one, killed, 2)
    proc = run_isotrain(args_one)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resum" in proc.stdout.lower()
    got = model_weights(killed / "model")
    assert all(torch.equal(got[name], want[name]) for name in want)

    from transformers import AutoModel

    loaded = AutoModel.from_pretrained(one / "model")
    assert type(loaded).__name__ == "BertModel"


def test_pooling_the_model_cannot_do_is_one_sentence(data, tmp_path):
    llama = ["model.config.model_type=llama", "model.config.hidden_size=32", "model.config.intermediate_size=64",
             "model.config.num_hidden_layers=1", "model.config.num_attention_heads=2", "tokenizer.vocab_size=300"]
    proc = run_isotrain(["embed", *llama, f"data.path={data}", f"output_dir={tmp_path / 'r'}", "embed.pooling=cls",
                         "train.global_batch_size=8", "train.micro_batch_size=8", "logging.progress=false"])
    assert proc.returncode != 0
    assert "embed.pooling='cls' cannot embed with 'llama', a causal decoder whose first token sees no other token; " \
           "use embed.pooling=last or mean" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_added_special_tokens_reach_the_embedding_model(data, tmp_path):
    from transformers import AutoModel, AutoTokenizer

    from isotrain.config import load_config
    from isotrain.recipes.embed import embed_train

    cfg = load_config(None, [*overrides(data, tmp_path / "r"), "train.micro_batch_size=8", "train.max_steps=1",
                             "checkpoint.every_steps=0", 'model.add_special_tokens=["<q>","<d>"]'],
                      recipe="embed")
    embed_train(cfg)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "r" / "model")
    assert tokenizer.encode("<q>", add_special_tokens=False) == [tokenizer.convert_tokens_to_ids("<q>")]
    assert AutoModel.from_pretrained(tmp_path / "r" / "model").get_input_embeddings().weight.shape[0] == len(tokenizer)
    assert tokenizer.convert_tokens_to_ids("<d>") == len(tokenizer) - 1


def test_the_rows_negatives_are_used_by_default(data, tmp_path):
    """Without embed.hard_negatives, rows carrying 2 negatives train with 2, and start-up says so."""
    import io

    from rich.console import Console

    from isotrain.config import load_config
    from isotrain.recipes.embed import embed_train

    unset = [o for o in overrides(data, tmp_path / "r") if not o.startswith("embed.hard_negatives=")]
    cfg = load_config(None, [*unset, "train.micro_batch_size=8", "train.max_steps=1", "checkpoint.every_steps=1"],
                      recipe="embed")
    assert cfg.embed.hard_negatives is None
    out = io.StringIO()
    embed_train(cfg, Console(file=out, width=400))
    printed = out.getvalue()
    assert "hard negatives: 2 per query, the fewest a row carries (40 of 40 rows carry 2)" in printed
    assert "embedding 40 pairs (2 hard negatives each), global batch 8: every query is scored against all 24" in printed
    # The count is part of the data's fingerprint: resuming with another one would change the samples.
    changed = load_config(None, [*unset, "train.micro_batch_size=8", "train.max_steps=2", "embed.hard_negatives=1"],
                          recipe="embed")
    with pytest.raises(ConfigError, match=r"^data \(data.path or data.sources, or their settings\) differs from checkpoint .*step-00000001"):
        embed_train(changed, Console(file=io.StringIO()))
