"""What a run sets up before its first step (isotrain/train/setup.py)."""

from __future__ import annotations

import os

import torch

from isotrain.train.setup import seed_everything


def test_deterministic_mode_fixes_the_cublas_workspace(monkeypatch):
    """Without CUBLAS_WORKSPACE_CONFIG, deterministic CUDA matmuls raise (seen on the first GPU run); a user's own
    setting is kept."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    try:
        seed_everything(0, deterministic=True)
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
        seed_everything(0, deterministic=True)
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    finally:
        torch.use_deterministic_algorithms(False)
