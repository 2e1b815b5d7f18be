"""Mixture-of-experts layers in the fake forward: what their experts keep for backward, without real routing.

Two things stop the MoE layers' own code from running on fake tensors:

- transformers' default experts path (`grouped_mm`) is shape-static (every (token, slot) pair is one row, so
  what it saves does not depend on the routing), but torch's fake kernel of grouped_mm takes only bf16 while
  the CPU kernel also takes fp32: `grouped_mm_as_saved` stands in for it with the same output shape and the
  same saved tensors (GroupedMmBackward0 saves the input, the weight and the offsets);
- expert parallelism (parallel/ep.py) sizes its all-to-alls from the routing counts, which a fake forward
  cannot know: `BalancedExpertParallel` runs the same dispatch and the same per-expert code
  (`local_experts_forward`) under **balanced routing**: every expert gets tokens × top_k / E of each rank's
  (token, slot) pairs, so each rank receives as many rows as it sends. Skewed routing makes the busiest rank
  receive more (up to ep × as many rows for the experts' activations).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from isotrain.parallel.ep import EXPERT_PARAMS, local_experts_forward, expert_modules


class _GroupedMm(torch.autograd.Function):
    """torch's grouped_mm as autograd sees it: output [rows, weight's last dim]; saves input, weight, offsets."""

    @staticmethod
    def forward(ctx, input, weight, offs):
        ctx.save_for_backward(input, weight, offs)
        return input.new_empty(input.shape[0], weight.shape[-1])

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover - the fake forward never runs a backward
        raise NotImplementedError


@contextlib.contextmanager
def grouped_mm_as_saved():
    import transformers.integrations.moe as moe

    original = moe._grouped_mm
    moe._grouped_mm = lambda input, weight, offs: _GroupedMm.apply(input.to(weight.dtype), weight, offs)
    try:
        yield
    finally:
        moe._grouped_mm = original


class _Exchange(torch.autograd.Function):
    """The all-to-all's shape (`rows` rows out; saves nothing, as the functional collective's autograd)."""

    @staticmethod
    def forward(ctx, tensor, rows: int):
        return tensor.new_empty(rows, *tensor.shape[1:])

    @staticmethod
    def backward(ctx, grad):  # pragma: no cover
        raise NotImplementedError


def balanced_counts(pairs: int, num_experts: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(sent[r][e], received[s][e]) of rank 0 when each rank sends its `pairs` rows evenly over the experts
    (the first experts get one more when E does not divide them); every rank routes alike."""
    local = num_experts // ep
    per_expert = [pairs // num_experts + (1 if e < pairs % num_experts else 0) for e in range(num_experts)]
    sent = [per_expert[r * local:(r + 1) * local] for r in range(ep)]
    return sent, [list(sent[0]) for _ in range(ep)]


class BalancedExpertParallel(nn.Module):
    """Rank 0 of an EP group of `ep` ranks: E/ep fp32 experts (EP leaves them out of FSDP2's cast), the
    dispatch and combine of parallel/ep.py `expert_parallel_forward`, counts from `balanced_counts`."""

    def __init__(self, experts: nn.Module, ep: int):
        super().__init__()
        self.num_experts = experts.gate_up_proj.shape[0]
        self.ep = ep
        self.act_fn = experts.act_fn
        for key in EXPERT_PARAMS:
            full = getattr(experts, key)
            local = torch.empty(self.num_experts // ep, *full.shape[1:], dtype=torch.float32, device=full.device)
            self.register_parameter(key, nn.Parameter(local))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        gate_up, down = (getattr(self, key).to(hidden_states.dtype) for key in EXPERT_PARAMS)
        top_k = top_k_index.shape[-1]
        order = torch.argsort(top_k_index.reshape(-1), stable=True)
        sent, received = balanced_counts(order.shape[0], self.num_experts, self.ep)
        tokens = hidden_states[order // top_k]
        arrived = _Exchange.apply(tokens, sum(map(sum, received)))
        by_expert = torch.argsort(torch.zeros(arrived.shape[0], dtype=torch.long), stable=True)
        per_expert = [sum(row[e] for row in received) for e in range(self.num_experts // self.ep)]
        computed = local_experts_forward(arrived[by_expert], per_expert, gate_up, down, self.act_fn)
        results = torch.empty_like(computed).index_copy(0, by_expert, computed)
        returned = _Exchange.apply(results, sum(map(sum, sent)))
        weighted = returned * top_k_weights.reshape(-1)[order, None]
        return torch.zeros_like(hidden_states).index_add_(0, order // top_k, weighted.to(hidden_states.dtype))


def balance_expert_parallel(model: nn.Module, ep: int) -> None:
    """Replace every fused-experts module of the fake `model` by rank 0's balanced expert-parallel form."""
    for name, module in expert_modules(model).items():
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, BalancedExpertParallel(module, ep))
