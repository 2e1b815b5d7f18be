"""`isotrain ckpt merge`: each method against its closed form, the same bytes for any number of processes,
and the key policy's refusals."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from isotrain.ckpt import merge_methods as m
from isotrain.ckpt.merge import MergeRecipe, merge_tensor


def t(*values):
    return torch.tensor(values, dtype=torch.float32)


def test_linear_is_the_weighted_mean():
    assert torch.equal(m.linear([t(1, 2), t(3, 4)], [1.0, 3.0], normalize=True), t(2.5, 3.5))
    assert torch.equal(m.linear([t(1, 2), t(3, 4)], [1.0, 3.0], normalize=False), t(10, 14))


def test_task_arithmetic_adds_scaled_task_vectors():
    base = t(1, 1)
    assert torch.equal(m.task_arithmetic(base, [t(2, 3), t(4, -1)], [1.0, 1.0], scale=0.5), t(3, 1))


def test_ties_trims_elects_signs_and_averages_the_agreeing_entries():
    base = t(0, 0, 0, 0)
    first, second = t(3, -1, 0.5, 2), t(-1, -2, 1, 4)
    # density 0.5: first keeps 3 and 2, second keeps -2 and 4; signs of the sum (3, -2, 0, 6): +, -, none, +.
    assert torch.equal(m.trim(first, 0.5), t(3, 0, 0, 2)) and torch.equal(m.trim(second, 0.5), t(0, -2, 0, 4))
    assert torch.equal(m.ties(base, [first, second], [1.0, 1.0], [0.5, 0.5], scale=1.0), t(3, -2, 0, 3))
    # Weights: an agreeing entry is averaged over the weights that contributed to it.
    assert torch.allclose(m.ties(base, [first, second], [1.0, 3.0], [0.5, 0.5], scale=1.0), t(3, -2, 0, 14 / 4))


def test_dare_drops_with_seeded_masks_and_rescales_the_survivors():
    base, tuned = torch.zeros(10_000), torch.ones(10_000)
    merged = m.dare(base, [tuned], [1.0], [0.25], 1.0, "w", seed=7, sign_election=False)
    keep = torch.rand(10_000, generator=m.tensor_generator(7, "w", 0)) < 0.25
    assert torch.equal(merged, torch.where(keep, torch.full_like(tuned, 4.0), torch.zeros_like(tuned)))
    assert abs(float(keep.float().mean()) - 0.25) < 0.02 and abs(float(merged.mean()) - 1.0) < 0.08
    # Another tensor name or model index draws another mask; density 1 is task arithmetic.
    assert not torch.equal(keep, torch.rand(10_000, generator=m.tensor_generator(7, "v", 0)) < 0.25)
    assert not torch.equal(keep, torch.rand(10_000, generator=m.tensor_generator(7, "w", 1)) < 0.25)
    assert torch.equal(m.dare(t(1, 2), [t(2, 4)], [1.0], [1.0], 0.5, "w", 0, sign_election=True), t(1.5, 3))


def test_slerp_follows_the_great_circle():
    a, b = t(1, 0), t(0, 1)
    half = math.sqrt(0.5)
    assert torch.allclose(m.slerp(a, b, 0.5), t(half, half))
    assert torch.allclose(m.slerp(a, b, 1 / 3), t(math.cos(math.pi / 6), math.sin(math.pi / 6)))
    assert torch.equal(m.slerp(a, b, 0.0), a)
    assert torch.allclose(m.slerp(t(1, 1), t(2, 2), 0.25), t(1.25, 1.25))  # parallel: linear


# ----------------------------------------------------------------------------- end to end

TINY = dict(model_type="llama", hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=96, max_position_embeddings=32)


def _save(directory, seed: int, base_dir=None, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    mapping = dict(TINY, **overrides)
    config = AutoConfig.for_model(mapping.pop("model_type"), **mapping)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if base_dir is not None:  # a "fine-tune" of the base: its weights plus a small change
        base = AutoModelForCausalLM.from_pretrained(base_dir)
        with torch.no_grad():
            for (name, p), q in zip(model.named_parameters(), base.parameters()):
                p.copy_(q + 0.05 * torch.randn_like(q))
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("merge")
    base = _save(root / "base", 0)
    return {"root": root, "base": base, "a": _save(root / "a", 1, base), "b": _save(root / "b", 2, base)}


def _recipe(path, **fields):
    path.write_text(yaml.safe_dump(fields))
    return str(path)


def _run(capsys, *argv):
    from isotrain.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    out = capsys.readouterr()
    return exited.value.code, out.out, " ".join(out.err.split())


@pytest.mark.parametrize("method", ["linear", "ties", "slerp"])
def test_a_merged_directory_holds_the_closed_form_of_every_tensor(models, tmp_path, capsys, method):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    fields = dict(method=method, out=str(out), models=[{"path": str(models["a"]), "weight": 0.7},
                                                       {"path": str(models["b"]), "weight": 0.3}])
    if method == "ties":
        fields.update(base=str(models["base"]), density=0.5)
    code, stdout, err = _run(capsys, "ckpt", "merge", _recipe(tmp_path / "r.yaml", **fields))
    assert code == 0, err
    assert "merged " in stdout and "merge.json" in stdout
    recipe = MergeRecipe.model_validate(fields)
    inputs = [load_file(models[k] / "model.safetensors") for k in ("a", "b")]
    base = load_file(models["base"] / "model.safetensors")
    merged = load_file(out / "model.safetensors")
    assert merged.keys() == base.keys()
    for name, tensor in merged.items():
        expected = merge_tensor(recipe, name, base[name], [x[name] for x in inputs])
        assert torch.equal(tensor, expected), name
    AutoModelForCausalLM.from_pretrained(out)  # loads in plain transformers
    from isotrain.checkpoint.manifest import verify_checkpoint

    assert verify_checkpoint(out) == []


def test_a_merge_is_byte_identical_for_any_number_of_processes(models, tmp_path, capsys):
    import shutil

    outputs = []
    out = tmp_path / "out"
    recipe = _recipe(tmp_path / "r.yaml", method="dare_ties", base=str(models["base"]), seed=3, density=0.4,
                     out=str(out), max_shard_gb=0.00002,  # several shards of ~20 kB
                     models=[{"path": str(models["a"])}, {"path": str(models["b"]), "weight": 0.5}])
    for processes in (1, 2):
        code, _, err = _run(capsys, "ckpt", "merge", recipe, "--processes", str(processes))
        assert code == 0, err
        outputs.append({p.name: p.read_bytes() for p in sorted(out.iterdir())})
        shutil.rmtree(out)
    assert len([n for n in outputs[0] if n.endswith(".safetensors")]) > 2
    assert outputs[0] == outputs[1]


def test_a_missing_tensor_is_refused_and_drop_keys_removes_it_with_a_report(models, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    import shutil

    lacking = tmp_path / "lacking"
    shutil.copytree(models["a"], lacking)
    weights = load_file(lacking / "model.safetensors")
    del weights["lm_head.weight"]
    save_file(weights, lacking / "model.safetensors", metadata={"format": "pt"})
    fields = dict(method="task_arithmetic", base=str(models["base"]), out=str(tmp_path / "out"),
                  models=[{"path": str(lacking)}, {"path": str(models["b"])}])
    code, _, err = _run(capsys, "ckpt", "merge", _recipe(tmp_path / "r.yaml", **fields))
    assert code == 2
    assert err == (f"error: {lacking} has no tensor 'lm_head.weight' (1 missing) that {models['base']} has; add it to "
                   "drop_keys or keep_from_base, or merge models of one architecture")
    code, stdout, err = _run(capsys, "ckpt", "merge",
                             _recipe(tmp_path / "r2.yaml", drop_keys=["lm_head.*"], **fields))
    assert code == 0, err
    assert "dropped 1 tensors (12.29 kB): lm_head.weight" in " ".join(stdout.split())
    assert "lm_head.weight" not in load_file(tmp_path / "out" / "model.safetensors")


def test_bad_recipes_get_one_sentence(models, tmp_path, capsys):
    other = _save(tmp_path / "wide", 5, hidden_size=64)
    cases = {
        "missing dir": (dict(method="linear", out=str(tmp_path / "o1"), models=[{"path": str(tmp_path / "nope")}]),
                        f"error: {tmp_path / 'nope'} is not a model directory with config.json; list Hugging Face "
                        "model directories or isotrain checkpoints in the recipe"),
        "shape mismatch": (dict(method="linear", out=str(tmp_path / "o2"),
                                models=[{"path": str(models["a"])}, {"path": str(other)}]),
                           f"error: tensor 'lm_head.weight' has shape [96, 64] in {other} but [96, 32] in "
                           f"{models['a']}; models of different sizes (or vocabularies) cannot be merged tensor by "
                           "tensor"),
        "unknown method": (dict(method="average", out=str(tmp_path / "o3"), models=[{"path": str(models["a"])}]),
                           "error: config value method='average' is invalid: Input should be 'linear', "
                           "'task_arithmetic', 'ties', 'dare_linear', 'dare_ties' or 'slerp'"),
        "no base": (dict(method="ties", out=str(tmp_path / "o4"), models=[{"path": str(models["a"])}]),
                    "error: method ties merges task vectors θ_i − θ_base: set base to the model the others were "
                    "fine-tuned from"),
    }
    for name, (fields, expected) in cases.items():
        code, _, err = _run(capsys, "ckpt", "merge", _recipe(tmp_path / f"{name}.yaml", **fields))
        assert (code, err) == (2, expected), name
