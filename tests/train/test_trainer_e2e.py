"""End to end through the real CLI and real processes: files, counters, saved model (multi-node: test_multinode.py)."""

from __future__ import annotations

import functools
import json

import pytest
import torch

from helpers import isotrain_cli, run_concurrently, torchrun
from zygote import run_forked_ranks

SMALL = [
    "model.config.hidden_size=32",
    "model.config.intermediate_size=64",
    "model.config.num_hidden_layers=2",
    "train.global_batch_size=16",
    "train.micro_batch_size=4",
    "train.deterministic=true",
    "logging.progress=false",
]


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def small_data(tmp_path, num_rows: int = 64):
    from isotrain.tasks.arithmetic import addition_rows, write_jsonl

    rows, held_out = addition_rows(max_operand=20, num_eval=20, seed=1)
    write_jsonl(rows[:num_rows], tmp_path / "train.jsonl")
    write_jsonl(held_out, tmp_path / "eval.jsonl")
    return rows[:num_rows], [f"data.path={tmp_path / 'train.jsonl'}", f"eval.path={tmp_path / 'eval.jsonl'}"]


def test_default_recipe_runs_from_the_cli(tmp_path):
    run = tmp_path / "run"
    proc = isotrain_cli(["train", "train.max_steps=20", f"output_dir={run}", "logging.progress=false"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exact-match accuracy on 200 held-out prompts" in proc.stdout
    for name in ("config.yaml", "metrics.jsonl", "model/config.json", "model/model.safetensors", "model/tokenizer.json"):
        assert (run / name).is_file(), name
    rows = metrics(run)
    assert [r["step"] for r in rows] == list(range(1, 21))
    required = {"step", "loss", "lr", "grad_norm", "tokens_seen", "trained_tokens", "samples_seen", "tokens_per_s"}
    assert required <= set(rows[0])
    assert rows[-1]["samples_seen"] == 20 * 64
    assert rows[0]["lr"] > 0


@pytest.fixture(scope="module")
def epoch_runs(tmp_path_factory):
    """One epoch (64 rows, global batch 16, 4 steps) on 1 and on 2 processes: {nproc: (rows, run directory)}.

    The two runs are independent: they run side by side, forked from the zygote (no interpreter start-up; the
    ordinary launches are test_default_recipe_runs_from_the_cli's and the torchrun one below)."""
    runs = {}
    for nproc in (2, 1):
        directory = tmp_path_factory.mktemp(f"epoch-{nproc}")
        rows, data_args = small_data(directory)
        runs[nproc] = (rows, directory / "run", ["train", *SMALL, *data_args, "train.max_steps=4",
                                                 f"output_dir={directory / 'run'}"])
    procs = run_concurrently({nproc: functools.partial(run_forked_ranks, nproc, args)
                              for nproc, (_, _, args) in runs.items()})
    for nproc, proc in procs.items():
        assert proc.returncode == 0, (nproc, proc.stderr[-3000:])
    return {nproc: (rows, run) for nproc, (rows, run, _) in runs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_token_counts_after_one_epoch_equal_dataset_totals(epoch_runs, nproc):
    rows, run = epoch_runs[nproc]
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(run / "tokenizer")
    # bos + prompt + completion + eos are input tokens; completion + eos are the trained targets.
    inputs = sum(2 + len(tok.encode(r["prompt"], add_special_tokens=False))
                 + len(tok.encode(r["completion"], add_special_tokens=False)) for r in rows)
    trained = sum(1 + len(tok.encode(r["completion"], add_special_tokens=False)) for r in rows)
    last = metrics(run)[-1]
    assert (last["tokens_seen"], last["trained_tokens"], last["samples_seen"]) == (inputs, trained, len(rows))


def test_saved_model_loads_in_transformers_with_the_same_logits(tmp_path):
    from transformers import AutoModelForCausalLM

    from isotrain.config import load_config
    from isotrain.recipes.sft import train

    _, data_args = small_data(tmp_path)
    cfg = load_config(None, [*SMALL, *data_args, "train.max_steps=3", f"output_dir={tmp_path / 'run'}"])
    result = train(cfg)
    loaded = AutoModelForCausalLM.from_pretrained(result.model_dir)
    ids = torch.tensor([[1, 5, 9, 7, 12, 3]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, result.model(ids).logits)


def test_one_torchrun_process_joins_a_group_and_shards_with_fsdp2(tmp_path):
    """`torchrun --nproc-per-node 1` runs a many-rank job's code: a process group of one and, with
    parallel.dp_shard=-1, FSDP2 over that rank; the same losses as a plain process, which has no process group."""
    _, data_args = small_data(tmp_path)
    common = [*SMALL, *data_args, "train.max_steps=3", "eval.path=null", "parallel.dp_replicate=1",
              "parallel.dp_shard=-1"]
    runs = run_concurrently({
        "sharded": lambda: torchrun(1, ["-m", "isotrain", "train", *common, f"output_dir={tmp_path / 'sharded'}"]),
        "plain": lambda: isotrain_cli(["train", *common, f"output_dir={tmp_path / 'plain'}"])})
    sharded, plain = runs["sharded"], runs["plain"]
    assert sharded.returncode == 0 and plain.returncode == 0, sharded.stderr[-3000:] + plain.stderr[-3000:]
    assert "device: cpu; process group: gloo, 1 process; FSDP2 over 1 rank(s)" in sharded.stdout
    assert "device: cpu; one process, no process group" in plain.stdout
    for a, b in zip(metrics(tmp_path / "sharded"), metrics(tmp_path / "plain"), strict=True):
        assert a["tokens_seen"] == b["tokens_seen"] and a["trained_tokens"] == b["trained_tokens"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-6)
