"""Exact resume after a real SIGKILL (same layout: byte-identical files; pipeline parallel too) and elastic resume
(other world size, DDP <-> FSDP2 <-> TP <-> FSDP2 × TP: same data order, weights within 1e-6)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import torch

from helpers import COUNTED, model_weights, run_concurrently
from zygote import kill_forked_after_commit, run_forked_ranks, run_isotrain
from isotrain.checkpoint.layout import write_latest
from isotrain.checkpoint.manifest import verify_checkpoint

TINY = [
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.num_hidden_layers=2",
    "train.global_batch_size=16",
    "train.max_steps=12",
    "train.deterministic=true",
    "checkpoint.every_steps=4",
    "logging.progress=false",
    "eval.path=null",
]
LAYOUTS = {
    "single": (1, ["train.micro_batch_size=4"]),
    "ddp2": (2, ["train.micro_batch_size=4", "parallel.dp_replicate=2", "parallel.dp_shard=1"]),
    "fsdp2": (2, ["train.micro_batch_size=4", "parallel.dp_replicate=1", "parallel.dp_shard=2"]),
    "fsdp4": (4, ["train.micro_batch_size=4", "parallel.dp_replicate=1", "parallel.dp_shard=4"]),
    "hsdp4": (4, ["train.micro_batch_size=4", "parallel.dp_replicate=2", "parallel.dp_shard=2"]),
    "tp2": (2, ["train.micro_batch_size=4", "parallel.dp_replicate=1", "parallel.tp=2"]),
    "fsdp2tp2": (4, ["train.micro_batch_size=4", "parallel.dp_replicate=1", "parallel.dp_shard=2", "parallel.tp=2"]),
    # Pipeline parallel: 2 stages (untied, and the bundled recipe's tied embeddings: a copy on each end stage), and
    # 2 stages × FSDP2 2.
    "pp2": (2, ["train.micro_batch_size=4", "parallel.pp=2", "model.config.tie_word_embeddings=false"]),
    "pp2tied": (2, ["train.micro_batch_size=4", "parallel.pp=2"]),
    "pp2fsdp2": (4, ["train.micro_batch_size=4", "parallel.pp=2", "parallel.dp_replicate=1", "parallel.dp_shard=2",
                     "model.config.tie_word_embeddings=false"]),
    # MoE models only (tests/checkpoint/test_moe.py): experts split over 2 ranks, dense parts by DDP or FSDP2.
    "ep2": (2, ["train.micro_batch_size=4", "parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.ep=2"]),
    "ep2fsdp2": (2, ["train.micro_batch_size=4", "parallel.dp_replicate=1", "parallel.dp_shard=2", "parallel.ep=2"]),
    # Expert parallel × tensor parallel: EP groups of 2 DP ranks, one per TP coordinate.
    "ep2tp2": (4, ["train.micro_batch_size=4", "parallel.dp_replicate=2", "parallel.dp_shard=1", "parallel.tp=2",
                   "parallel.ep=2"]),
}


def arguments(layout: str, run_dir, *more: str) -> list[str]:
    return ["train", *TINY, *LAYOUTS[layout][1], f"output_dir={run_dir}", *more]


def run(layout: str, run_dir, *more: str) -> subprocess.CompletedProcess:
    """A run to its end, its ranks forked from a process that has done the imports (tests/zygote.py)."""
    proc = run_forked_ranks(LAYOUTS[layout][0], arguments(layout, run_dir, *more))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def tensor_files(checkpoint) -> list[str]:
    return sorted(p.relative_to(checkpoint).as_posix() for p in checkpoint.rglob("*.safetensors"))


def kill_after_checkpoint(layout: str, run_dir, step: int, *more: str) -> None:
    """Start a run (forked ranks) and SIGKILL every one of its processes as soon as checkpoint `step` is committed.
    A run of the ordinary launch (`python -m isotrain`, torchrun) after such kills: tests/checkpoint/test_crash.py."""
    later = kill_forked_after_commit(LAYOUTS[layout][0], arguments(layout, run_dir, *more), run_dir, step)
    assert not (run_dir / "model").exists() or later


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["single", "ddp2", "fsdp2", "tp2", "pp2", "pp2tied", "pp2fsdp2"])
def test_sigkill_then_resume_is_byte_identical(tmp_path, request, layout):
    resumed = tmp_path / "resumed"
    if layout == "fsdp2":  # the uninterrupted run is the module's reference
        straight = request.getfixturevalue("fsdp2_reference")
        kill_after_checkpoint(layout, resumed, 8)
    else:
        straight = tmp_path / "straight"
        # Independent runs: side by side, one per core.
        run_concurrently({"straight": lambda: run(layout, straight),
                          "killed": lambda: kill_after_checkpoint(layout, resumed, 8)})
    proc = run(layout, resumed)
    assert "resumed from" in proc.stdout and "step-00000008" in proc.stdout
    final_a, final_b = straight / "checkpoints" / "step-00000012", resumed / "checkpoints" / "step-00000012"
    assert verify_checkpoint(final_b) == []
    files = tensor_files(final_a)
    assert files == tensor_files(final_b) and any("optimizer" in f for f in files)
    for name in files:
        assert (final_a / name).read_bytes() == (final_b / name).read_bytes(), name
    for name in tensor_files(straight / "model"):
        assert (straight / "model" / name).read_bytes() == (resumed / "model" / name).read_bytes(), name
    rows_a, rows_b = metrics(straight), metrics(resumed)
    assert [r["step"] for r in rows_b] == list(range(1, 13))  # rows of the killed run after step 8 dropped
    assert [[r[k] for k in COUNTED] for r in rows_a[8:]] == [[r[k] for k in COUNTED] for r in rows_b[8:]]


@pytest.fixture(scope="module")
def fsdp2_reference(tmp_path_factory):
    """12 uninterrupted steps on 2 FSDP2 ranks, checkpoints at 4, 8 and 12."""
    run_dir = tmp_path_factory.mktemp("fsdp2") / "run"
    run("fsdp2", run_dir)
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["single", "fsdp4", "ddp2", "hsdp4"])
def test_resume_on_another_layout_continues_the_same_run(tmp_path, fsdp2_reference, layout):
    run_dir = tmp_path / "run"
    shutil.copytree(fsdp2_reference, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000012")
    shutil.rmtree(run_dir / "model")
    write_latest(run_dir / "checkpoints", "step-00000008")
    proc = run(layout, run_dir)
    assert "resumed from" in proc.stdout and "saved on 2 rank(s)" in proc.stdout
    reference, resumed = metrics(fsdp2_reference), metrics(run_dir)
    # The same samples form steps 9-12: their exact token and sample counts match.
    for key in ("tokens_seen", "trained_tokens", "samples_seen", "lr"):
        assert [r[key] for r in reference[8:]] == [r[key] for r in resumed[8:]], key
    for a, b in zip(reference[8:], resumed[8:]):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    expected = model_weights(fsdp2_reference / "checkpoints" / "step-00000012")
    got = model_weights(run_dir / "checkpoints" / "step-00000012")
    assert expected.keys() == got.keys()
    for name in expected:
        scale = expected[name].abs().max().clamp_min(1e-12)
        assert ((got[name] - expected[name]).abs().max() / scale) <= 1e-6, name


def test_load_only_model_starts_a_new_run_from_themodel_weights(tmp_path, fsdp2_reference):
    source = fsdp2_reference / "checkpoints" / "step-00000008"
    run_dir = tmp_path / "fresh"
    proc = run_isotrain(["train", *TINY, "train.micro_batch_size=4", "train.max_steps=2", f"output_dir={run_dir}",
                         f"checkpoint.resume={source}", "checkpoint.load_only=model"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "started from the weights of" in proc.stdout
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["samples_seen"] == 16
    # Trained weights, not a fresh init: the first loss is far below the fresh run's first loss.
    assert rows[0]["loss"] < metrics(fsdp2_reference)[0]["loss"] - 0.2


def test_a_resume_that_changes_the_math_is_refused(tmp_path, fsdp2_reference):
    run_dir = tmp_path / "run"
    shutil.copytree(fsdp2_reference / "checkpoints", run_dir / "checkpoints")
    base = ["train", *TINY, "train.micro_batch_size=4", f"output_dir={run_dir}"]
    proc = run_isotrain([*base, "train.global_batch_size=32"])
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "train.global_batch_size differs from checkpoint" in proc.stderr
    assert "(16 in the checkpoint, 32 now)" in proc.stderr and "checkpoint.allow_changes" in proc.stderr
    proc = run_isotrain([*base, "train.seed=7", "checkpoint.allow_changes=[seed]", "train.max_steps=13"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout


@pytest.mark.slow
def test_async_saves_write_the_same_bytes_as_sync_saves(tmp_path, fsdp2_reference):
    run_dir = tmp_path / "async"
    nproc, extra = LAYOUTS["fsdp2"]
    proc = run_forked_ranks(nproc, ["train", *TINY, *extra, "checkpoint.async=true", f"output_dir={run_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for step in (8, 12):
        a = fsdp2_reference / "checkpoints" / f"step-{step:08d}"
        b = run_dir / "checkpoints" / f"step-{step:08d}"
        assert verify_checkpoint(b) == []
        for name in tensor_files(a):
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_bf16_checkpoints_hold_bf16_weights_and_fp32_masters_and_resume_exactly(tmp_path):
    from safetensors import safe_open

    bf16 = ["train", *TINY, "train.micro_batch_size=8", "model.dtype=bfloat16", "train.max_steps=8"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    proc = run_isotrain([*bf16, f"output_dir={straight}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The straight run as it stood after its checkpoint at step 4 (checkpoint.every_steps=4).
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step-00000008")
    shutil.rmtree(resumed / "model")
    write_latest(resumed / "checkpoints", "step-00000004")
    proc = run_isotrain([*bf16, f"output_dir={resumed}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and "step-00000004" in proc.stdout, proc.stderr[-3000:]
    a, b = straight / "checkpoints" / "step-00000008", resumed / "checkpoints" / "step-00000008"
    for name in tensor_files(a):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    with safe_open(str(a / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    with safe_open(str(a / "train_state" / "optimizer.safetensors"), "pt") as f:
        masters = [k for k in f.keys() if k.startswith("master.")]
        assert masters and {f.get_tensor(k).dtype for k in masters} == {torch.float32}


def test_a_checkpoint_of_another_model_shape_is_refused(tmp_path, fsdp2_reference):
    run_dir = tmp_path / "run"
    shutil.copytree(fsdp2_reference / "checkpoints", run_dir / "checkpoints")
    proc = run_isotrain(["train", *TINY, "train.micro_batch_size=4", "model.config.intermediate_size=96",
                         f"output_dir={run_dir}"])
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "model.layers.0.mlp.gate_proj.weight of shape [128, 64] but the model has [96, 64]" in proc.stderr


# The resharding matrix: a checkpoint saved on each of these layouts resumes on others. Every layout is a source
# and a target; single <-> tp2, single <-> fsdp2tp2 and fsdp2 <-> tp2 both ways (fsdp2 -> single, 4 FSDP2 ranks and
# HSDP: test_resume_on_another_layout_continues_the_same_run).
MATRIX = {"single": ["tp2", "fsdp2tp2"], "fsdp2": ["tp2"], "tp2": ["single", "fsdp2"], "fsdp2tp2": ["single"]}
SHORT = ["train.max_steps=6", "checkpoint.every_steps=3"]


@pytest.fixture(scope="module")
def saved_on(tmp_path_factory):
    """saved_on(layout): a 6-step run on that layout, checkpoints at 3 and 6, run once per module."""
    done = {}

    def get(layout: str):
        if layout not in done:
            run_dir = tmp_path_factory.mktemp(layout) / "run"
            run(layout, run_dir, *SHORT)
            done[layout] = run_dir
        return done[layout]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("source", MATRIX)
def test_checkpoint_resumes_on_other_layouts(tmp_path, saved_on, source):
    """Save on `source`, resume step 3 on its target layouts: the same samples form steps 4-6 (exact counts),
    the losses agree and the final weights are those of the uninterrupted run (fp32, 1e-6)."""
    reference = saved_on(source)
    expected = model_weights(reference / "checkpoints" / "step-00000006")
    for target in MATRIX[source]:
        run_dir = tmp_path / target / "run"
        shutil.copytree(reference, run_dir)
        shutil.rmtree(run_dir / "checkpoints" / "step-00000006")
        shutil.rmtree(run_dir / "model")
        write_latest(run_dir / "checkpoints", "step-00000003")
        proc = run(target, run_dir, *SHORT)
        assert "resumed from" in proc.stdout and "step-00000003" in proc.stdout, target
        for key in ("tokens_seen", "trained_tokens", "samples_seen", "lr"):
            assert [r[key] for r in metrics(reference)[3:]] == [r[key] for r in metrics(run_dir)[3:]], (target, key)
        for a, b in zip(metrics(reference)[3:], metrics(run_dir)[3:]):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), target
        got = model_weights(run_dir / "checkpoints" / "step-00000006")
        assert expected.keys() == got.keys(), target
        for name in expected:
            scale = expected[name].abs().max().clamp_min(1e-12)
            assert ((got[name] - expected[name]).abs().max() / scale) <= 1e-6, (target, name)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "fsdp2tp2"])
def test_tensor_parallel_model_directory_loads_in_plain_transformers(saved_on, layout):
    """The final model of a TP run is a Hugging Face directory: from_pretrained alone loads it, and its
    weights and logits are the single-process run's (the same math on another layout)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(saved_on(layout) / "model", dtype=torch.float32)
    single = AutoModelForCausalLM.from_pretrained(saved_on("single") / "model", dtype=torch.float32)
    for (name, a), (_, b) in zip(model.state_dict().items(), single.state_dict().items(), strict=True):
        assert ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)) <= 1e-6, name
    ids = torch.tensor([[1, 5, 7, 3, 9, 2]])
    assert torch.allclose(model(ids).logits, single(ids).logits, rtol=1e-5, atol=1e-6)
