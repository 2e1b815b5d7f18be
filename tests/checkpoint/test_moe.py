"""MoE checkpoints: experts saved per expert under global ids, as `save_pretrained` writes them, on any layout.

Tiny Qwen3-MoE and Mixtral models (4 experts, top-2, hidden 32, 2 layers): the model directory equals
transformers' own `save_pretrained` of the trained model and loads in plain transformers with the same
logits; the optimizer state uses the same names; a save on any of 1 process, EP 2 and EP 2 × FSDP2 2 (and
FSDP2 2) resumes on the others with equal losses; a SIGKILL under EP 2 leaves a checkpoint that resumes
byte-identically; TP 2 and EP 2 × TP 2 (experts replicated over TP) save the same per-expert keys and
resume across (TP 2 -> EP 2, 1 -> EP 2 × TP 2 -> 1); a missing or duplicated
expert is refused naming the key; an older checkpoint with fused expert keys still loads and exports.
"""

from __future__ import annotations

import json
import shutil
from collections import defaultdict

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from helpers import model_weights, rewrite_as_sha256_manifest, run_concurrently
from isotrain.ckpt.export import export_checkpoint
from isotrain.checkpoint.layout import write_latest
from isotrain.checkpoint.manifest import verify_checkpoint
from isotrain.config import load_config
from isotrain.errors import CheckpointError
from isotrain.models.expert_keys import expert_format, fused_name
from isotrain.recipes.sft import train
from test_resume import kill_after_checkpoint, metrics, run

SHAPE = ["model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.num_hidden_layers=2",
         "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2",
         "model.config.num_experts_per_tok=2"]
FAMILY = {
    "qwen3_moe": ["model.config.model_type=qwen3_moe", "model.config.num_experts=4",
                  "model.config.moe_intermediate_size=32"],
    "mixtral": ["model.config.model_type=mixtral", "model.config.num_local_experts=4"],
}
SHORT = ["train.max_steps=6", "checkpoint.every_steps=3"]


def moe(family: str) -> list[str]:
    return [*SHAPE, *FAMILY[family]]


def in_process(family: str | None, output_dir, *more: str):
    """A run in this process; `family` None: the model comes from `more` (model.name_or_path)."""
    cfg = load_config(None, [*(moe(family) if family else []), "train.global_batch_size=16", "train.micro_batch_size=4",
                             "train.deterministic=true", "logging.progress=false", "eval.path=null", *SHORT,
                             f"output_dir={output_dir}", *more])
    return train(cfg)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """trained(family): a 6-step single-process run in this process (checkpoints at 3 and 6) and its model."""
    done = {}

    def get(family: str):
        if family not in done:
            run_dir = tmp_path_factory.mktemp(family) / "run"
            done[family] = (run_dir, in_process(family, run_dir).model)
        return done[family]

    return get


@pytest.mark.parametrize("family", sorted(FAMILY))
def test_the_model_directory_is_what_save_pretrained_writes_and_loads_in_transformers(tmp_path, trained, family):
    run_dir, model = trained(family)
    checkpoint = run_dir / "checkpoints" / "step-00000006"
    model.save_pretrained(tmp_path / "hf")
    expected, got = load_file(tmp_path / "hf" / "model.safetensors"), model_weights(checkpoint)
    assert got.keys() == expected.keys()
    assert any(".experts.3." in key for key in got)  # per expert, under global ids
    for key in expected:
        assert got[key].shape == expected[key].shape and torch.equal(got[key], expected[key]), key
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 7, 3, 9, 2, 4, 6]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    # The optimizer state is stored under the same per-expert names: moments and step for every model key.
    state = set()
    for path in (checkpoint / "train_state").glob("optimizer*.safetensors"):
        state |= set(load_file(path))
    assert state == {f"{kind}.{key}" for key in expected for kind in ("exp_avg", "exp_avg_sq", "step")}
    assert json.loads((checkpoint / "config.json").read_text())["architectures"] == [type(model).__name__]


