"""RL micro-batches under context parallelism (parallel.cp): which piece of every row this rank runs.

The `cp` ranks of a DP rank hold the same samples and the same micro-batches (whole rows); each runs one piece of
every row through the model (parallel/cp.py: contiguous pieces for Ulysses, zig-zag for ring), as SFT does.
Targets are pre-shifted (rl/experience.py: position t holds token t + 1), so cutting input ids, position ids,
targets, the mask and every per-token array alike keeps each token's log-prob where its logit is, also across
piece boundaries. Whatever depends on a whole sequence is computed on the whole rows, before the cut or after a
gather, never on a piece:

    loss weights a_t and D (rl.loss_agg: 1/n_s of seq-mean-token-mean, R)   whole rows, then cut
    sequence-level corrections (seq_tis, seq_mis, geo_rs: S = Σ_t Δ_t)      whole rows (π_old gathered), then cut
    Σ_t a_t ℓ_t and the token statistics of a piece                          summed over CP (and DP)
    log-probs and values of the rollout (no gradient)                         gathered into whole rows

so the loss, every gradient (summed over CP by the data-parallel reduction, parallel/mesh.py) and every metric
are those of one process.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from isotrain.parallel.cp import context_parallel_attention, cut_rows, pad_rows, padded_length, whole_rows
from isotrain.parallel.dist import all_reduce_sum

# Padding of the row tensors (fill of every other per-token tensor: 0, which trains nothing under a mask of 0).
_FILL = {"position_ids": None, "segment_ids": -1}


@dataclass(frozen=True)
class Pieces:
    """This rank's place in its CP group; `size` 1 (NO_CP): whole rows, every method the identity."""

    group: object = None
    rank: int = 0
    size: int = 1
    style: str = "ulysses"

    @classmethod
    def of(cls, parallel) -> Pieces:
        """The pieces of a run's ParallelState (NO_CP without context parallelism)."""
        if parallel is None or parallel.dims.cp == 1:
            return NO_CP
        return cls(parallel.cp_group, parallel.cp_rank, parallel.dims.cp, parallel.dims.cp_style)

    def cut(self, mb: dict, extra: dict[str, torch.Tensor | None] | None = None) -> tuple[dict, dict]:
        """(this rank's piece of micro-batch `mb`, of the `extra` per-token tensors [rows, L] computed on its
        whole rows). Every tensor of `mb` shaped like its rows is cut alike; other entries are kept."""
        extra = extra or {}
        if self.size == 1:
            return mb, extra
        shape = mb["input_ids"].shape
        piece = {key: self.cut_tensor(value, _FILL.get(key, 0))
                 if isinstance(value, torch.Tensor) and value.shape[:2] == shape else value
                 for key, value in mb.items()}
        return piece, {key: None if value is None else self.cut_tensor(value) for key, value in extra.items()}

    def cut_tensor(self, tensor: torch.Tensor, fill=0) -> torch.Tensor:
        if self.size == 1:
            return tensor
        return cut_rows(tensor, self.rank, self.size, self.style, fill)

    def whole(self, piece: torch.Tensor, length: int) -> torch.Tensor:
        """A piece's values (no gradient) -> the whole rows' [rows, length], gathered over the CP group."""
        if self.size == 1:
            return piece
        return whole_rows(piece, self.group, length, self.style)

    def attention(self, mb: dict, device: torch.device):
        """Context-parallel attention over the whole rows of `mb` (no-gradient forwards; the gradient step enters
        it in train/step.py)."""
        if self.size == 1:
            return contextlib.nullcontext()
        positions = mb["position_ids"]
        positions = pad_rows(positions, padded_length(positions.shape[1], self.size, self.style), None)
        return context_parallel_attention(self.group, positions.to(device), self.style)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Sums over the pieces of rows (token statistics) -> over whole rows."""
        return values if self.size == 1 else all_reduce_sum(values, self.group)


NO_CP = Pieces()
