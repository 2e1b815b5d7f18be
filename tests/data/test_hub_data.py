"""Hugging Face Hub datasets as data sources, resolved offline from a cache laid out as huggingface_hub lays it out
(tests/hub_cache.py): `org/name` reads every data file of the repository, `hf://datasets/org/name[@rev]/pattern`
the files its pattern matches; the samples are those of the same files on disk; an id neither local nor cached is
one sentence; a missing local file is still named as one."""

from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import counted_metrics, isotrain_cli
from hub_cache import offline_home, write_snapshot
from isotrain.config import SFTDataConfig
from isotrain.data import prepare_dataset
from isotrain.errors import ConfigError, DataError
from isotrain.models.tokenizer import train_tokenizer

REPO_ID = "tiny-org/corpus"
SHARDS = {"data/train-00000.jsonl": ["abc", "abcdef"], "data/train-00001.jsonl": ["ghij", "klmnopq", "rs"],
          "data/test-00000.jsonl": ["tuv"]}


def jsonl(texts) -> bytes:
    return "".join(json.dumps({"text": text}) + "\n" for text in texts).encode()


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline Hugging Face home whose cache holds REPO_ID: `main` -> SHARDS and a README, tag `v1` -> one
    older shard."""
    home = tmp_path / "hf-home"
    files = {name: jsonl(texts) for name, texts in SHARDS.items()}
    write_snapshot(home / "hub", REPO_ID, {**files, "README.md": b"# corpus\n"}, repo_type="dataset")
    write_snapshot(home / "hub", REPO_ID, {"data/train-00000.jsonl": jsonl(["zz"])}, refs=("v1",),
                   repo_type="dataset")
    with offline_home(monkeypatch, home):
        yield home


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["abcdefghijklmnopqrstuvwxyz"], "char", 64)


def texts_of(dataset, tok) -> list[str]:
    return sorted(tok.decode(sample.input_ids[1:-1]) for sample in dataset)


@pytest.mark.parametrize(("path", "texts"), [
    (REPO_ID, [t for texts in SHARDS.values() for t in texts]),
    (f"hf://datasets/{REPO_ID}/data/train-*.jsonl", SHARDS["data/train-00000.jsonl"] + SHARDS["data/train-00001.jsonl"]),
    (f"hf://datasets/{REPO_ID}@v1/data/train-*.jsonl", ["zz"]),
])
def test_a_hub_dataset_gives_the_samples_of_its_files(hub, tok, path, texts):
    dataset = prepare_dataset(SFTDataConfig(path=path, format="text", max_seq_len=16), tok, log=lambda *_: None)
    assert texts_of(dataset, tok) == sorted(texts)
    assert dataset.stats.num_rows_read == len(texts)


def test_a_hub_dataset_that_is_not_cached_offline_is_one_sentence_and_a_missing_file_is_named(hub, tok, tmp_path):
    with pytest.raises(ConfigError) as caught:
        prepare_dataset(SFTDataConfig(path="tiny-org/absent", format="text"), tok, log=lambda *_: None)
    assert str(caught.value).startswith("data.path='tiny-org/absent' is not a local directory and is not in the "
                                        f"Hugging Face cache ({hub / 'hub'}) while HF_HUB_OFFLINE=1; give a local "
                                        "dataset directory, or run once with network access")
    with pytest.raises(DataError, match=r"^data.path 'nope/train.jsonl' does not exist; point data.path at a "):
        prepare_dataset(SFTDataConfig(path="nope/train.jsonl", format="text"), tok, log=lambda *_: None)
    with pytest.raises(DataError, match=r"matches no .jsonl, .jsonl.gz, .json or .parquet file of the dataset"):
        prepare_dataset(SFTDataConfig(path=f"hf://datasets/{REPO_ID}/data/valid-*.jsonl", format="text"), tok,
                        log=lambda *_: None)


@pytest.mark.slow
def test_a_run_on_a_hub_dataset_trains_what_the_same_run_on_its_local_files_trains(hub, tmp_path):
    local = tmp_path / "shards"
    local.mkdir()
    for name in ("data/train-00000.jsonl", "data/train-00001.jsonl"):
        (local / name.split("/")[1]).write_bytes(jsonl(SHARDS[name]))
    tiny = ["model.config.model_type=llama", "model.config.hidden_size=32", "model.config.intermediate_size=64",
            "model.config.num_hidden_layers=2", "model.config.num_attention_heads=2",
            "model.config.num_key_value_heads=1", "tokenizer.type=char", "data.format=text", "data.max_seq_len=16",
            "train.global_batch_size=2", "train.micro_batch_size=1", "train.max_steps=2", "eval.path=null",
            "logging.progress=false", "checkpoint.every_steps=0"]
    runs = {}
    for name, path in (("hub", f"hf://datasets/{REPO_ID}/data/train-*.jsonl"), ("local", str(local))):
        proc = isotrain_cli(["train", *tiny, f"data.path={path}", f"output_dir={tmp_path / 'runs' / name}"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = counted_metrics(tmp_path / "runs" / name)
    assert runs["hub"] == runs["local"]
