"""Invariant 3 with a weighted mixture of 3 sources, through the real CLI and real processes: 1 process, DDP 2 and
FSDP2 2 learn from the same global batches, and an FSDP2 run SIGKILLed after checkpoint 6 and resumed on 1 process
continues with exactly the next batches. Shown three ways at every step: the samples and source rows every rank
wrote that it trained (`data.log_samples`), together, are the global batch that data/mixture.py assigns to the
step; the losses and gradient norms agree (1e-5); the token, sample and per-source counts are exact and equal."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from helpers import kill_after_commit, run_concurrently
from zygote import run_forked_ranks

STEPS = 9  # 8 steps per mixture epoch of 64 samples: the run crosses into mixture epoch 1
SIZES = {"small": 9, "large": 40, "mid": 15}  # weights 1, 1, 3: 13, 13 and 38 samples per mixture epoch
WEIGHTS = {"small": 1, "large": 1, "mid": 3}
LAYOUTS = {
    "single": (1, []),
    "ddp2": (2, ["parallel.dp_replicate=2", "parallel.dp_shard=1"]),
    "fsdp2": (2, ["parallel.dp_replicate=1", "parallel.dp_shard=2"]),
}


def overrides(data_dir) -> list[str]:
    sources = ", ".join(f"{{path: {data_dir / name}.jsonl, weight: {WEIGHTS[name]}}}" for name in SIZES)
    return [f"data.sources=[{sources}]", "data.format=text", "data.max_seq_len=16", f"data.cache_dir={data_dir / 'cache'}",
            "model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=2",
            "train.global_batch_size=8", "train.micro_batch_size=4", f"train.max_steps={STEPS}",
            "train.deterministic=true", "checkpoint.every_steps=3", "logging.progress=false", "eval.path=null",
            "data.log_samples=true"]


def arguments(layout: str, data_dir, run_dir) -> list[str]:
    return ["train", *overrides(data_dir), *LAYOUTS[layout][1], f"output_dir={run_dir}"]


def run(layout: str, data_dir, run_dir):
    proc = run_forked_ranks(LAYOUTS[layout][0], arguments(layout, data_dir, run_dir))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def killed_after(step: int, layout: str, data_dir, run_dir) -> None:
    """The ordinary torchrun launch, SIGKILLed as soon as checkpoint `step` is committed."""
    nproc = LAYOUTS[layout][0]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "isotrain", *arguments(layout, data_dir, run_dir)]
    kill_after_commit(cmd, run_dir, step)
    assert not (run_dir / "model").exists()


def trained_samples(run_dir) -> dict[int, list]:
    """Step -> the (sample index, source rows) that the run's ranks, together, wrote they trained at that step."""
    by_step: dict[int, list] = {}
    for path in sorted((run_dir / "samples").glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            by_step.setdefault(row["step"], []).extend((index, tuple(rows)) for index, rows in row["samples"])
    return {step: sorted(samples) for step, samples in by_step.items()}


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixture")
    for name, size in SIZES.items():
        rows = [{"text": f"{name} {i}{'0' * (i % 3)}"} for i in range(size)]  # one sample each, 6-12 tokens
        (root / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    dirs = {name: root / name for name in ("single", "ddp2", "fsdp2-then-single")}
    run("single", root, dirs["single"])  # builds the cache entries the others read
    procs = run_concurrently({"killed": lambda: killed_after(6, "fsdp2", root, dirs["fsdp2-then-single"]),
                              "ddp2": lambda: run("ddp2", root, dirs["ddp2"])})
    resumed = run("single", root, dirs["fsdp2-then-single"])
    return root, dirs, procs["ddp2"], resumed


@pytest.mark.slow
def test_a_weighted_mixture_gives_the_same_batches_on_every_layout_and_after_a_sigkill(runs):
    root, dirs, _, resumed = runs
    assert "resumed from" in resumed.stdout and "step-00000006" in resumed.stdout
    assert "saved on 2 rank(s), now 1" in resumed.stdout
    assert "mixture of 3 sources; a mixture epoch holds 64 samples" in resumed.stdout
    reference = metrics(dirs["single"])
    assert [row["step"] for row in reference] == list(range(1, STEPS + 1))
    exact = ["step", "tokens_seen", "trained_tokens", "samples_seen", "lr",
             *[key for key in reference[0] if key.startswith("source/")]]
    assert len(exact) == 5 + 4 * 3
    for name in ("ddp2", "fsdp2-then-single"):
        rows = metrics(dirs[name])
        assert [[row[key] for key in exact] for row in rows] == [[row[key] for key in exact] for row in reference]
        for got, expected in zip(rows, reference, strict=True):
            assert got["loss"] == pytest.approx(expected["loss"], rel=1e-5), (name, got["step"])
            assert got["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5), (name, got["step"])
    # What the ranks measured (tokens_seen: all-reduced from the collated micro-batches) is, step by step, the
    # tokens of the samples that the pure mixture rule puts into that step's global batch.
    mixture, sampler = _rebuilt(root, dirs["single"])
    planned = {step + 1: sorted((int(i), mixture[int(i)].row_ids) for i in sampler.global_batch(step))
               for step in range(STEPS)}
    for name in dirs:
        assert trained_samples(dirs[name]) == planned, name
    assert sorted((dirs["fsdp2-then-single"] / "samples").iterdir())[-1].name == "rank-00001.jsonl"
    for counter, per_sample in (("tokens_seen", mixture.input_tokens), ("trained_tokens", mixture.trained_tokens)):
        measured = np.diff([0] + [row[counter] for row in reference])
        planned = [int(per_sample[sampler.global_batch(step)].sum()) for step in range(STEPS)]
        assert measured.tolist() == planned, counter
    last = reference[-1]
    counts = mixture.counts.tolist()
    assert counts == [13, 13, 38]
    epoch_0 = mixture.tally(mixture.epoch_table(0))[0].tolist()  # 8 whole steps = mixture epoch 0
    assert [reference[7][f"source/{name}/samples_seen"] for name in SIZES] == epoch_0 == counts
    assert reference[7]["tokens_seen"] == mixture.stats.total_input_tokens
    assert reference[7]["trained_tokens"] == mixture.stats.total_trained_tokens
    assert last["source/small/epochs"] == last["source/small/samples_seen"] / SIZES["small"] > 1  # repeated


def _rebuilt(data_dir, run_dir):
    """The run's mixture and sampler, rebuilt here from the run's tokenizer and the cache entries."""
    from isotrain.config import load_config
    from isotrain.data.mixture import prepare_mixture
    from isotrain.data.sampler import GlobalBatchSampler
    from isotrain.models.tokenizer import load_tokenizer

    cfg = load_config(None, overrides(data_dir))
    mixture = prepare_mixture(cfg.data, load_tokenizer(str(run_dir / "tokenizer")), cfg.train.seed,
                               cfg.train.global_batch_size, log=lambda *_: None)
    return mixture, GlobalBatchSampler(mixture.epoch_samples, 8, cfg.train.seed, epoch_table=mixture.epoch_table)
