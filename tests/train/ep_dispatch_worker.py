"""The expert-parallel experts forward against transformers' own, one MoE layer, under skewed routing.

Launched by test_expert_parallel.py with torchrun (every rank of the world is one EP group):
    ep_dispatch_worker.py OUT.json
Every rank draws the same full inputs (seeded): tokens of all ranks, their routing, the output gradient.
The reference is transformers' experts forward (per-expert loop) on all ranks' tokens with all experts in
fp64; the EP module runs each rank's own tokens on its own experts. Compared: each rank's output rows, the
gradient of its input rows and routing weights, and the expert gradients (gathered whole). Scenarios:
`random` routing, `skewed` (every token of every rank picks experts 0 and 1: the other ranks' experts get
no rows at all, and one rank receives everything) and `uneven` (ranks with different token counts).
"""

from __future__ import annotations

import json
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from transformers import AutoConfig, AutoModelForCausalLM

from isotrain.parallel.dist import init_distributed, shutdown_distributed
from isotrain.parallel.ep import ExpertParallelExperts

EXPERTS, TOP_K, HIDDEN = 4, 2, 16


def experts_module():
    config = AutoConfig.for_model("qwen3_moe", hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2, vocab_size=32, num_experts=EXPERTS,
                                  num_experts_per_tok=TOP_K, moe_intermediate_size=8, decoder_sparse_step=1,
                                  mlp_only_layers=[])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, experts_implementation="eager").double()
    return model.model.layers[0].mlp.experts


def inputs(scenario: str, world: int):
    """Per rank: (hidden [T, H], top_k_index [T, k], top_k_weights [T, k], output gradient [T, H])."""
    generator = torch.Generator().manual_seed(1)
    counts = [5 + 3 * r for r in range(world)] if scenario == "uneven" else [6] * world
    per_rank = []
    for tokens in counts:
        hidden = torch.randn(tokens, HIDDEN, generator=generator, dtype=torch.float64)
        if scenario == "skewed":
            index = torch.tensor([[1, 0]] * tokens)
        else:
            index = torch.stack([torch.randperm(EXPERTS, generator=generator)[:TOP_K] for _ in range(tokens)])
        weights = torch.rand(tokens, TOP_K, generator=generator, dtype=torch.float64)
        per_rank.append((hidden, index, weights, torch.randn(tokens, HIDDEN, generator=generator, dtype=torch.float64)))
    return per_rank


def grads_of(module, hidden, index, weights, out_grad):
    hidden, weights = hidden.clone().requires_grad_(), weights.clone().requires_grad_()
    out = module(hidden, index, weights)
    out.backward(out_grad)
    return out.detach(), hidden.grad, weights.grad


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def main(out_path: str) -> None:
    info = init_distributed()
    mesh = init_device_mesh("cpu", (1, info.world_size), mesh_dim_names=("ep_replicate", "ep"))
    worst = {}
    for scenario in ("random", "skewed", "uneven"):
        data = inputs(scenario, info.world_size)
        reference = experts_module()
        ref_out, ref_hidden_grad, ref_weight_grad = grads_of(
            reference, *(torch.cat([rank[i] for rank in data]) for i in range(4)))
        ep = ExpertParallelExperts(experts_module(), mesh["ep"])
        out, hidden_grad, weight_grad = grads_of(ep, *data[info.rank])
        rows = slice(sum(len(rank[0]) for rank in data[:info.rank]), sum(len(rank[0]) for rank in data[:info.rank + 1]))
        worst[scenario] = max(
            rel(out, ref_out[rows]), rel(hidden_grad, ref_hidden_grad[rows]), rel(weight_grad, ref_weight_grad[rows]),
            *(rel(getattr(ep, key).grad.full_tensor(), getattr(reference, key).grad)
              for key in ("gate_up_proj", "down_proj")))
        worst[f"{scenario}_local_experts"] = ep.gate_up_proj.to_local().shape[0]
    gathered = [None] * info.world_size
    torch.distributed.all_gather_object(gathered, worst)
    if info.is_main:
        with open(out_path, "w") as f:
            json.dump(gathered, f)
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
