"""The one run loop (isotrain/train/run_loop.py) with a fake step: when it writes metrics rows, evaluates,
saves (a real CheckpointManager on a tiny model, real checkpoint directories) and stops on a signal."""

from __future__ import annotations

import gc
import io
import json
import os
import signal

import pytest
import torch
from rich.console import Console

from isotrain.checkpoint.layout import committed
from isotrain.checkpoint.manager import SFT_COUNTERS, CheckpointContract, CheckpointManager
from isotrain.config import build_config
from isotrain.errors import TrainingError
from isotrain.models.build import build_plain
from isotrain.models.tokenizer import train_tokenizer
from isotrain.parallel.dist import DistInfo
from isotrain.train.metrics import MetricsWriter
from isotrain.train.optim import build_optimizer
from isotrain.train.run_loop import LoopSettings, RunState, run_loop

INFO = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
TINY = {"model_type": "llama", "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
        "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 16}


def setup(tmp_path, max_steps: int, log_every: int, every_steps: int):
    cfg = build_config({
        "output_dir": str(tmp_path),
        "model": {"config": TINY},
        "tokenizer": {"type": "char"},
        "train": {"max_steps": max_steps, "log_every": log_every, "global_batch_size": 1, "micro_batch_size": 1},
        "checkpoint": {"every_steps": every_steps, "keep_last": 100},
        "logging": {"progress": True},
        "eval": {"path": None},
    })
    tokenizer = train_tokenizer(["abcdef 0123456789"], "char", cfg.tokenizer.vocab_size)
    model = build_plain(cfg.model, tokenizer, seed=0)
    manager = CheckpointManager(cfg, 0, 1, {"world_size": 1}, model, build_optimizer(model, cfg.train), tokenizer,
                                CheckpointContract(), log=lambda *a: None)
    return cfg, manager


def fake_step(state: RunState, seen: list[int], signal_at: int | None = None) -> dict:
    """Step `state.step`: 10 tokens and 2 samples; sends this process SIGTERM during step `signal_at`."""
    seen.append(state.step)
    if state.step == signal_at:
        os.kill(os.getpid(), signal.SIGTERM)
    state.counters["tokens_seen"] += 10
    state.counters["trained_tokens"] += 5
    state.counters["samples_seen"] += 2
    return {"loss": 1.0 / (state.step + 1), "tokens_per_s": 100.0, "tokens_seen": state.counters["tokens_seen"]}


def run(tmp_path, cfg, manager, state: RunState, **kwargs) -> tuple[RunState, list[dict], str]:
    seen: list[int] = []
    signal_at = kwargs.pop("signal_at", None)
    settings = LoopSettings(cfg.train.max_steps, cfg.train.log_every, cfg.logging.progress, kwargs.pop("eval_every", 0))
    console_text = io.StringIO()
    writer = MetricsWriter(tmp_path, True, False, start_step=state.step)
    try:
        run_loop(settings, INFO, state, lambda s: fake_step(s, seen, signal_at), manager, writer,
                 Console(file=console_text, width=120), **kwargs)
    finally:
        writer.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert seen == list(range(seen[0], seen[0] + len(seen)))  # every step once, in order
    return state, rows, console_text.getvalue()


def saved_steps(manager) -> list[int]:
    return [step for step, _ in committed(manager.root)]


def test_rows_at_log_every_and_the_last_step_and_saves_when_due(tmp_path):
    cfg, manager = setup(tmp_path, max_steps=7, log_every=3, every_steps=2)
    state, rows, shown = run(tmp_path, cfg, manager, RunState(0, {key: 0 for key in SFT_COUNTERS}))
    assert [row["step"] for row in rows] == [3, 6, 7]
    assert rows[-1] == {"step": 7, "loss": 1.0 / 7, "tokens_per_s": 100.0, "tokens_seen": 70}
    assert list(rows[0]) == ["step", "loss", "tokens_per_s", "tokens_seen"]  # step first, then the step's row
    assert saved_steps(manager) == [2, 4, 6, 7]  # every 2 steps and after the last one
    assert (state.step, state.loss, state.stopped_by) == (7, 1.0 / 7, None)
    assert state.counters == {"tokens_seen": 70, "trained_tokens": 35, "samples_seen": 14}
    saved = json.loads((manager.root / "step-00000004" / "train_state" / "state.json").read_text())
    assert {key: saved[key] for key in ("step", *SFT_COUNTERS)} == {"step": 4, "tokens_seen": 40,
                                                                    "trained_tokens": 20, "samples_seen": 8}
    assert "7/7" in shown  # the progress bar reached the end


def test_a_signal_ends_the_loop_after_the_current_step_and_saves(tmp_path):
    cfg, manager = setup(tmp_path, max_steps=10, log_every=1, every_steps=5)
    state, rows, _ = run(tmp_path, cfg, manager, RunState(0, {key: 0 for key in SFT_COUNTERS}), signal_at=2)
    assert (state.step, state.stopped_by) == (3, "SIGTERM")  # step index 2 (the third step) finished
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert saved_steps(manager) == [3]  # not due at 3, saved because the run stops there
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


def test_a_signal_saves_a_checkpoint_even_without_periodic_checkpoints(tmp_path):
    cfg, manager = setup(tmp_path, max_steps=10, log_every=4, every_steps=0)
    state, rows, _ = run(tmp_path, cfg, manager, RunState(0, {key: 0 for key in SFT_COUNTERS}), signal_at=0)
    assert (state.step, state.stopped_by, rows) == (1, "SIGTERM", [])  # step 1 is not a logged step
    assert saved_steps(manager) == [1]  # a stop keeps the work


def test_a_resumed_run_continues_from_its_step_and_evaluates_every_eval_every_but_not_at_the_end(tmp_path):
    cfg, manager = setup(tmp_path, max_steps=8, log_every=2, every_steps=0)
    evaluated = []

    def evaluate(step: int) -> dict:
        evaluated.append(step)
        return {"eval_reward": step / 10}

    start = RunState(4, {"tokens_seen": 40, "trained_tokens": 20, "samples_seen": 8})
    state, rows, _ = run(tmp_path, cfg, manager, start, evaluate=evaluate, eval_every=3)
    assert evaluated == [6]  # 9 would be past the end; the recipe evaluates its final model itself
    assert [(row["step"], row.get("eval_reward")) for row in rows] == [(6, 0.6), (8, None)]
    assert list(rows[0])[-1] == "eval_reward"  # appended after the step's own fields
    assert (state.step, state.counters["tokens_seen"]) == (8, 80)


def test_the_objects_made_before_the_loop_are_frozen_during_its_steps_and_released_after_a_refused_step(tmp_path):
    """Full collections inside steps skip what the set-up made; nothing stays frozen once the loop ends, even
    when a step is refused, so a process that goes on (a test session, a notebook) can collect it again."""
    cfg, manager = setup(tmp_path, max_steps=5, log_every=1, every_steps=0)
    frozen_counts = []

    def step(state: RunState) -> dict:
        frozen_counts.append(gc.get_freeze_count())
        if state.step == 2:
            raise TrainingError("the loss is nan")
        return fake_step(state, [])

    writer = MetricsWriter(tmp_path, True, False)
    with pytest.raises(TrainingError, match="step 3: the loss is nan"):
        run_loop(LoopSettings(5), INFO, RunState(0, {key: 0 for key in SFT_COUNTERS}), step, manager, writer,
                 Console(file=io.StringIO()))
    writer.close()
    assert len(frozen_counts) == 3 and min(frozen_counts) > 1000  # torch's and the model's objects among them
    assert gc.get_freeze_count() == 0
