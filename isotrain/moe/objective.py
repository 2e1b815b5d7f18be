"""The router terms of one optimizer step: what each micro-batch adds to the objective, and what the step logs.

    objective = CE + aux_loss_coef · aux + z_loss_coef · z            (aux, z: aux_loss.py)

A `RouterStep` is made per optimizer step. With `global` scope it holds the global routing counts before the
first backward: from the routing pre-pass (prepass.py) when a rank has several micro-batches, else they are
all-reduced over DP right after the rank's one forward. Each micro-batch's term is then its exact share of the
global aux / z, so the summed gradient is the same for any split. It also keeps, on the device, the values the
step logs (aux, z, the counts for the load metrics) and a routing-mismatch count, fetched with the step's other
values in its one host sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from isotrain.errors import TrainingError
from isotrain.moe.aux_loss import aux_loss_part, z_loss_part
from isotrain.moe.routing import layer_logits, prob_sums, routing_counts, z_sum
from isotrain.moe.settings import RouterSettings
from isotrain.parallel.dist import all_reduce_sum


@dataclass
class RouterStep:
    settings: RouterSettings
    num_micro_batches: int  # this rank's; every DP rank has as many
    group: object = None  # the DP group the counts are summed over
    # Global scope with a pre-pass: the global counts [L, E], tokens, and each local micro-batch's own counts.
    global_counts: torch.Tensor | None = None
    global_tokens: torch.Tensor | None = None
    expected_counts: list[torch.Tensor] = field(default_factory=list)
    # What the step logs, summed over this rank's micro-batches (all-reduced by the step).
    _aux: torch.Tensor | None = None
    _z: torch.Tensor | None = None
    _counts: torch.Tensor | None = None
    _mismatch: torch.Tensor | None = None

    def term(self, router_logits, mask: torch.Tensor, index: int) -> torch.Tensor:
        """The router terms of micro-batch `index` (coef-weighted, globally normalised; a scalar with gradient)."""
        logits = layer_logits(router_logits)
        counts = routing_counts(logits, self.settings.top_k, mask)
        tokens = mask.sum()
        pool_counts, pool_tokens, share = self._pool(counts, tokens, index)
        aux = aux_loss_part(pool_counts, prob_sums(logits, mask), pool_tokens, self.settings.num_experts) * share
        z = z_loss_part(z_sum(logits, mask), pool_tokens, len(logits)) * share
        self._record(aux.detach(), z.detach(), counts)
        return self.settings.aux_loss_coef * aux + self.settings.z_loss_coef * z

    def _pool(self, counts: torch.Tensor, tokens: torch.Tensor, index: int):
        """(counts, tokens) of the pool this micro-batch belongs to, and its weight in the objective."""
        if self.settings.aux_loss_scope == "micro_batch":
            # Mean over the micro-batches of all DP ranks (each rank has num_micro_batches of them).
            return counts, tokens, 1.0 / (self.num_micro_batches * _world(self.group))
        if self.global_counts is not None:
            # The routing the pre-pass saw must be the routing trained on: the same local check on every rank,
            # counted on the device (raised by `check_routing` after the step's one fetch).
            mismatch = (counts != self.expected_counts[index]).sum()
            self._mismatch = mismatch if self._mismatch is None else self._mismatch + mismatch
            return self.global_counts, self.global_tokens, 1.0
        # One micro-batch per rank: its counts, summed over DP, are the global ones (no gradient flows through them).
        tally = all_reduce_sum(torch.cat([tokens.reshape(1).to(torch.int64), counts.reshape(-1)]), self.group)
        return tally[1:].view_as(counts), tally[0], 1.0

    def _record(self, aux: torch.Tensor, z: torch.Tensor, counts: torch.Tensor) -> None:
        if self._counts is None:
            self._aux, self._z, self._counts = aux.double(), z.double(), counts.clone()
        else:
            self._aux, self._z, self._counts = self._aux + aux.double(), self._z + z.double(), self._counts + counts
        if self._mismatch is None:
            self._mismatch = torch.zeros((), dtype=torch.int64, device=counts.device)

    def local_values(self) -> torch.Tensor:
        """fp64 [3 + L·E]: aux, z, routing mismatches and counts of this rank's micro-batches, to be summed over DP
        (fp64 holds every count exactly below 2^53)."""
        head = torch.stack([self._aux, self._z, self._mismatch.double()])
        return torch.cat([head, self._counts.double().reshape(-1)])

    def num_layers(self) -> int:
        return self._counts.shape[0]


@dataclass
class RouterValues:
    """The step's global router values, on the host."""

    aux_loss: float
    z_loss: float
    counts: list[list[int]]  # [L][E] global tokens per expert per MoE layer (each token counted k times)

    def objective(self, settings: RouterSettings) -> float:
        return settings.aux_loss_coef * self.aux_loss + settings.z_loss_coef * self.z_loss


def router_values(fetched: list[float], num_layers: int, num_experts: int) -> tuple[RouterValues, int]:
    """(values, global routing mismatches) from the fetched fp64 vector `RouterStep.local_values` summed over DP."""
    aux, z, mismatch, *flat = fetched
    counts = [[int(c) for c in flat[layer * num_experts:(layer + 1) * num_experts]] for layer in range(num_layers)]
    return RouterValues(aux_loss=aux, z_loss=z, counts=counts), int(mismatch)


def check_routing(mismatch: int) -> None:
    """Refuse the update when a gradient pass routed tokens differently from its pre-pass."""
    if mismatch:
        raise TrainingError(f"{mismatch} expert choices of the gradient pass differ from the routing pre-pass of the "
                            "same micro-batches, so the global load-balancing loss would be wrong; the run stopped "
                            "before this update: turn off router noise (e.g. router_jitter_noise) or dropout before "
                            "the routers, or set moe.aux_loss_scope=micro_batch")


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1
