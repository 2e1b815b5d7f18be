"""LoRA in SFT, and `isotrain ckpt export --adapter`: a peft adapter directory giving the run's own logits."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import TINY_RUN
from zygote import run_isotrain


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = root / "base"
    proc = run_isotrain(["train", *TINY_RUN, "train.max_steps=1", f"output_dir={base}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = root / "run"
    proc = run_isotrain(["train", *TINY_RUN, "model.config=null", f"model.name_or_path={base / 'model'}", "lora.r=4",
                         "lora.alpha=8", "train.lr=1e-2", "train.max_steps=3", "checkpoint.every_steps=3",
                         f"output_dir={run}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return base / "model", run


def test_sft_with_lora_trains_only_the_adapted_layers(lora_run):
    from safetensors.torch import load_file

    base, run = lora_run
    before, after = load_file(base / "model.safetensors"), load_file(run / "model" / "model.safetensors")
    assert before.keys() == after.keys()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed and all(name.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight"))
                           for name in changed), sorted(changed)


# peft itself reads transformers' deprecated is_gradient_checkpointing (transformers 5.24).
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_the_exported_adapter_loads_in_peft_with_the_runs_logits(lora_run, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base, run = lora_run
    checkpoint = run / "checkpoints" / "step-00000003"
    out = tmp_path / "adapter"
    proc = run_isotrain(["ckpt", "export", "--adapter", str(checkpoint), str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (4, 8, str(base))
    saved = load_file(checkpoint / "train_state" / "optimizer.safetensors")
    exported = load_file(out / "adapter_model.safetensors")
    assert len(exported) == 2 * 4 * 2  # lora_A and lora_B of q, k, v, o in 2 layers
    for name, tensor in exported.items():
        key = "adapter." + name.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
        assert torch.equal(tensor, saved[key]), name

    ids = torch.tensor([[1, 5, 9, 12, 7, 3]])
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out).eval()
        merged = AutoModelForCausalLM.from_pretrained(run / "model").eval()
        assert torch.allclose(adapted(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-5, rtol=0)
        plain = AutoModelForCausalLM.from_pretrained(base).eval()
        assert not torch.allclose(plain(input_ids=ids).logits, merged(input_ids=ids).logits, atol=1e-3)


def test_export_adapter_of_a_run_without_lora_is_one_sentence(lora_run, tmp_path):
    base, _ = lora_run
    checkpoint = base.parent / "checkpoints"
    step = sorted(checkpoint.glob("step-*"))
    source = step[-1] if step else base
    proc = run_isotrain(["ckpt", "export", "--adapter", str(source), str(tmp_path / "out")])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert " ".join(proc.stderr.split()) == (f"error: {source} holds no LoRA adapters (it was not saved by a run "
                                             "with lora.r > 0); export its full weights without --adapter")
