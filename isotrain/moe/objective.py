"""The router terms of one optimizer step: what each micro-batch adds to the objective, and what the step logs.

    objective = CE + aux_loss_coef · aux + z_loss_coef · z            (aux, z: aux_loss.py)

A `RouterStep` is made per optimizer step. With `global` scope it holds the global routing counts before the
first backward: from the routing pre-pass (prepass.py) when a rank has several micro-batches, else they are
all-reduced over DP right after the rank's one forward. Each micro-batch's term is then its exact share of the
global aux / z, so the summed gradient is the same for any split. When both coefficients are 0 nothing is
backpropagated and no pre-pass runs; the values are still logged.

Under context parallelism a rank routes only its piece of every sequence (parallel/cp.py), so the tokens and counts
of a pool are summed over the CP group as well (over DP × CP: the tokens of the global batch, each counted once);
`micro_batch` scope pools a micro-batch's pieces over CP. Under pipeline parallelism each stage's RouterStep sees its
own MoE layers only: the global counts of all layers come from a pre-pass through the pipeline
(`set_pipeline_pool`, train/step.py), each stage's term is its layers' exact share of the global aux / z (with
`micro_batch` scope, of its micro-batch's aux / z, against that micro-batch's counts of all layers from the same
pre-pass), and its logged sums fill its layers' rows of [L, E] (summed over the stages).

The logged values come from sums kept on the device (summed over DP, and CP or the stages, with the loss, fetched
in the step's one host sync): routed tokens N, Σ_t logsumexp², the counts C_le and the probability sums S_le, from
which the global aux and z follow on the host; `micro_batch` scope logs the mean of its micro-batches' own values.
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

# Layout of RouterStep.local_values: 5 scalars, then C [L, E], then S [L, E].
_MB_AUX, _MB_Z, _MISMATCH, _TOKENS, _Z_SUM = range(5)


@dataclass
class RouterStep:
    settings: RouterSettings
    num_micro_batches: int  # this rank's; every DP rank has as many
    group: object = None  # the DP group the counts are summed over
    cp_group: object = None  # under context parallelism, the ranks holding the other pieces of the same sequences
    # Global scope with a pre-pass: the global counts [L, E], tokens, and each local micro-batch's own counts.
    global_counts: torch.Tensor | None = None
    global_tokens: torch.Tensor | None = None
    expected_counts: list[torch.Tensor] = field(default_factory=list)
    # Micro-batch scope under pipeline parallelism: each local micro-batch's counts [M, L, E] over all the model's
    # MoE layers, summed over the stages (its pool), from the pre-pass.
    micro_batch_counts: torch.Tensor | None = None
    # Under pipeline parallelism a rank routes through its own stages' MoE layers only: their rows among the L MoE
    # layers of the whole model, in order (the logged sums are laid out over all L, zero elsewhere, and summed over
    # the stages). The stage holding row 0, the model's first MoE layer, counts the tokens N (every stage routes the
    # same tokens; a rank of several stages holds it in at most one of them).
    layer_rows: list[int] | None = None
    num_model_layers: int | None = None
    device: torch.device | None = None  # where a stage that never routes keeps its zero sums (local_values)
    _sums: list[torch.Tensor] | None = None  # this rank's logged sums (local_values), built by the first term

    def term(self, router_logits, mask: torch.Tensor, index: int, rows: list[int] | None = None) -> torch.Tensor:
        """The router terms of micro-batch `index` (coef-weighted, globally normalised; a scalar with gradient).
        `rows`: under pipeline parallelism, the model rows of the stage whose router logits these are (a rank of
        several stages routes each through its own layers); by default all of this rank's `layer_rows`."""
        rows = self.layer_rows if rows is None else rows
        logits = layer_logits(router_logits)
        counts = routing_counts(logits, self.settings.top_k, mask)
        tokens, probs, z_total = mask.sum(), prob_sums(logits, mask), z_sum(logits, mask)
        scalars = torch.zeros(5, dtype=torch.float64, device=mask.device)
        scalars[_TOKENS] = tokens.double() if rows is None or 0 in rows else 0
        scalars[_Z_SUM] = z_total.detach().double()
        if self.settings.aux_loss_scope == "micro_batch":
            # Each micro-batch is its own pool (all of its CP pieces); the objective is the mean over the
            # micro-batches of all DP ranks.
            share = 1.0 / (self.num_micro_batches * _world(self.group))
            pool_counts, pool_tokens = self._micro_batch_pool(counts, tokens, index, scalars, rows)
            aux = aux_loss_part(pool_counts, probs, pool_tokens, self.settings.num_experts) * share
            z = z_loss_part(z_total, pool_tokens, pool_counts.shape[0]) * share
            scalars[_MB_AUX], scalars[_MB_Z] = aux.detach().double(), z.detach().double()
        elif self.settings.aux_loss_coef == 0 and self.settings.z_loss_coef == 0:
            aux = z = torch.zeros((), device=mask.device)  # nothing to backpropagate
        else:
            pool_counts, pool_tokens = self._global_pool(counts, tokens, index, scalars, rows)
            # pool_counts has a row per MoE layer of the whole model (under PP, more than this stage's logits)
            aux = aux_loss_part(pool_counts, probs, pool_tokens, self.settings.num_experts)
            z = z_loss_part(z_total, pool_tokens, pool_counts.shape[0])
        self._record([scalars, self._model_rows(counts.double(), rows).reshape(-1),
                      self._model_rows(probs.detach().double(), rows).reshape(-1)])
        return self.settings.aux_loss_coef * aux + self.settings.z_loss_coef * z

    def _model_rows(self, values: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
        """[L_stage, E] -> [L, E]: a stage's rows (`rows`, by default this rank's) among all MoE layers of the model
        (itself without PP)."""
        rows = self.layer_rows if rows is None else rows
        if rows is None:
            return values
        laid_out = values.new_zeros(self.num_model_layers, values.shape[1])
        laid_out[rows] = values
        return laid_out

    def _expected(self, index: int, rows: list[int] | None) -> torch.Tensor:
        """The pre-pass's counts of micro-batch `index` through the layers `rows` (its rows of this rank's)."""
        expected = self.expected_counts[index]
        if rows is None or rows == self.layer_rows:
            return expected
        return expected[[self.layer_rows.index(row) for row in rows]]

    def set_pipeline_pool(self, expected: list[torch.Tensor], masks: list[torch.Tensor], pp_group) -> None:
        """The global pool of a pipeline's pre-pass: this rank's counts of every local micro-batch (`expected`,
        [L_rank, E] each, the rows of `layer_rows`), laid out over the model's L MoE layers and summed over DP and the
        stages; the tokens N summed over DP only (every stage routes the same micro-batches)."""
        counts = self._model_rows(torch.stack(expected).sum(0)).to(torch.int64)
        tokens = torch.stack([mask.sum() for mask in masks]).sum().to(torch.int64)
        self.global_counts = all_reduce_sum(all_reduce_sum(counts, self.group), pp_group)
        self.global_tokens = all_reduce_sum(tokens, self.group)
        self.expected_counts = expected
        if self.settings.aux_loss_scope == "micro_batch":  # a micro-batch's pool: its counts of every stage's layers
            rows = torch.stack([self._model_rows(e) for e in expected]).to(torch.int64)
            self.micro_batch_counts = all_reduce_sum(rows, pp_group)

    def _global_pool(self, counts: torch.Tensor, tokens: torch.Tensor, index: int, scalars: torch.Tensor,
                     rows: list[int] | None = None):
        """(counts [L, E], tokens) of the whole global batch."""
        if self.global_counts is not None:
            # The routing the pre-pass saw must be the routing trained on: the same local check on every rank,
            # counted on the device (raised by `check_routing` after the step's one fetch).
            scalars[_MISMATCH] = (counts != self._expected(index, rows)).sum().double()
            return self.global_counts, self.global_tokens
        # One micro-batch per rank: its counts, summed over DP × CP, are the global ones (no gradient flows through
        # them).
        tally = sum_over_pool(torch.cat([tokens.reshape(1).to(torch.int64), counts.reshape(-1)]), self.group,
                              self.cp_group)
        return tally[1:].view_as(counts), tally[0]

    def _micro_batch_pool(self, counts: torch.Tensor, tokens: torch.Tensor, index: int, scalars: torch.Tensor,
                          rows: list[int] | None = None):
        """(counts [L, E], tokens) of micro-batch `index`: under pipeline parallelism its counts of every stage's
        layers, from the pre-pass (whose routing the gradient pass must repeat), else `_pieces_pool`'s."""
        if self.micro_batch_counts is None:
            return self._pieces_pool(counts, tokens)
        scalars[_MISMATCH] = (counts != self._expected(index, rows)).sum().double()
        return self.micro_batch_counts[index], tokens

    def _pieces_pool(self, counts: torch.Tensor, tokens: torch.Tensor):
        """(counts [L, E], tokens) of the whole micro-batch: this rank's piece's, summed over CP."""
        if self.cp_group is None:
            return counts, tokens
        tally = all_reduce_sum(torch.cat([tokens.reshape(1).to(torch.int64), counts.reshape(-1)]), self.cp_group)
        return tally[1:].view_as(counts), tally[0]

    def _record(self, parts: list[torch.Tensor]) -> None:
        self._sums = parts if self._sums is None else [a + b for a, b in zip(self._sums, parts, strict=True)]

    def local_values(self) -> torch.Tensor:
        """fp64 [5 + 2·L·E]: this rank's sums, to be summed over DP × CP (fp64 holds every count exactly below
        2^53); zeros on a pipeline stage of dense layers only, which routes nothing."""
        if self._sums is None:
            size = 5 + 2 * self.num_layers() * self.settings.num_experts
            return torch.zeros(size, dtype=torch.float64, device=self.device)
        return torch.cat(self._sums)

    def num_layers(self) -> int:
        if self.num_model_layers is not None:
            return self.num_model_layers
        return self._sums[1].numel() // self.settings.num_experts


@dataclass
class RouterValues:
    """The step's global router values, on the host."""

    aux_loss: float
    z_loss: float
    counts: list[list[int]]  # [L][E] global tokens per expert per MoE layer (each token counted k times)

    def objective(self, settings: RouterSettings) -> float:
        return settings.aux_loss_coef * self.aux_loss + settings.z_loss_coef * self.z_loss


def router_values(fetched: list[float], settings: RouterSettings, num_layers: int) -> tuple[RouterValues, int]:
    """(values, global routing mismatches) from `RouterStep.local_values` summed over DP and fetched.

    global scope, in fp64: aux = E · Σ_e (Σ_l C_le)(Σ_l S_le) / (N·L)², z = Σ logsumexp² / (N·L) (aux_loss.py)."""
    num_experts = settings.num_experts
    size = num_layers * num_experts
    counts_flat, probs_flat = fetched[5:5 + size], fetched[5 + size:5 + 2 * size]
    counts = [[int(c) for c in counts_flat[layer * num_experts:(layer + 1) * num_experts]]
              for layer in range(num_layers)]
    if settings.aux_loss_scope == "micro_batch":
        aux, z = fetched[_MB_AUX], fetched[_MB_Z]
    else:
        rows = max(fetched[_TOKENS], 1) * num_layers
        per_expert = [(sum(counts_flat[e::num_experts]), sum(probs_flat[e::num_experts])) for e in range(num_experts)]
        aux = num_experts * sum(c * p for c, p in per_expert) / rows**2
        z = fetched[_Z_SUM] / rows
    return RouterValues(aux_loss=aux, z_loss=z, counts=counts), int(fetched[_MISMATCH])


def check_routing(mismatch: int) -> None:
    """Refuse the update when a gradient pass routed tokens differently from its pre-pass."""
    if mismatch:
        raise TrainingError(f"{mismatch} expert choices of the gradient pass differ from the routing pre-pass of the "
                            "same micro-batches, so the global load-balancing loss would be wrong; the run stopped "
                            "before this update: turn off router noise (e.g. router_jitter_noise) or dropout before "
                            "the routers, or set moe.aux_loss_scope=micro_batch")


def sum_over_pool(values: torch.Tensor, dp_group, cp_group=None) -> torch.Tensor:
    """`values` summed over DP and, under context parallelism, over CP: the sum over every rank that routes
    different tokens of the global batch (a cp_group of None is no CP, never the world)."""
    values = all_reduce_sum(values, dp_group)
    return values if cp_group is None else all_reduce_sum(values, cp_group)


def _world(group) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1
