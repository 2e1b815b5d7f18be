"""Routing statistics of one forward, from the router logits the model returns (`output_router_logits=True`).

transformers returns one [tokens, E] logits tensor per MoE layer (tokens = B·L, row-major), before the softmax.
Every family we train routes a token to the top-k experts of softmax(logits in fp32) (Qwen2/3-MoE, Mixtral),
so the counts below recompute exactly the model's selection. Only input tokens count: padding rows
(segment id -1) are excluded; in a packed row every real token of every document is routed and counted.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def input_token_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """bool [B·L]: the positions that hold a real token (collate pads with segment id -1)."""
    return segment_ids.reshape(-1) >= 0


def layer_logits(router_logits) -> list[torch.Tensor]:
    """The per-layer router logits as plain [tokens, E] tensors (a DTensor, e.g. under TP, is gathered)."""
    return [t.full_tensor() if isinstance(t, DTensor) else t for t in router_logits]


def router_probs(logits: torch.Tensor) -> torch.Tensor:
    """softmax over experts in fp32 (at least), as the routers compute it."""
    return torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)


def routing_counts(logits: list[torch.Tensor], top_k: int, mask: torch.Tensor) -> torch.Tensor:
    """int64 [num_layers, E]: C_le = number of input tokens layer l sends to expert e (Σ_e C_le = k · #tokens).

    A one-hot sum rather than scatter_add/bincount: integer, exact and deterministic on every device; built by
    comparison, not F.one_hot, whose index check syncs with the host on CUDA. Without gradient: the counts
    have none, so the probabilities need not be saved for a backward."""
    with torch.no_grad():
        return _routing_counts(logits, top_k, mask)


def _routing_counts(logits: list[torch.Tensor], top_k: int, mask: torch.Tensor) -> torch.Tensor:
    rows = []
    for layer in logits:
        chosen = torch.topk(router_probs(layer), top_k, dim=-1).indices  # [T, k]
        experts = torch.arange(layer.shape[-1], device=chosen.device)
        one_hot = (chosen.unsqueeze(-1) == experts).sum(1)  # [T, E], 0/1 per expert (top-k indices are distinct)
        rows.append((one_hot * mask.unsqueeze(-1)).sum(0))
    return torch.stack(rows).to(torch.int64)


def prob_sums(logits: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """fp32 [num_layers, E] with gradient: S_le = Σ_{input tokens t} p_le(t), the summed router probabilities."""
    return torch.stack([(router_probs(layer) * mask.unsqueeze(-1)).sum(0) for layer in logits])


def z_sum(logits: list[torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
    """Scalar (fp32 at least) with gradient: Σ_l Σ_{input tokens t} logsumexp(logits_l(t))², the router
    z-loss numerator."""
    total = 0
    for layer in logits:
        lse = torch.logsumexp(layer.to(torch.promote_types(layer.dtype, torch.float32)), dim=-1)
        total = total + (lse.square() * mask).sum()
    return total
