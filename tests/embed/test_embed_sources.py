"""data.sources for `isotrain embed`: pairs of several sources mixed by SFT's rule (data/mixture.py). One process
and 2 ranks learn from the same global batches (equal losses, exact per-source counts), each source gives its
apportioned share of every mixture epoch, and a resume with another weight is refused."""

import io
import json
import random

import pytest
from rich.console import Console

from isotrain.config import load_config
from isotrain.data.mixture import apportion
from isotrain.errors import ConfigError

from helpers import run_concurrently
from zygote import run_forked_ranks, run_isotrain

BERT = ["model.config.model_type=bert", "model.config.hidden_size=32", "model.config.num_hidden_layers=2",
        "model.config.num_attention_heads=2", "model.config.intermediate_size=64",
        "model.config.max_position_embeddings=64", "tokenizer.vocab_size=300", "data.max_seq_len=32", "eval.path=null"]
# 33 pairs: a mixture epoch of 32 = 4 steps of 8, 16 from each source (code's 9 pairs repeat, web's 24 are cycled)
SIZES, WEIGHTS = {"web": 24, "code": 9}, {"web": 2, "code": 2}


def _write_sources(directory) -> str:
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi".split()
    for name, size in SIZES.items():
        rows = []
        for _ in range(size):
            topic = rng.sample(words, 3)
            rows.append(json.dumps({"query": f"{name} " + " ".join(topic),
                                    "positive": " ".join(topic + rng.sample(words, 3)),
                                    "negatives": [" ".join(rng.sample(words, 5))]}))
        (directory / f"{name}.jsonl").write_text("\n".join(rows) + "\n")
    return "data.sources=[" + ", ".join(f"{{path: {directory / name}.jsonl, weight: {WEIGHTS[name]}}}"
                                        for name in SIZES) + "]"


def _overrides(sources: str, run_dir) -> list[str]:
    return [*BERT, sources, f"output_dir={run_dir}", "train.global_batch_size=8", "train.max_steps=4",
            "train.lr=1e-3", "train.warmup_steps=0", "train.deterministic=true", "checkpoint.every_steps=4",
            "logging.progress=false"]


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_a_mixture_of_pair_sources_is_the_same_on_one_process_and_two_ranks(tmp_path):
    sources = _write_sources(tmp_path)
    one, two = tmp_path / "one", tmp_path / "two"
    done = run_concurrently({
        "one": lambda: run_isotrain(["embed", *_overrides(sources, one), "train.micro_batch_size=4"]),
        "two": lambda: run_forked_ranks(2, ["embed", *_overrides(sources, two), "train.micro_batch_size=2"]),
    }, workers=2)
    for proc in done.values():
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert ("mixture of 2 sources; a mixture epoch holds 32 pairs (of 33: whole global batches; largest-remainder "
            "shares of the weights, docs/data.md):") in done["one"].stdout
    rows_one, rows_two = _rows(one), _rows(two)
    assert [row["step"] for row in rows_one] == [1, 2, 3, 4]
    counts = apportion(32, list(WEIGHTS.values())).tolist()
    assert counts == [16, 16]
    for a, b in zip(rows_one, rows_two):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        fields = [key for key in a if key.startswith("source/") or key in ("samples_seen", "tokens_seen")]
        assert len(fields) == 10 and {key: a[key] for key in fields} == {key: b[key] for key in fields}
        assert sum(a[f"source/{name}/samples_seen"] for name in SIZES) == a["samples_seen"]
        assert sum(a[f"source/{name}/tokens_seen"] for name in SIZES) == a["tokens_seen"]
    epoch = rows_one[3]  # after mixture epoch 0: each source's apportioned share, exactly
    assert [epoch[f"source/{name}/samples_seen"] for name in SIZES] == counts
    assert epoch["source/code/epochs"] == 16 / 9

    # Another weight, the same number of pairs per mixture epoch: the resume is refused by the data's fingerprint.
    heavier = sources.replace("weight: 2", "weight: 3", 1)
    cfg = load_config(None, [*_overrides(heavier, one), "train.micro_batch_size=8", "train.max_steps=5"],
                      recipe="embed")
    from isotrain.recipes.embed import embed_train

    with pytest.raises(ConfigError, match=r"^data \(data.path or data.sources, or their settings\) differs from "
                                          r"checkpoint .*step-00000004"):
        embed_train(cfg, Console(file=io.StringIO()))
