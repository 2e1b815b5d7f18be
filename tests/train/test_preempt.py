"""Preemption: SIGTERM to every rank (what Slurm sends) saves at the next step boundary, even with
checkpoint.every_steps=0, exits 0, and the job started again resumes exactly (issue #32, invariant 4).

The signal is sent by a start-up hook inside each rank at the start of a chosen step (signal_worker.py), never by
a test racing the run: the step in progress ends, its checkpoint is saved (an async save is completed) and the run
stops. The resumed run's metrics and final weights are byte-identical to a run never stopped, for the train
recipe on 2 processes (FSDP2, async save), and for RL and embedding training on one process. A step that ends
past checkpoint.preempt_grace_s after the signal stops the run without a save, in one sentence: the hook holds
that step for longer than the grace, so the outcome does not depend on the machine's speed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from helpers import COUNTED, TINY_RUN
from isotrain.checkpoint.layout import committed
from zygote import run_forked_ranks, run_isotrain

WORKER = Path(__file__).with_name("signal_worker.py")
SFT = ["train", *TINY_RUN, "train.deterministic=true", "train.max_steps=6", "checkpoint.every_steps=0"]
RL = ["rl", "model.name_or_path=null", "model.config.model_type=llama", "model.config.hidden_size=32",
      "model.config.intermediate_size=64", "model.config.num_hidden_layers=2", "model.config.num_attention_heads=4",
      "model.config.num_key_value_heads=2", "tokenizer.type=char", "rl.prompts_per_step=4", "rl.group_size=4",
      "train.micro_batch_size=8", "train.max_steps=4", "train.deterministic=true", "eval.path=null",
      "logging.progress=false", "checkpoint.every_steps=0"]
BERT = ["embed", "model.config.model_type=bert", "model.config.hidden_size=32", "model.config.num_hidden_layers=2",
        "model.config.num_attention_heads=2", "model.config.intermediate_size=64",
        "model.config.max_position_embeddings=64", "tokenizer.vocab_size=300", "data.max_seq_len=32", "eval.path=null",
        "train.global_batch_size=8", "train.max_steps=4", "train.deterministic=true", "embed.hard_negatives=1",
        "logging.progress=false", "checkpoint.every_steps=0"]
FSDP2 = ["parallel.dp_replicate=1", "parallel.dp_shard=2"]


def signalled(monkeypatch, nproc: int, args: list[str], step: int, ranks: str, hold_s: float = 0.0):
    """`isotrain args` on `nproc` ranks, each rank in `ranks` sending itself SIGTERM at the start of `step`."""
    for name, value in (("SIGNAL", "SIGTERM"), ("SIGNAL_STEP", step), ("SIGNAL_RANKS", ranks),
                        ("SIGNAL_HOLD_S", hold_s)):
        monkeypatch.setenv(f"ISOTRAIN_TEST_{name}", str(value))
    return run_forked_ranks(nproc, args, script=WORKER)


def finished(nproc: int, args: list[str]):
    proc = run_forked_ranks(nproc, args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def check_saved_and_resumed(monkeypatch, nproc: int, args: list[str], tmp_path, step: int, ranks: str,
                            keys=COUNTED) -> None:
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    finished(nproc, [*args, f"output_dir={straight}"])
    proc = signalled(monkeypatch, nproc, [*args, f"output_dir={stopped}"], step, ranks)
    assert proc.returncode == 0, proc.stderr[-3000:]
    checkpoint = stopped / "checkpoints" / f"step-{step:08d}"
    assert (f"SIGTERM received: stopped after step {step}; checkpoint {checkpoint} saved (a Hugging Face model "
            "directory; no final model/ is written); run again to resume") in proc.stdout, proc.stdout[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    assert [path for _, path in committed(stopped / "checkpoints")] == [checkpoint]
    verified = run_isotrain(["ckpt", "verify", str(checkpoint)])
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert not (stopped / "model").exists()
    progress = json.loads((stopped / "progress" / "rank-00000.json").read_text())
    assert (progress["step"], progress["state"]) == (step, "stopped by SIGTERM")

    resumed = finished(nproc, [*args, f"output_dir={stopped}"])
    assert f"at step {step}" in resumed.stdout
    assert rows(stopped, keys) == rows(straight, keys)
    names = sorted(path.name for path in (straight / "model").glob("*.safetensors"))
    assert names == sorted(path.name for path in (stopped / "model").glob("*.safetensors")) and names
    for name in names:
        assert (stopped / "model" / name).read_bytes() == (straight / "model" / name).read_bytes(), name


def rows(run_dir: Path, keys) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{key: row[key] for key in keys if key in row} for row in map(json.loads, lines)]


def test_sigterm_to_both_ranks_of_an_fsdp2_run_completes_an_async_save_and_the_resume_is_exact(monkeypatch, tmp_path):
    args = [*SFT, *FSDP2, "checkpoint.async=true", "checkpoint.preempt_grace_s=3600",
            f"data.cache_dir={tmp_path / 'cache'}"]
    check_saved_and_resumed(monkeypatch, 2, args, tmp_path, step=3, ranks="0,1")


@pytest.mark.slow
def test_rl_sigterm_saves_and_the_resume_is_exact(monkeypatch, tmp_path):
    keys = (*COUNTED, "reward_mean", "kl", "entropy", "optimizer_steps")
    check_saved_and_resumed(monkeypatch, 1, RL, tmp_path, step=2, ranks="0", keys=keys)


def test_embed_sigterm_saves_and_the_resume_is_exact(monkeypatch, tmp_path):
    rng = random.Random(0)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma".split()
    lines = []
    for _ in range(32):
        topic = rng.sample(words, 3)
        lines.append(json.dumps({"query": " ".join(topic), "positive": " ".join(topic + rng.sample(words, 4)),
                                 "negatives": [" ".join(rng.sample(words, 6))]}))
    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(lines) + "\n")
    keys = ("step", "loss", "lr", "grad_norm", "samples_seen")
    check_saved_and_resumed(monkeypatch, 1, [*BERT, f"data.path={data}"], tmp_path, step=2, ranks="0", keys=keys)


def test_a_step_that_ends_past_the_grace_stops_without_a_save_in_one_sentence(monkeypatch, tmp_path):
    run_dir = tmp_path / "run"
    args = [*SFT, "checkpoint.every_steps=1", "checkpoint.preempt_grace_s=1", f"output_dir={run_dir}",
            f"data.cache_dir={tmp_path / 'cache'}"]
    proc = signalled(monkeypatch, 1, args, step=2, ranks="0", hold_s=2)  # step 2 ends 2 s or more after SIGTERM
    assert proc.returncode == 2, proc.stderr[-3000:]
    step_1 = run_dir / "checkpoints" / "step-00000001"
    assert proc.stderr.strip() == (
        "error: SIGTERM received, but step 2 ended more than checkpoint.preempt_grace_s=1 s later: stopped without "
        f"saving (the scheduler's kill could cut a save short); the next run resumes from {step_1}; raise "
        "checkpoint.preempt_grace_s or have the scheduler signal earlier (Slurm: --signal=TERM@SECONDS)")
    assert [path for _, path in committed(run_dir / "checkpoints")] == [step_1]
