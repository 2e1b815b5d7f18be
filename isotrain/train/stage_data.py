"""Stage-only data loading under pipeline parallelism: only the ranks whose stages take the token ids (the first)
or the labels (the last) read samples; a rank that holds only stages in between (parallel.pp > 2) reads none.

Such a rank still needs two things of every micro-batch of the step:
  - its position ids: its decoder layers attend, and the document boundaries of packed samples (position-id
    restarts, which transformers reads as packed documents, or isotrain's per-document mask built from them) and
    the rotary positions come from them; and its segment ids, whose padding (-1) tells an MoE model's routers
    which positions hold tokens (moe/routing.py);
  - its counts (input tokens, trained tokens, loss denominator, samples): the denominator must be known before the
    first backward, and every rank keeps the step's counters of one process (invariant 2).
The rank of the first stage of its pipeline (the same DP coordinates: the same micro-batches) sends both over the
pipeline group, in two broadcasts:

    header  int64 [M, 6]            rows, length, and the 4 counts of each of the step's M micro-batches
    body    int64 [2·Σ_m rows·length]  the position ids, then the segment ids, micro-batch after micro-batch

M is the batch plan's, known to every rank. Each stage then sums the counts over its own DP group as before
(train/step.py), so every rank holds one process's global counts. The last stage reads its own samples (it needs
the labels) and takes part in the broadcasts only because they span the pipeline group. With pp = 2 every rank holds
an end stage and nothing is sent, except under a V-shaped schedule (zbv, dualpipev: rank 0 holds both end stages,
rank 1 the two middle ones), whose rank 1 reads nothing.

Invariant 3 is untouched: every rank still computes the sampler's indices of every step (no sample is read for
that), the reading ranks read exactly those, and a run resumed on any PP degree starts from the same step's indices.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from isotrain.parallel.dims import V_SHAPED
from isotrain.parallel.pp import last_stage_rank
from isotrain.train.loss import micro_batch_counts


def reads_data(parallel) -> bool:
    """Whether this rank reads samples: always without pipeline parallelism; under it, the rank of the first stage
    (rank 0 of the pipeline, which also holds the first stage under interleaved schedules) and of the last (rank
    pp - 1; rank 0 under a V-shaped schedule) only."""
    if _every_rank_reads(parallel):
        return True
    return parallel.pp_rank in (0, last_stage_rank(parallel.dims.pp, parallel.dims.pp_schedule))


def _every_rank_reads(parallel) -> bool:
    """No pipeline, or one of 2 ranks with one end stage each (a V-shaped schedule puts both ends on rank 0)."""
    return parallel is None or parallel.dims.pp == 1 or (parallel.dims.pp == 2
                                                          and parallel.dims.pp_schedule not in V_SHAPED)


def stage_micro_batches(read: Callable[[list[int]], dict], index_lists: list[list[int]], parallel, reduction: str,
                        device: torch.device) -> list[dict]:
    """This rank's micro-batches of one step: `read(indices)` (a collated micro-batch, data/collate.py) of each of
    `index_lists` where the rank reads (`reads_data`); on a middle stage, which never calls `read`, each micro-batch's
    position ids, segment ids and counts from the first stage, as {"position_ids": [B, L], "segment_ids": [B, L],
    "counts": [4 ints]}. `reduction`: train.loss_reduction (the denominator's)."""
    micro_batches = [read(indices) for indices in index_lists] if reads_data(parallel) else None
    if _every_rank_reads(parallel):
        return micro_batches
    header = torch.zeros((len(index_lists), 6), dtype=torch.int64)
    if parallel.pp_rank == 0:
        for row, mb in zip(header, micro_batches, strict=True):
            row[:2] = torch.tensor(mb["position_ids"].shape)
            row[2:] = torch.tensor(micro_batch_counts(mb, reduction))
    header = _from_first_stage(header, parallel.pp_group, device).cpu()
    sizes = [2 * rows * length for rows, length in header[:, :2].tolist()]
    body = torch.cat([torch.stack([mb["position_ids"], mb["segment_ids"]]).to(torch.int64).reshape(-1)
                      for mb in micro_batches]) if parallel.pp_rank == 0 else torch.zeros(sum(sizes), dtype=torch.int64)
    body = _from_first_stage(body, parallel.pp_group, device).cpu()
    if micro_batches is not None:
        return micro_batches
    ids = body.split(sizes)
    return [{"position_ids": ids[m].view(2, rows, length)[0], "segment_ids": ids[m].view(2, rows, length)[1],
             "counts": counts} for m, (rows, length, *counts) in enumerate(header.tolist())]


def _from_first_stage(tensor: torch.Tensor, group, device: torch.device) -> torch.Tensor:
    """`tensor` as the pipeline's first stage rank holds it, on every rank of `group` (on `device`: NCCL sends device
    tensors)."""
    tensor = tensor.to(device)
    dist.broadcast(tensor, group=group, group_src=0)
    return tensor
