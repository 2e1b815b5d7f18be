"""Experts laid out as expert parallelism lays them out (DTensor Shard(0) over an "ep" mesh axis) go through the
generic save and load path: saved per expert under global ids, each rank writing the experts it holds, and
loaded back from or into one process. Real processes on gloo (ep_worker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import model_weights
from zygote import run_forked_ranks
from isotrain.checkpoint.load import CheckpointReader, load_model, load_optimizer

WORKER = str(Path(__file__).with_name("ep_worker.py"))


def optimizer_state(directory: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted((directory / "train_state").glob("optimizer*.safetensors")):
        tensors.update(load_file(path))
    return tensors


@pytest.mark.slow
def test_expert_parallel_experts_save_under_global_ids_and_load_on_any_layout(tmp_path):
    from ep_worker import reference, save_as

    model, optimizer = reference()
    save_as(tmp_path, "single", model, optimizer, rank=0, world=1)
    model.save_pretrained(tmp_path / "hf")
    proc = run_forked_ranks(2, ["save", str(tmp_path)], script=WORKER)
    assert proc.returncode == 0, proc.stderr[-3000:]

    ep2, expected = model_weights(tmp_path / "ep2"), load_file(tmp_path / "hf" / "model.safetensors")
    assert ep2.keys() == expected.keys() and all(torch.equal(ep2[k], expected[k]) for k in expected)
    state, single_state = optimizer_state(tmp_path / "ep2"), optimizer_state(tmp_path / "single")
    assert "exp_avg.model.layers.1.mlp.experts.3.down_proj.weight" in state
    assert state.keys() == single_state.keys() and all(torch.equal(state[k], single_state[k]) for k in state)
    weight_map = json.loads((tmp_path / "ep2" / "model.safetensors.index.json").read_text())["weight_map"]
    low = {weight_map[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] for e in (0, 1)}
    high = {weight_map[f"model.layers.0.mlp.experts.{e}.gate_proj.weight"] for e in (2, 3)}
    assert len(low) == len(high) == 1 and low != high  # each rank wrote the experts it holds

    proc = run_forked_ranks(2, ["load", str(tmp_path)], script=WORKER)
    assert proc.returncode == 0, proc.stderr[-3000:]

    from ep_worker import tiny_moe

    fresh = tiny_moe(1)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.1, foreach=False)
    reader = CheckpointReader(tmp_path / "ep2")
    try:
        load_model(reader, fresh, 0)
        load_optimizer(reader, fresh, fresh_optimizer, 0)
    finally:
        reader.close()
    for (name, got), want in zip(fresh.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(got, want), name
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(fresh_optimizer.state[got][key], optimizer.state[want][key]), (name, key)


def test_experts_held_as_a_local_slice_are_refused_rather_than_renumbered():
    """A rank's experts as a plain local tensor (2 of 4) would be saved as experts 0-1 by every rank; refused."""
    from torch import nn

    from ep_worker import tiny_moe
    from isotrain.errors import CheckpointError
    from isotrain.checkpoint.state import collect_items

    model = tiny_moe(0)
    experts = model.model.layers[1].mlp.experts
    experts.down_proj = nn.Parameter(experts.down_proj.detach()[2:].clone())
    with pytest.raises(CheckpointError, match=r"^model\.layers\.1\.mlp\.experts\.down_proj holds 2 experts but "
                                              r"the model has 4; experts split over ranks must be DTensors"):
        collect_items(model, torch.optim.AdamW(model.parameters()), torch.float32)
