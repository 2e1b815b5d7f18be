"""One contrastive step whose negative pool is the whole global batch, on any layout (GradCache).

  1. every local micro-batch is embedded without gradient, in padded forwards of texts of similar length
     (at most `chunk_tokens` padded tokens each, encode.forward_groups);
  2. queries, positives, hard negatives and their text ids are all-gathered over DP. Rank r holds the
     contiguous slice [r·G/dp, (r+1)·G/dp) of the global batch and its micro-batches are consecutive
     (GlobalBatchSampler), so concatenating micro-batches, then ranks, IS the canonical global order;
  3. every rank computes the same loss L of the global batch (fp64, loss.py) and its gradient
     g_e = ∂L/∂e for each embedding e, keeping the rows of its own samples;
  4. every local micro-batch is re-embedded with gradient, chunk by chunk, and backpropagates the
     surrogate Σ_e ⟨e, g_e⟩, whose parameter gradient is Σ_e (∂e/∂θ)ᵀ g_e — this rank's share of ∂L/∂θ;
  5. the shares are SUMMED over DP (never averaged: each rank backpropagated only its own rows of
     one global loss), so every rank holds exactly ∂L/∂θ of one process with one batch (invariant 1).
     Replicated (unsharded) models sum with one flat all-reduce here; an FSDP2 model sums in its own
     reduce-scatter, whose divide factor is 1 (parallel/apply.py), so Σ_ranks share_r = ∂L/∂θ, sharded.

Step 4 reproduces step 1's embeddings exactly: same groups, same dropout keys (encode.py, dropout.py).

Under FSDP2 every forward all-gathers the parameters and every backward reduce-scatters their gradients, so
every DP rank must run the same number of forwards and of backwards, while texts per rank differ in length
and so in the number of padded forwards (step 1's grouping). Each rank therefore pads its passes to the most
over the DP group with dummy passes: a forward of one token, whose backward is multiplied by 0 (it adds
exact zeros to the gradient). The other way, unsharding once per step and accumulating unsharded gradients
without sync, would hold the whole model and a whole-model gradient on every rank for the step, which is
what sharding exists to avoid; with padding, gradients stay sharded (each backward reduce-scatters and
FSDP2 accumulates the sharded sums), at the cost of a few tiny forwards on the ranks with fewer texts.

The count is agreed BEFORE step 1, because the no-gradient forwards all-gather too. FSDP2 shards per
transformer layer plus the root (parallel/apply.py); the root keeps its parameters unsharded after a forward,
but every layer unit reshards after its forward, so EACH forward, with or without gradient, all-gathers every
layer. A rank with fewer step-1 forwards that reached the count's all-reduce while another rank was still in a
layer's all-gather of its extra forward would wait forever (the two collectives never match). (With the root
as the only unit, only a rank's first forward all-gathered, which hid this.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from isotrain.embed.batch import EmbedMicroBatch
from isotrain.embed.encode import EncodeOptions, encode_chunk, forward_groups, in_text_order
from isotrain.embed.loss import LossSettings, contrastive_loss
from isotrain.parallel.dist import all_reduce_flat, all_reduce_sum


@dataclass
class EmbedStepResult:
    loss: float
    num_input_tokens: int  # global
    num_samples: int  # global


def _group_size_rank(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def all_gather_rows(local: torch.Tensor, group) -> torch.Tensor:
    """Concatenation over DP ranks, in rank order, of equally sized [n, ...] tensors."""
    size, _ = _group_size_rank(group)
    if size == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(size)]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)


def _encode(model, mb: EmbedMicroBatch, forwards: list[list[int]], seeds: list[int], options: EncodeOptions, device):
    """Yield (positions in mb.texts(), their vectors) per forward (encode.forward_groups)."""
    texts = mb.texts()
    for positions in forwards:
        yield positions, encode_chunk(model, [texts[i] for i in positions], [seeds[i] for i in positions], options,
                                      device)


def _encode_no_grad(model, mb: EmbedMicroBatch, forwards: list[list[int]], seeds: list[int], options: EncodeOptions,
                    device) -> torch.Tensor:
    """[len(mb.texts()), H] vectors in mb.texts() order, without gradient."""
    with torch.no_grad():
        return in_text_order(forwards, [v for _, v in _encode(model, mb, forwards, seeds, options, device)])


def _split(vectors: list[torch.Tensor], micro_batches: list[EmbedMicroBatch]):
    """Per-micro-batch [m + m + m·N, H] vectors -> local queries, positives, negatives in sample order."""
    queries, positives, negatives = [], [], []
    for v, mb in zip(vectors, micro_batches):
        m = len(mb.samples)
        queries.append(v[:m])
        positives.append(v[m:2 * m])
        negatives.append(v[2 * m:])
    return torch.cat(queries), torch.cat(positives), torch.cat(negatives)


def gather_global(local_q, local_p, local_n, ids, group):
    """This rank's rows -> the global batch in the loss's layout (loss.py):
    (queries [G, H], documents [G(1+N), H], query ids [G], document ids [G(1+N)]).

    Positives and hard negatives are gathered separately and only then concatenated: gathering
    per-rank [positives, negatives] blocks would interleave them and shift every label."""
    queries, positives, negatives = (all_gather_rows(t, group) for t in (local_q, local_p, local_n))
    query_ids, positive_ids, negative_ids = (all_gather_rows(t, group) for t in ids)
    return queries, torch.cat([positives, negatives]), query_ids, torch.cat([positive_ids, negative_ids])


def global_loss_and_grads(local_q, local_p, local_n, ids, settings: LossSettings, group):
    """Gather over DP, compute the global loss once (fp64), return (loss, [∂L/∂ local q, p, n]).

    Rank r's rows sit at [r·m, (r+1)·m) of the queries and positives and at G + [r·m·N, (r+1)·m·N)
    of the documents (its hard negatives)."""
    _, rank = _group_size_rank(group)
    queries, documents, query_ids, document_ids = gather_global(
        local_q.detach().double(), local_p.detach().double(), local_n.detach().double(), ids, group)
    queries.requires_grad_()
    documents.requires_grad_()
    loss = contrastive_loss(queries, documents, query_ids, document_ids, settings)
    grad_q, grad_d = torch.autograd.grad(loss, [queries, documents])
    g, m, k = queries.shape[0], local_q.shape[0], local_n.shape[0]
    local = [grad_q[rank * m:(rank + 1) * m], grad_d[rank * m:(rank + 1) * m], grad_d[g + rank * k:g + (rank + 1) * k]]
    return float(loss.detach()), [grad.to(t.dtype) for grad, t in zip(local, (local_q, local_p, local_n))]


def cached_surrogate(vectors: torch.Tensor, cached: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """Σ_e ⟨e, g_e⟩ over one forward's vectors [n, H] (texts `positions` of the micro-batch) and their rows of the
    gradient cache `cached` [texts, H]: its backward gives the parameters (∂e/∂θ)ᵀ g_e (step 4)."""
    return (vectors * cached[torch.tensor(positions, device=cached.device)]).sum()


def is_sharded(model: nn.Module) -> bool:
    """Whether FSDP2 wraps `model` (its collectives then run inside every forward and backward)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def num_padded_passes(num_local_passes: int, group, device) -> int:
    """The most passes (padded forwards of one phase) of any rank of the DP group."""
    count = torch.tensor([num_local_passes], dtype=torch.int64, device=device)
    if _group_size_rank(group)[0] > 1:
        dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    return int(count)


