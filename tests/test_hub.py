"""Hugging Face Hub ids in model.name_or_path and tokenizer.path, resolved offline from a cache laid out exactly as
huggingface_hub lays it out (tests/hub_cache.py): the same run as from the local directory, revisions, local paths
kept, one sentence when an id is neither a directory nor cached, and one download per machine with 2 ranks."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from helpers import assert_error_sentence, counted_metrics, failure, model_weights, subprocess_env, torchrun
from hub_cache import directory_files, offline_home, write_snapshot
from isotrain.config import ModelConfig, load_config
from isotrain.errors import ConfigError
from isotrain.hub import resolve
from isotrain.models.loading import checked_config
from isotrain.models.loading import model_dir, tokenizer_dir

REPO_ID = "tiny-org/tiny-llama"
TINY = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": 64,
        "tie_word_embeddings": True}


def _save_tiny(path, seed: int, **changes):
    from transformers import AutoConfig, AutoModelForCausalLM

    from isotrain.models.tokenizer import train_tokenizer

    mapping = {**TINY, **changes}
    config = AutoConfig.for_model(mapping.pop("model_type"), **mapping)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    train_tokenizer(["0123456789 +="] * 4, "char", 64).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """Two local model directories: `main` (seed 1) and `v1` (seed 2, 3 layers)."""
    root = tmp_path_factory.mktemp("hub-models")
    return _save_tiny(root / "main", 1), _save_tiny(root / "v1", 2, num_hidden_layers=3)


@pytest.fixture
def hub(tmp_path, monkeypatch, tiny_dirs):
    """An offline Hugging Face home whose cache holds REPO_ID: `main` -> the main directory, tag `v1` -> the other."""
    main_dir, v1_dir = tiny_dirs
    home = tmp_path / "hf-home"
    commits = {"main": write_snapshot(home / "hub", REPO_ID, directory_files(main_dir)),
               "v1": write_snapshot(home / "hub", REPO_ID, directory_files(v1_dir), refs=("v1",))}
    with offline_home(monkeypatch, home):
        yield home, commits


def test_a_hub_id_is_its_cached_snapshot_and_a_revision_selects_the_commit(hub, tiny_dirs):
    home, commits = hub
    main_dir, v1_dir = tiny_dirs
    snapshots = home / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "snapshots"
    assert model_dir(ModelConfig(name_or_path=REPO_ID)) == snapshots / commits["main"]
    assert model_dir(ModelConfig(name_or_path=REPO_ID, revision="v1")) == snapshots / commits["v1"]
    assert model_dir(ModelConfig(name_or_path=REPO_ID, revision=commits["v1"])) == snapshots / commits["v1"]
    assert model_weights(model_dir(ModelConfig(name_or_path=REPO_ID, revision="v1"))).keys() \
        == model_weights(v1_dir).keys()
    for revision, source in ((None, main_dir), ("v1", v1_dir)):
        loaded, saved = model_weights(model_dir(ModelConfig(name_or_path=REPO_ID, revision=revision))), \
            model_weights(source)
        assert all(torch.equal(loaded[name], saved[name]) for name in saved)
    cfg = load_config(None, [f"model.name_or_path={REPO_ID}", "model.revision=v1", "data.max_seq_len=16"])
    assert checked_config(cfg).num_hidden_layers == 3
    assert tokenizer_dir(cfg) == snapshots / commits["v1"]


def test_a_local_path_stays_local_and_refuses_a_revision(hub, tiny_dirs, tmp_path, monkeypatch):
    main_dir, _ = tiny_dirs
    assert model_dir(ModelConfig(name_or_path=str(main_dir))) == main_dir
    # A directory named like a Hub id that exists here is that directory, not the Hub repository.
    local = tmp_path / "work"
    shutil.copytree(main_dir, local / REPO_ID)
    monkeypatch.chdir(local)
    assert model_dir(ModelConfig(name_or_path=REPO_ID)).resolve() == (local / REPO_ID).resolve()
    with pytest.raises(ConfigError) as err:
        model_dir(ModelConfig(name_or_path=str(main_dir), revision="v1"))
    assert str(err.value) == (f"model.revision='v1' selects a version of a Hugging Face Hub repository, but "
                              f"model.name_or_path={str(main_dir)!r} is a local path; remove model.revision or give "
                              "a Hub id")


def test_a_cache_without_weights_is_not_taken_for_a_model(hub, tiny_dirs):
    home, _ = hub
    main_dir, _ = tiny_dirs
    write_snapshot(home / "hub", "tiny-org/config-only", {"config.json": (main_dir / "config.json").read_bytes()})
    cfg = ModelConfig(name_or_path="tiny-org/config-only")
    assert (model_dir(cfg, "config") / "config.json").is_file()  # enough for config show and estimate-memory
    with pytest.raises(ConfigError, match=r"^model.name_or_path='tiny-org/config-only' is in the Hugging Face cache "
                                          r"\(.*\) without model\*.safetensors weights"):
        model_dir(cfg, "weights")


def test_an_unknown_revision_offline_names_both_ways_out(hub):
    home, _ = hub
    with pytest.raises(ConfigError) as err:
        resolve(REPO_ID, "v9", field="model.name_or_path", revision_field="model.revision")
    assert str(err.value) == (f"model.name_or_path={REPO_ID!r} is not a local directory and is not in the Hugging "
                              f"Face cache ({home / 'hub'}) at revision 'v9' while HF_HUB_OFFLINE=1; give a local "
                              "model directory, or run once with network access to download it into that cache")


def _addition_rows(path):
    rows = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(10, 18) for b in range(20, 24)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _run_args(name_or_path: str, data, output_dir, *extra: str) -> list[str]:
    return ["train", f"model.name_or_path={name_or_path}", f"data.path={data}", "data.format=prompt_completion",
            "data.max_seq_len=16", "train.global_batch_size=8", "train.micro_batch_size=4", "train.max_steps=2",
            "train.deterministic=true", "train.warmup_steps=0", "logging.progress=false", "eval.path=null",
            "checkpoint.every_steps=0", f"output_dir={output_dir}", *extra]


def _cli(argv: list[str]) -> int:
    from isotrain.cli import main

    with pytest.raises(SystemExit) as done:
        main(argv)
    return done.value.code


@pytest.mark.slow
def test_training_from_a_hub_id_equals_training_from_the_directory(hub, tiny_dirs, tmp_path):
    main_dir, _ = tiny_dirs
    data = _addition_rows(tmp_path / "rows.jsonl")
    assert _cli(_run_args(str(main_dir), data, tmp_path / "local")) == 0
    assert _cli(_run_args(REPO_ID, data, tmp_path / "hub")) == 0
    assert counted_metrics(tmp_path / "hub") == counted_metrics(tmp_path / "local")
    local, from_hub = model_weights(tmp_path / "local" / "model"), model_weights(tmp_path / "hub" / "model")
    assert local.keys() == from_hub.keys() and all(torch.equal(local[k], from_hub[k]) for k in local)
    # The run keeps the id the user wrote, not the cache path it resolved to.
    assert f"name_or_path: {REPO_ID}" in (tmp_path / "hub" / "config.yaml").read_text()


@pytest.mark.slow
def test_an_id_neither_local_nor_cached_offline_is_one_sentence(hub, tmp_path):
    import subprocess
    import sys

    home, _ = hub
    data = _addition_rows(tmp_path / "rows.jsonl")
    env = {**subprocess_env(), "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "isotrain", *_run_args("Qwen/Qwen3-0.6B", data, tmp_path / "run")],
                          env=env, capture_output=True, text=True, timeout=600)
    assert_error_sentence(proc, (
        f"model.name_or_path='Qwen/Qwen3-0.6B' is not a local directory and is not in the Hugging Face cache "
        f"({home / 'hub'}) while HF_HUB_OFFLINE=1; give a local model directory, or run once with network access to "
        "download it into that cache"))


@pytest.mark.slow
def test_local_rank_0_resolves_first_and_its_error_reaches_every_rank(tmp_path):
    proc = torchrun(2, [str(__import__("pathlib").Path(__file__).parent / "hub_worker.py"), str(tmp_path)])
    assert proc.returncode == 0, failure(proc)
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [s["ok"] for s in seen] == ["fetched", "read 0"]
    assert [s["error"] for s in seen] == ["refused on rank 0 (first=True)"] * 2


@pytest.mark.slow
def test_two_ranks_train_from_a_hub_id_like_one_process(hub, tiny_dirs, tmp_path):
    home, _ = hub
    main_dir, _ = tiny_dirs
    data = _addition_rows(tmp_path / "rows.jsonl")
    assert _cli(_run_args(str(main_dir), data, tmp_path / "one")) == 0
    env = {**subprocess_env(), "HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    proc = torchrun(2, ["-m", "isotrain", *_run_args(REPO_ID, data, tmp_path / "two")], env=env)
    assert proc.returncode == 0, failure(proc)
    one, two = counted_metrics(tmp_path / "one"), counted_metrics(tmp_path / "two")
    exact = ("step", "tokens_seen", "trained_tokens", "samples_seen")
    assert [{k: r[k] for k in exact} for r in two] == [{k: r[k] for k in exact} for r in one]
    for a, b in zip(one, two):  # invariant 1: the same global batch gives the same loss on any layout (fp32)
        assert abs(a["loss"] - b["loss"]) <= 1e-6 * abs(a["loss"])


def test_a_tokenizer_path_hub_id_and_its_revision(hub, tiny_dirs):
    home, commits = hub
    snapshots = home / "hub" / f"models--{REPO_ID.replace('/', '--')}" / "snapshots"
    fresh = ["model.config.model_type=llama", "data.max_seq_len=16"]
    cfg = load_config(None, [*fresh, f"tokenizer.path={REPO_ID}", "tokenizer.revision=v1"])
    assert tokenizer_dir(cfg) == snapshots / commits["v1"]
    with pytest.raises(ConfigError, match=r"^tokenizer.revision='v1' applies to a tokenizer.path Hub id, and "
                                          r"tokenizer.path is not set; remove tokenizer.revision"):
        tokenizer_dir(load_config(None, [*fresh, "tokenizer.revision=v1"]))


@pytest.mark.slow
def test_an_unreachable_hub_and_no_cache_online_is_one_sentence(tmp_path):
    """Online (no offline variable), a Hub that cannot be reached (the reserved .invalid domain never resolves: no
    port must stay free) and an empty cache: the same two ways out."""
    import subprocess
    import sys

    env = {**subprocess_env(), "HF_HOME": str(tmp_path / "hf-home"), "HF_ENDPOINT": "http://hub.invalid"}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    proc = subprocess.run([sys.executable, "-m", "isotrain", "config", "show", f"model.name_or_path={REPO_ID}"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert_error_sentence(proc, (
        f"model.name_or_path={REPO_ID!r} is not a local directory and is not in the Hugging Face cache "
        f"({tmp_path / 'hf-home' / 'hub'}) and the Hugging Face Hub could not be reached (ConnectError); give a "
        "local model directory, or run once with network access to download it into that cache"))
