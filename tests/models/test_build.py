"""Build, parallelise, then load: every layout starts from the same weights, and no rank holds the whole model.

Real processes (torchrun, gloo). A fresh model's initialisation is drawn tensor by tensor in the family's
own order, so FSDP2, TP and FSDP2 × TP shards hold exactly the slices of the single-process weights; a
Hugging Face directory loads into every layout with the same values as `from_pretrained`.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from helpers import subprocess_env, torchrun
from zygote import run_forked_ranks, run_isotrain

WORKER = str(Path(__file__).with_name("build_worker.py"))


def _launch(tmp_path, nproc: int, *args: str, env: dict | None = None) -> dict:
    """The worker on `nproc` ranks: forked from the zygote, or started by torchrun with its own environment."""
    out = tmp_path / f"{args[0]}-{nproc}.pt"
    if env is None:
        proc = run_forked_ranks(nproc, [str(out), *args], script=WORKER)
    else:
        proc = torchrun(nproc, [WORKER, str(out), *args], env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny Llama saved by transformers itself, from a different seed than the fresh builds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from build_worker import TINY, tokenizer

    path = tmp_path_factory.mktemp("hf") / "tiny"
    mapping = dict(TINY)
    config = AutoConfig.for_model(mapping.pop("model_type"), **mapping)
    torch.manual_seed(11)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer().save_pretrained(path)
    return path


@pytest.mark.slow
def test_every_layout_builds_the_same_weights(tmp_path, hf_dir):
    from transformers import AutoModelForCausalLM

    from build_worker import TINY, grown_tokenizer, tokenizer, weights
    from isotrain.config import ModelConfig
    from isotrain.models.build import build_plain

    reference = weights(build_plain(ModelConfig(config=TINY), tokenizer(), 3))
    # New special tokens: the vocabulary grows by 6 rows, drawn (seeded) like transformers' resize does.
    grown = weights(build_plain(ModelConfig(name_or_path=str(hf_dir)), grown_tokenizer(), 3))
    loaded = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).state_dict()
    results = _launch(tmp_path, 2, "weights", "1x2x1,1x1x2,2x1x1", str(hf_dir))
    results.update(_launch(tmp_path, 4, "weights", "1x2x2", str(hf_dir)))
    for layout, got in results.items():
        assert got["tied"], layout
        assert got["fresh"].keys() == reference.keys()
        for name, tensor in reference.items():
            assert torch.equal(got["fresh"][name], tensor), (layout, name)
            assert torch.equal(got["loaded"][name], loaded[name]), (layout, name)
        for name, tensor in grown.items():
            assert torch.equal(got["grown"][name], tensor), (layout, name)
    embed = grown["model.embed_tokens.weight"]
    assert embed.shape[0] == 70 and torch.equal(embed[:64], loaded["model.embed_tokens.weight"])
    old = embed[:64]
    assert (embed[64:] - old.mean(0)).norm(dim=1).max() < (old - old.mean(0)).norm(dim=1).mean()  # near the mean
    # The control: another seed gives other weights, so equality above is not vacuous.
    other = weights(build_plain(ModelConfig(config=TINY), tokenizer(), 4))
    assert not torch.equal(other["model.layers.0.mlp.up_proj.weight"], reference["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["1x2x1", "1x1x2"], ids=["fsdp2", "tp2"])
def test_startup_memory_is_a_shard_not_the_model(tmp_path, layout):
    """Peak resident memory added while building a 168 MB model on 2 ranks stays well below the model's size
    (a rank's shard plus the largest tensor); building the whole model in one process, measured the same
    way in the same processes, does not."""
    # A fixed mmap threshold makes glibc return every large freed block at once, so resident memory follows
    # what is alive (by default freed blocks stay in the heap and hide the second build's rise).
    env = {**subprocess_env(), "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    per_rank = _launch(tmp_path, 2, "memory", layout, env=env)[layout]
    for mine, whole, model_bytes in per_rank:
        assert whole >= model_bytes, (whole, model_bytes)
        assert mine < 0.7 * model_bytes, (mine, model_bytes)


@pytest.mark.parametrize("overrides,message", [
    (["parallel.tp=3"], "parallel.tp=3 does not divide the model's attention heads (num_attention_heads=4)"),
    (["parallel.tp=2", "model.config.num_key_value_heads=1"],
     "parallel.tp=2 does not divide the model's key/value heads (num_key_value_heads=1)"),
    (["parallel.tp=2", "model.config.vocab_size=31"],
     "parallel.tp=2 does not divide the vocabulary (vocab_size=31)"),
    (["parallel.tp=2", "model.config.model_type=gpt2", "model.config.n_head=4", "model.config.n_embd=64"],
     "model type 'gpt2' has no tensor-parallel plan"),
], ids=["heads", "kv-heads", "vocab", "no-plan"])
def test_bad_tensor_parallel_settings_get_one_sentence(tmp_path, overrides, message):
    """One sentence from every rank, no traceback."""
    out = tmp_path / "run"
    proc = run_forked_ranks(2 if "parallel.tp=2" in overrides else 3,
                            ["train", f"output_dir={out}", "logging.progress=false", "eval.path=null",
                             "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2",
                             "model.config.intermediate_size=128", "model.config.hidden_size=64",
                             "parallel.dp_replicate=1", *overrides])
    assert proc.returncode != 0
    assert message in proc.stderr
    assert not [line for line in proc.stderr.splitlines() if line.startswith("[rank") and "Traceback" in line]
    assert not (out / "config.yaml").exists() and not (out / "checkpoints").exists()


def test_more_ranks_than_degrees_gets_one_sentence(tmp_path):
    proc = run_isotrain(["config", "show", "parallel.tp=2", "parallel.dp_replicate=1", "--world-size", "4"])
    assert proc.returncode != 0
    assert "parallel.dp_replicate × dp_shard × tp = 1 × 1 × 2 = 2 but 4 processes were launched" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_loaded_model_trains_in_train_mode_with_its_configured_dropout(tmp_path):
    """from_pretrained returns eval mode; a run must still apply the dropout the model's config asks for."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from build_worker import TINY, tokenizer
    from isotrain.config import ModelConfig
    from isotrain.models.build import build_plain

    mapping = dict(TINY, attention_dropout=0.5)
    config = AutoConfig.for_model(mapping.pop("model_type"), **mapping)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    tokenizer().save_pretrained(tmp_path)
    model = build_plain(ModelConfig(name_or_path=str(tmp_path)), tokenizer(), seed=0)
    assert all(module.training for module in model.modules())
    ids = torch.arange(1, 9).unsqueeze(0)
    first, second = (model(input_ids=ids).logits for _ in range(2))
    assert not torch.equal(first, second)  # dropout is active
    model.eval()
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)


def test_a_plan_that_names_the_tied_embedding_keeps_isotrains_vocabulary_split():
    """transformers 5.17 adds `embed_tokens: embedding_rowwise` to the plan of tied models; apply_tp shards the
    input embedding itself (the same vocabulary split), so the entry is not the layers' and not refused."""
    from transformers import LlamaConfig

    from isotrain.parallel.tp import layer_plan

    config = LlamaConfig(tie_word_embeddings=True)
    config.base_model_tp_plan = {**config.base_model_tp_plan, "embed_tokens": "embedding_rowwise"}
    plan = layer_plan(config)
    assert "embed_tokens" not in plan and plan["layers.*.self_attn.q_proj"] == "colwise"