def _dummy_pass(model, mb: EmbedMicroBatch, options: EncodeOptions, device, backward: bool) -> None:
    """One forward of a one-token text (and, with `backward`, a backward of 0 × its vector: exact zeros added to
    every gradient) to meet the collectives of a rank with more passes."""
    with torch.set_grad_enabled(backward):
        vector = encode_chunk(model, [mb.texts()[0][:1]], [0], options, device)
    if backward:
        (vector * 0).sum().backward()


def sum_gradients(model: nn.Module, group) -> None:
    """Σ over DP ranks of every parameter gradient, in one flat all-reduce (an FSDP2 model has summed them
    in its reduce-scatters already)."""
    size, _ = _group_size_rank(group)
    if is_sharded(model):
        return
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if size > 1:
        all_reduce_flat(grads, group)


def embed_forward_backward(model: nn.Module, micro_batches: list[EmbedMicroBatch], settings: LossSettings,
                           options: EncodeOptions, step: int, device, group=None) -> EmbedStepResult:
    """Accumulate ∂L/∂θ of the global-batch contrastive loss into the parameters' .grad; return L and counts."""
    seeds = [mb.seeds(options.seed, step) for mb in micro_batches]
    forwards = [forward_groups([len(t) for t in mb.texts()], options.chunk_tokens) for mb in micro_batches]
    num_dummy = 0  # FSDP2: passes this rank adds so that every rank runs as many (module docstring)
    if is_sharded(model):  # before the first forward, which already all-gathers (module docstring)
        num_local = sum(len(f) for f in forwards)
        num_dummy = num_padded_passes(num_local, group, device) - num_local
    vectors = [_encode_no_grad(model, mb, f, s, options, device)  # 1.
               for mb, f, s in zip(micro_batches, forwards, seeds)]
    for _ in range(num_dummy):
        _dummy_pass(model, micro_batches[0], options, device, backward=False)
    local_q, local_p, local_n = _split(vectors, micro_batches)
    ids = [torch.cat(parts).to(device) for parts in zip(*(mb.text_ids() for mb in micro_batches))]
    loss, (grad_q, grad_p, grad_n) = global_loss_and_grads(local_q, local_p, local_n, ids, settings, group)  # 2., 3.
    q_at = p_at = n_at = 0
    for mb, f, s in zip(micro_batches, forwards, seeds):  # 4.
        m, k = len(mb.samples), len(mb.samples) * mb.num_negatives
        cached = torch.cat([grad_q[q_at:q_at + m], grad_p[p_at:p_at + m], grad_n[n_at:n_at + k]])
        q_at, p_at, n_at = q_at + m, p_at + m, n_at + k
        for positions, v in _encode(model, mb, f, s, options, device):
            cached_surrogate(v, cached, positions).backward()
    for _ in range(num_dummy):
        _dummy_pass(model, micro_batches[0], options, device, backward=True)
    sum_gradients(model, group)  # 5.
    counts = all_reduce_sum(torch.tensor([sum(mb.num_tokens() for mb in micro_batches),
                                          sum(len(mb.samples) for mb in micro_batches)], dtype=torch.int64, device=device), group)
    return EmbedStepResult(loss=loss, num_input_tokens=int(counts[0]), num_samples=int(counts[1]))
