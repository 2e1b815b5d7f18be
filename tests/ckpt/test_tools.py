"""`isotrain ckpt list|inspect|verify|export` on real checkpoints written by 2 FSDP2 ranks and by a
bf16 run: every kind of corruption is named, exports load in transformers with the trained weights."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers import TINY_RUN, model_weights, rewrite_as_sha256_manifest
from zygote import run_forked_ranks, run_isotrain
from isotrain.cli import main

TINY = [*TINY_RUN, "train.max_steps=4", "checkpoint.every_steps=2"]


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """Run the `isotrain` CLI in this process; (exit code, stdout, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        main([*args])
    out = capsys.readouterr()
    return exit_info.value.code, out.out, out.err


@pytest.fixture(scope="module")
def fsdp2_run(tmp_path_factory):
    """4 steps on 2 FSDP2 ranks: checkpoints at steps 2 and 4, each with 2 model and 2 optimizer files."""
    run_dir = tmp_path_factory.mktemp("fsdp2") / "run"
    proc = run_forked_ranks(2, ["train", *TINY, "parallel.dp_shard=2", f"output_dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


@pytest.fixture
def checkpoint(fsdp2_run, tmp_path):
    """A private copy of the newest checkpoint, safe to damage."""
    copy = tmp_path / "step-00000004"
    shutil.copytree(fsdp2_run / "checkpoints" / "step-00000004", copy)
    return copy


def flip_byte(path, offset_from_end: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-64])


def edit_index(path) -> None:
    index = json.loads(path.read_text())
    name = sorted(index["weight_map"])[0]
    other = {f for f in index["weight_map"].values() if f != index["weight_map"][name]}.pop()
    index["weight_map"][name] = other  # points a tensor at the file that does not hold it
    path.write_text(json.dumps(index, indent=2))


CORRUPTIONS = {
    "flipped byte": ("model-00001-of-00002.safetensors", flip_byte, "blake3"),
    "flipped optimizer byte": ("train_state/optimizer-00002-of-00002.safetensors", flip_byte, "blake3"),
    "flipped header byte": ("model-00002-of-00002.safetensors", lambda p: flip_byte(p, p.stat().st_size - 30),
                            "blake3"),
    "flipped state byte": ("train_state/state.json", flip_byte, "blake3"),
    "truncated shard": ("model-00002-of-00002.safetensors", truncate, "bytes"),
    "deleted file": ("tokenizer.json", lambda p: p.unlink(), "missing"),
    "deleted shard": ("train_state/optimizer-00001-of-00002.safetensors", lambda p: p.unlink(), "missing"),
    "edited index": ("model.safetensors.index.json", edit_index, "manifest"),
    "missing manifest": ("manifest.json", lambda p: p.unlink(), "missing"),
    "unlisted file": ("extra.bin", lambda p: p.write_bytes(b"x"), "not listed"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", CORRUPTIONS)
def test_verify_names_the_bad_file(checkpoint, capsys, name):
    file_name, damage, words = CORRUPTIONS[name]
    assert cli(capsys, "ckpt", "verify", str(checkpoint))[0] == 0
    damage(checkpoint / file_name)
    code, out, err = cli(capsys, "ckpt", "verify", str(checkpoint))
    assert code == 1
    first = err.splitlines()[0]
    assert first.startswith("error: ") and str(checkpoint / file_name) in first and words in first, err
    assert "Traceback" not in err and "valid" not in out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["flipped byte", "flipped header byte", "truncated shard", "deleted shard"])
def test_a_sha256_checkpoint_from_before_blake3_still_verifies(checkpoint, capsys, name):
    rewrite_as_sha256_manifest(checkpoint)
    code, out, _ = cli(capsys, "ckpt", "verify", str(checkpoint))
    assert code == 0 and "sizes, sha256, headers and indexes checked" in out, out
    file_name, damage, words = CORRUPTIONS[name]
    damage(checkpoint / file_name)
    code, out, err = cli(capsys, "ckpt", "verify", str(checkpoint))
    first = err.splitlines()[0]
    words = "sha256" if words == "blake3" else words
    assert code == 1 and str(checkpoint / file_name) in first and words in first, err


@pytest.mark.slow
def test_an_edited_index_is_found_by_its_content_too(checkpoint, capsys):
    """Without hashes (--no-hash) the index still has to agree with the files' headers."""
    edit_index(checkpoint / "model.safetensors.index.json")
    code, _, err = cli(capsys, "ckpt", "verify", "--no-hash", str(checkpoint))
    assert code == 1 and "model.safetensors.index.json" in err and "lacks" in err, err


@pytest.mark.slow
def test_verify_from_the_shell_exits_non_zero_without_a_traceback(checkpoint):
    truncate(checkpoint / "model-00002-of-00002.safetensors")
    proc = run_isotrain(["ckpt", "verify", str(checkpoint)])
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert "model-00002-of-00002.safetensors" in proc.stderr.splitlines()[0]
    assert run_isotrain(["ckpt", "verify", str(checkpoint.parent / "nowhere")]).returncode == 1


@pytest.mark.slow
def test_list_shows_checkpoints_counters_and_leftovers(fsdp2_run, tmp_path, capsys):
    run_dir = tmp_path / "run"
    shutil.copytree(fsdp2_run, run_dir)
    root = run_dir / "checkpoints"
    shutil.copytree(root / "step-00000004", root / "step-00000006.tmp-0123abcd")
    truncate(root / "step-00000002" / "model-00001-of-00002.safetensors")
    code, out, _ = cli(capsys, "ckpt", "list", str(run_dir))
    assert code == 0
    lines = {line.split()[1]: line for line in out.splitlines() if "step-0" in line}
    state = json.loads((root / "step-00000004" / "train_state" / "state.json").read_text())
    assert f"{state['tokens_seen']:,}" in lines["step-00000004"] and "ok (latest)" in lines["step-00000004"]
    assert "invalid" in lines["step-00000002"] and "model-00001-of-00002.safetensors" in out
    assert "leftover" in lines["step-00000006.tmp-0123abcd"]
    assert cli(capsys, "ckpt", "list", str(root))[1] == out  # the checkpoints/ directory itself works too
    code, _, err = cli(capsys, "ckpt", "list", str(tmp_path))
    assert code == 2 and "holds no checkpoints/ directory" in err


@pytest.mark.slow
def test_inspect_shows_tensors_and_the_layout_saved_from(checkpoint, capsys):
    code, out, _ = cli(capsys, "ckpt", "inspect", str(checkpoint))
    assert code == 0
    assert "checkpoint, step 4, saved from 2 process(es), dp_replicate=1, dp_shard=2" in out
    embed = next(line for line in out.splitlines() if "model.embed_tokens.weight" in line)
    weights = load_file(checkpoint / "model-00001-of-00002.safetensors") | load_file(
        checkpoint / "model-00002-of-00002.safetensors")
    assert str(tuple(weights["model.embed_tokens.weight"].shape)) in embed and "F32" in embed
    assert f"{sum(t.numel() for t in weights.values()):,} parameters" in out
    for state in ("exp_avg", "exp_avg_sq", "step"):
        assert any(line.split()[1:2] == [state] for line in out.splitlines()), state


@pytest.mark.slow
def test_export_writes_a_plain_hf_directory_with_the_trained_weights(checkpoint, tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "exported"
    code, stdout, _ = cli(capsys, "ckpt", "export", str(checkpoint), str(out), "--max-shard-gb", "0.0001")
    assert code == 0 and "-> " in stdout
    assert not (out / "train_state").exists()
    assert cli(capsys, "ckpt", "verify", str(out))[0] == 0
    assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("model-*.safetensors"))) > 2
    saved = model_weights(checkpoint)
    exported = model_weights(out)
    assert saved.keys() == exported.keys()
    assert all(torch.equal(saved[k], exported[k]) for k in saved)
    model = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([[1, 5, 6, 7, 8]])
    reference = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert torch.equal(model(ids).logits, reference(ids).logits)

    small = tmp_path / "small"
    code, stdout, _ = cli(capsys, "ckpt", "export", str(checkpoint), str(small), "--dtype", "bfloat16",
                          "--drop-keys", r"layers\.1\.")
    assert code == 0 and "dropped 9 tensors" in stdout
    halved = model_weights(small)
    assert not any("layers.1." in k for k in halved)
    assert all(halved[k].dtype == torch.bfloat16 and torch.equal(halved[k], saved[k].bfloat16()) for k in halved)
    assert json.loads((small / "config.json").read_text())["dtype"] == "bfloat16"


@pytest.mark.slow
def test_export_refuses_bad_input_and_keeps_what_exists(checkpoint, tmp_path, capsys):
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    cases = [
        ([str(existing)], f"{existing} already exists"),
        ([str(tmp_path / "a"), "--drop-keys", "("], "not a valid regular expression"),
        ([str(tmp_path / "b"), "--drop-keys", "."], "matches every tensor"),
        ([str(tmp_path / "c"), "--max-shard-gb", "0"], "must be positive"),
    ]
    for args, message in cases:
        code, _, err = cli(capsys, "ckpt", "export", str(checkpoint), *args)
        assert code == 2 and message in err and "Traceback" not in err, err
    assert (existing / "keep.txt").read_text() == "mine"
    flip_byte(checkpoint / "model-00002-of-00002.safetensors")
    code, _, err = cli(capsys, "ckpt", "export", str(checkpoint), str(tmp_path / "d"))
    assert code == 2 and "cannot be exported" in err and "model-00002-of-00002.safetensors" in err
    assert not any(p.name.startswith(("a", "b", "c", "d")) for p in tmp_path.iterdir())


@pytest.mark.slow
def test_export_of_a_bf16_run_uses_the_fp32_master_weights(tmp_path, capsys):
    run_dir = tmp_path / "bf16"
    proc = run_isotrain(["train", *TINY, "train.max_steps=2", "model.dtype=bfloat16", f"output_dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    source = run_dir / "checkpoints" / "step-00000002"
    masters = {k.removeprefix("master."): v for k, v in load_file(source / "train_state" / "optimizer.safetensors").items()
               if k.startswith("master.")}
    out = tmp_path / "fp32"
    code, stdout, _ = cli(capsys, "ckpt", "export", str(source), str(out), "--dtype", "float32")
    assert code == 0 and "fp32 master weights" in stdout
    exported = model_weights(out)
    assert exported.keys() == masters.keys()
    assert all(torch.equal(exported[k], masters[k]) for k in masters)
    bf16 = model_weights(source)
    assert any(not torch.equal(exported[k], bf16[k].float()) for k in bf16)  # more than bf16 values widened
