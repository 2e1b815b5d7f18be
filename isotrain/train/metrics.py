"""Metrics rows (metrics.jsonl, optional TensorBoard), the rank-0 progress bar and the MFU estimate."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from isotrain.errors import ConfigError

# Dense bf16 peak TFLOP/s of common accelerators, matched against the CUDA device name.
KNOWN_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0, "L4": 121.0}


def peak_tflops(configured: float | None, device: torch.device) -> float | None:
    if configured is not None:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in KNOWN_PEAK_TFLOPS.items():
            if key in name:
                return value
    return None


def flops_per_token(num_params: int, num_layers: int, hidden_size: int, seq_len: float) -> float:
    """Training FLOPs per token: 6N for the matmuls with weights plus 12·L·d·s for attention scores."""
    return 6.0 * num_params + 12.0 * num_layers * hidden_size * seq_len


class MetricsWriter:
    """One JSON object per logged step; only rank 0 writes.

    A fresh run starts the file anew; a run resumed at step k keeps the rows of steps <= k and
    drops later ones (written after that checkpoint by the interrupted run), so the file reads as
    one uninterrupted run.
    """

    def __init__(self, output_dir: Path, enabled: bool, tensorboard: bool, start_step: int = 0):
        self.enabled = enabled
        self._file = None
        if enabled:
            path = output_dir / "metrics.jsonl"
            kept = rows_up_to(path, start_step) if start_step > 0 else []
            self._file = open(path, "w")
            self._file.writelines(kept)
            self._file.flush()
        self._tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise ConfigError(
                    "logging.tensorboard=true needs TensorBoard; install it with pip install 'isotrain[tensorboard]'"
                ) from None
            self._tb = SummaryWriter(str(output_dir / "tensorboard"))

    def write(self, row: dict) -> None:
        if not self.enabled:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(f"train/{key}", value, row["step"])
            for layer, shares in enumerate(row.get("expert_share", [])):  # MoE: a section per MoE layer
                for expert, share in enumerate(shares):
                    self._tb.add_scalar(f"expert_share_layer_{layer}/expert_{expert}", share, row["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def rows_up_to(path: Path, step: int) -> list[str]:
    """The JSON lines of `path` whose "step" is at most `step` (a line cut short by a kill is left out)."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines(keepends=True):
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a kill
    return kept


def last_logged_step(path: Path) -> int | None:
    """The "step" of the last whole JSON line of `path`, None when it has none (e.g. a run killed before its first
    row)."""
    steps = [json.loads(line)["step"] for line in rows_up_to(path, 2**62)]
    return steps[-1] if steps else None


class ProgressBar:
    """Step, loss, tokens/s and ETA on rank 0; silent elsewhere or when disabled."""

    def __init__(self, total_steps: int, enabled: bool, console: Console, start_step: int = 0):
        self._progress = None
        if not enabled:
            return
        self._progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TextColumn("{task.fields[tok_s]} tok/s"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self._task = self._progress.add_task("train", total=total_steps, completed=start_step, loss="-", tok_s="-")

    def __enter__(self):
        if self._progress is not None:
            self._progress.start()
        return self

    def update(self, completed: int, loss: float, tokens_per_s: float) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, loss=f"{loss:.4f}", tok_s=f"{tokens_per_s:,.0f}")

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.stop()