@pytest.fixture(scope="module")
def saved_on(tmp_path_factory):
    """saved_on(layout): a 6-step qwen3_moe run on 1 process, 2 FSDP2 ranks, EP 2, EP 2 × FSDP2 2 or TP 2,
    checkpoints at 3 and 6."""
    runs = {layout: tmp_path_factory.mktemp(layout) / "run" for layout in ("single", "fsdp2", "ep2", "ep2fsdp2", "tp2")}
    run_concurrently({layout: (lambda layout=layout: run(layout, runs[layout], *moe("qwen3_moe"), *SHORT))
                      for layout in runs})
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "ep2", "ep2fsdp2", "tp2"])
def test_every_layout_trains_the_single_process_losses(saved_on, layout):
    """`isotrain train` on FSDP2 2, EP 2, EP 2 × FSDP2 2 and TP 2 logs the 1-process run's counts, losses and aux loss."""
    reference, got = metrics(saved_on["single"]), metrics(saved_on[layout])
    for key in ("step", "tokens_seen", "trained_tokens", "samples_seen", "lr"):
        assert [r[key] for r in got] == [r[key] for r in reference], key
    assert got[0]["loss"] == pytest.approx(reference[0]["loss"], rel=1e-6)
    for a, b in zip(reference, got, strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("source,target", [
    ("single", "ep2"), ("single", "ep2fsdp2"), ("ep2", "single"), ("ep2", "ep2fsdp2"), ("ep2fsdp2", "single"),
    ("ep2fsdp2", "ep2"), ("single", "fsdp2"), ("fsdp2", "ep2"), ("tp2", "ep2"),
])
def test_a_save_on_one_layout_resumes_on_the_other_with_equal_losses(tmp_path, saved_on, source, target):
    reference = saved_on[source]
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000006")
    shutil.rmtree(run_dir / "model")
    write_latest(run_dir / "checkpoints", "step-00000003")
    proc = run(target, run_dir, *moe("qwen3_moe"), *SHORT)
    assert "resumed from" in proc.stdout and "step-00000003" in proc.stdout
    for key in ("tokens_seen", "trained_tokens", "samples_seen", "lr"):
        assert [r[key] for r in metrics(reference)[3:]] == [r[key] for r in metrics(run_dir)[3:]], key
    for a, b in zip(metrics(reference)[3:], metrics(run_dir)[3:], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    expected, got = (model_weights(d / "checkpoints" / "step-00000006") for d in (reference, run_dir))
    assert expected.keys() == got.keys()
    for name in expected:
        scale = expected[name].abs().max().clamp_min(1e-12)
        assert ((got[name] - expected[name]).abs().max() / scale) <= 1e-6, name


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp2", "ep2", "ep2fsdp2"])
def test_ranks_each_write_the_experts_they_hold(saved_on, layout):
    """2 ranks, 4 experts: dim 0 of each fused tensor is split 2 + 2 (by FSDP2 or by EP), so experts 0-1 go
    to one file and 2-3 to the other, with their moments (no expert travels to another rank); the directory
    loads in plain transformers, every key used, with the logits of the 1-process run's checkpoint."""
    checkpoint = saved_on[layout] / "checkpoints" / "step-00000006"
    loaded, info = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    single = AutoModelForCausalLM.from_pretrained(saved_on["single"] / "checkpoints" / "step-00000006",
                                                  dtype=torch.float32)
    ids = torch.tensor([[1, 5, 7, 3, 9, 2, 4, 6]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, single(ids).logits, rtol=1e-5, atol=1e-5)
    for index in ("model.safetensors.index.json", "train_state/optimizer.safetensors.index.json"):
        weight_map = json.loads((checkpoint / index).read_text())["weight_map"]
        files = defaultdict(set)
        for key, name in weight_map.items():
            if ".experts." in key and not key.startswith("step."):
                files[int(key.split(".experts.")[1].split(".")[0])].add(name)
        assert all(len(names) == 1 for names in files.values()), files
        assert files[0] == files[1] != files[2] == files[3]


def _close_weights(got: dict, expected: dict, rtol: float = 1e-6) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        scale = expected[name].abs().max().clamp_min(1e-12)
        assert ((got[name] - expected[name]).abs().max() / scale) <= rtol, name


@pytest.fixture(scope="module")
def ep2tp2(saved_on, tmp_path_factory):
    """EP 2 × TP 2 (4 processes) resuming the 1-process run's step 3 and saving every step (4, 5, 6): one
    launch that both loads a 1-process checkpoint and writes EP 2 × TP 2 ones."""
    run_dir = tmp_path_factory.mktemp("ep2tp2") / "run"
    shutil.copytree(saved_on["single"], run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000006")
    shutil.rmtree(run_dir / "model")
    write_latest(run_dir / "checkpoints", "step-00000003")
    proc = run("ep2tp2", run_dir, *moe("qwen3_moe"), *SHORT, "checkpoint.every_steps=1", "checkpoint.keep_last=4")
    assert "resumed from" in proc.stdout and "step-00000003" in proc.stdout
    return run_dir


@pytest.mark.slow
def test_expert_and_tensor_parallel_resumes_a_single_process_save(saved_on, ep2tp2):
    """1 -> EP 2 × TP 2: the same samples and losses for steps 4-6, the final weights of the 1-process run."""
    reference = saved_on["single"]
    for key in ("tokens_seen", "trained_tokens", "samples_seen", "lr"):
        assert [r[key] for r in metrics(reference)[3:]] == [r[key] for r in metrics(ep2tp2)[3:]], key
    for a, b in zip(metrics(reference)[3:], metrics(ep2tp2)[3:], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["aux_loss"] == pytest.approx(a["aux_loss"], rel=1e-5)
    _close_weights(model_weights(ep2tp2 / "checkpoints" / "step-00000006"),
                   model_weights(reference / "checkpoints" / "step-00000006"))


@pytest.mark.slow
def test_a_save_under_expert_and_tensor_parallel_resumes_on_one_process(tmp_path, saved_on, ep2tp2):
    """EP 2 × TP 2 -> 1: the 1-process run resumed from the EP 2 × TP 2 run's step 4 reaches the uninterrupted
    run's losses and final weights."""
    reference, run_dir = saved_on["single"], tmp_path / "run"
    shutil.copytree(ep2tp2, run_dir)
    for step in (5, 6):
        shutil.rmtree(run_dir / "checkpoints" / f"step-{step:08d}")
    shutil.rmtree(run_dir / "model")
    write_latest(run_dir / "checkpoints", "step-00000004")
    proc = run("single", run_dir, *moe("qwen3_moe"), *SHORT)
    assert "resumed from" in proc.stdout and "step-00000004" in proc.stdout and "saved on 4 rank(s)" in proc.stdout
    for a, b in zip(metrics(reference)[4:], metrics(run_dir)[4:], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    _close_weights(model_weights(run_dir / "checkpoints" / "step-00000006"),
                   model_weights(reference / "checkpoints" / "step-00000006"))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "ep2tp2"])
def test_tensor_parallel_moe_saves_the_per_expert_keys_and_loads_in_transformers(saved_on, ep2tp2, layout):
    """Experts replicated over TP are written once, per expert under global ids: the same keys and shapes as
    the 1-process save, every key used by plain transformers, the same logits."""
    checkpoint = (saved_on["tp2"] if layout == "tp2" else ep2tp2) / "checkpoints" / "step-00000006"
    single = saved_on["single"] / "checkpoints" / "step-00000006"
    got, expected = model_weights(checkpoint), model_weights(single)
    assert got.keys() == expected.keys() and "model.layers.1.mlp.experts.3.down_proj.weight" in got
    assert all(got[key].shape == expected[key].shape for key in expected)
    loaded, info = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    reference = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 7, 3, 9, 2, 4, 6]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_a_sigkill_under_expert_parallel_resumes_byte_identically(tmp_path, saved_on):
    straight, resumed = saved_on["ep2"], tmp_path / "resumed"
    kill_after_checkpoint("ep2", resumed, 3, *moe("qwen3_moe"), *SHORT)
    proc = run("ep2", resumed, *moe("qwen3_moe"), *SHORT)
    assert "resumed from" in proc.stdout and "step-00000003" in proc.stdout
    final_a, final_b = straight / "checkpoints" / "step-00000006", resumed / "checkpoints" / "step-00000006"
    assert verify_checkpoint(final_b) == []
    files = sorted(p.relative_to(final_a).as_posix() for p in final_a.rglob("*.safetensors"))
    assert files and any("optimizer" in name for name in files)
    for name in files:
        assert (final_a / name).read_bytes() == (final_b / name).read_bytes(), name


def _hf_directory(trained, tmp_path, family: str):
    """A copy of a run's final model directory (a plain Hugging Face directory with its tokenizer)."""
    source = tmp_path / "hf"
    shutil.copytree(trained(family)[0] / "model", source)
    (source / "manifest.json").unlink()
    return source


def _start_from(source, output_dir, *more: str):
    return in_process(None, output_dir, "model.config=null", f"model.name_or_path={source}", "train.max_steps=1",
                      *more)


def test_a_model_directory_saved_per_expert_loads_into_the_fused_experts(tmp_path, trained):
    """A Hugging Face directory (per-expert keys, mixtral's router under block_sparse_moe) is read into a
    model's fused experts tensor for tensor as transformers reads it, and starts a run."""
    from isotrain.checkpoint.load import load_hf_weights

    source = _hf_directory(trained, tmp_path, "mixtral")
    theirs = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).state_dict()
    model = AutoModelForCausalLM.from_config(AutoModelForCausalLM.from_pretrained(source).config)
    load_hf_weights(source, model, rank=0)
    ours = model.state_dict()
    assert ours.keys() == theirs.keys() and "model.layers.0.mlp.experts.gate_up_proj" in ours
    for name in theirs:
        assert torch.equal(ours[name], theirs[name]), name
    assert _start_from(source, tmp_path / "out").counters is not None


@pytest.mark.parametrize("damage", ["missing", "duplicated"])
def test_a_missing_or_duplicated_expert_is_refused_naming_the_key(tmp_path, trained, damage):
    source = _hf_directory(trained, tmp_path, "qwen3_moe")
    tensors = load_file(source / "model.safetensors")
    key = "model.layers.1.mlp.experts.2.up_proj.weight"
    if damage == "missing":
        del tensors[key]
        save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    else:
        # Two files as two expert-parallel ranks that numbered their experts from 0 would write them: the
        # second file holds expert 3's weight under expert 2's key, and the index can map the key to one only.
        second = {key: tensors["model.layers.1.mlp.experts.3.up_proj.weight"]}
        (source / "model.safetensors").rename(source / "model-00001-of-00002.safetensors")
        save_file(second, source / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
        weight_map = {k: "model-00001-of-00002.safetensors" for k in tensors} | {
            key: "model-00002-of-00002.safetensors"}
        (source / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    with pytest.raises(CheckpointError) as caught:
        _start_from(source, tmp_path / "out")
    said = "is missing (expert 2 of 4)" if damage == "missing" else "is stored 2 times (an expert is duplicated)"
    assert f"expert tensor {key!r} {said}" in str(caught.value)
    assert "\n" not in str(caught.value)


def test_verify_names_a_missing_expert_of_a_checkpoint(tmp_path, trained):
    checkpoint = tmp_path / "step"
    shutil.copytree(trained("mixtral")[0] / "checkpoints" / "step-00000003", checkpoint)
    assert verify_checkpoint(checkpoint) == []
    tensors = load_file(checkpoint / "model.safetensors")
    del tensors["model.layers.0.block_sparse_moe.experts.1.w2.weight"]
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    resign(checkpoint)  # the files are consistent with the manifest: only an expert is gone
    assert verify_checkpoint(checkpoint) == [
        f"{checkpoint}: expert tensor 'model.layers.0.block_sparse_moe.experts.1.w2.weight' is missing "
        "(expert 1 of 4)"]


def resign(checkpoint) -> None:
    """A manifest for the files as they now are (sha256, version 1): rewritten files pass the byte checks."""
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    for name in manifest["files"]:
        manifest["files"][name]["bytes"] = (checkpoint / name).stat().st_size
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    rewrite_as_sha256_manifest(checkpoint)


def to_fused(checkpoint, family: str) -> None:
    """Rewrite a checkpoint as isotrain wrote MoE checkpoints before per-expert saving: experts fused under
    their in-memory names (mixtral's block as `mlp`), optimizer state by the same names; sha256 manifest."""
    fmt = expert_format({"model_type": family})
    for path in [checkpoint / "model.safetensors", checkpoint / "train_state" / "optimizer.safetensors"]:
        tensors, fused = load_file(path), defaultdict(dict)
        out = {}
        for key, tensor in tensors.items():
            kind, _, rest = key.partition(".") if not key.startswith("model.") else ("", "", key)
            back = fused_name(rest, fmt)
            prefix = f"{kind}." if kind else ""
            if back is None:
                out[prefix + rest.replace(".block_sparse_moe.", ".mlp.")] = tensor
                continue
            name, expert = back
            leaf = rest.rsplit(".", 2)[-2]
            fused[(prefix, name)][(expert, leaf)] = tensor
        for (prefix, name), parts in fused.items():
            experts = sorted({e for e, _ in parts})
            if kind_is_step := prefix == "step.":
                out[prefix + name] = next(iter(parts.values()))
            elif name.endswith("down_proj"):
                out[prefix + name] = torch.stack([parts[(e, fmt.down)] for e in experts])
            else:
                out[prefix + name] = torch.stack([torch.cat([parts[(e, fmt.gate)], parts[(e, fmt.up)]])
                                                  for e in experts])
            assert not kind_is_step or len({float(t) for t in parts.values()}) == 1
        save_file(out, path, metadata={"format": "pt"})
    index = checkpoint / "train_state" / "optimizer.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"] = {key: "optimizer.safetensors" for key in sorted(load_file(path))}
    index.write_text(json.dumps(doc))
    resign(checkpoint)


def test_an_older_checkpoint_with_fused_expert_keys_resumes_and_exports_per_expert(tmp_path, trained):
    reference = trained("mixtral")[0]
    run_dir = tmp_path / "run"
    shutil.copytree(reference, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000006")
    shutil.rmtree(run_dir / "model")
    write_latest(run_dir / "checkpoints", "step-00000003")
    old = run_dir / "checkpoints" / "step-00000003"
    to_fused(old, "mixtral")
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(old / "model.safetensors")
    assert verify_checkpoint(old) == []
    exported = tmp_path / "exported"
    export_checkpoint(old, exported)
    expected = model_weights(reference / "checkpoints" / "step-00000003")
    got = model_weights(exported)
    assert got.keys() == expected.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    in_process("mixtral", run_dir)
    for a, b in zip(metrics(reference)[3:], metrics(run_dir)[3:], strict=True):
        assert b["loss"] == a["loss"]  # same layout, deterministic: the very same run
    final = model_weights(run_dir / "checkpoints" / "step-00000006")
    assert final.keys() == expected.keys()  # saved per expert again
    reference_final = model_weights(reference / "checkpoints" / "step-00000006")
    assert all(torch.equal(final[k], reference_final[k]) for k in final)


def test_inspect_describes_the_experts(trained, capsys):
    from isotrain.cli import main

    checkpoint = trained("qwen3_moe")[0] / "checkpoints" / "step-00000003"
    with pytest.raises(SystemExit) as exit_info:
        main(["ckpt", "inspect", str(checkpoint)])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "experts: 2 MoE layer(s) x 4 experts (qwen3_moe), stored one tensor per expert and projection " \
           "(global ids 0-3)" in out


def test_bf16_moe_checkpoints_hold_fp32_masters_per_expert_and_resume_exactly(tmp_path):
    """bf16 model files per expert, their fp32 masters under the same per-expert names, read back on resume:
    the resumed run's files are byte-identical to the uninterrupted run's."""
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    for run_dir in (straight, resumed):
        in_process("qwen3_moe", run_dir, "model.dtype=bfloat16")
    shutil.rmtree(resumed / "checkpoints" / "step-00000006")
    shutil.rmtree(resumed / "model")
    write_latest(resumed / "checkpoints", "step-00000003")
    in_process("qwen3_moe", resumed, "model.dtype=bfloat16")
    a, b = straight / "checkpoints" / "step-00000006", resumed / "checkpoints" / "step-00000006"
    for name in ("model.safetensors", "train_state/optimizer.safetensors"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    model, state = load_file(a / "model.safetensors"), load_file(a / "train_state" / "optimizer.safetensors")
    key = "model.layers.1.mlp.experts.3.gate_proj.weight"
    assert model[key].dtype == torch.bfloat16 and state[f"master.{key}"].dtype == torch.float32
    assert torch.equal(state[f"master.{key}"].to(torch.bfloat16), model[key])
