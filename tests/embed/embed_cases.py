"""A tiny BERT-like encoder, a global batch with duplicates, and the step run on any layout (shared by the
in-process tests and the torchrun worker)."""

from __future__ import annotations

import random

import torch

from isotrain.data.sampler import GlobalBatchSampler
from isotrain.embed.batch import EmbedMicroBatch, EmbedSample
from isotrain.embed.encode import EncodeOptions, encode_chunk
from isotrain.embed.gradcache import embed_forward_backward, gather_global
from isotrain.embed.loss import LossSettings, contrastive_loss

NUM_SAMPLES, GLOBAL_BATCH, STEP = 16, 8, 1
HIDDEN = 32

# name -> (hard negatives per sample, loss settings, train mode with dropout, chunk_tokens, dtype).
# fp32 bias gradients are sums of many cancelling terms, and accumulating them text by text (GradCache)
# instead of in one graph, or over ranks, reorders those sums: measured up to 1.2e-6 of a LayerNorm bias
# gradient in train mode (a fresh CI environment) and ~2e-6 in eval mode, which is fp32 rounding, not a
# missing term. Since texts run in padded forwards grouped by length, a text's forward also differs in batch
# shape from the one-graph reference's: fp32 train-mode cases measured 1.1e-6 to 2.9e-6 (GA 1 and 4). So every
# case runs in fp64, where agreement is ~1e-15 and any missing or misplaced term (or mask) shows.
CASES = {
    "in_batch": (0, LossSettings(temperature=0.1), True, 0, torch.float64),
    "hard_negatives": (2, LossSettings(temperature=0.1), True, 20, torch.float64),
    "symmetric_matryoshka": (2, LossSettings(temperature=0.1, symmetric=True, matryoshka_dims=(32, 16, 8)), True, 0,
                             torch.float64),
    "eval_no_dup_mask_fp64": (1, LossSettings(temperature=0.1, mask_duplicates=False), False, 30, torch.float64),
}

# model.dtype=bfloat16 on every layout: hard negatives, chunked forwards, dropout on (tests/embed/test_layout_equivalence.py).
BF16_CASE = "hard_negatives"


def tiny_encoder() -> torch.nn.Module:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.1,
                        attention_probs_dropout_prob=0.1)
    return BertModel(config, add_pooling_layer=False)


def dataset(num_negatives: int) -> list[EmbedSample]:
    """Random token texts with duplicates: queries 6 = 2, positives 5 = 1, a hard negative = a positive."""
    rng = random.Random(7)
    text = lambda: tuple(rng.randrange(1, 64) for _ in range(rng.randrange(3, 12)))  # noqa: E731
    queries = [text() for _ in range(NUM_SAMPLES)]
    positives = [text() for _ in range(NUM_SAMPLES)]
    negatives = [[text() for _ in range(num_negatives)] for _ in range(NUM_SAMPLES)]
    for i in range(0, NUM_SAMPLES, 8):
        queries[i + 6] = queries[i + 2]
        positives[i + 5] = positives[i + 1]
        if num_negatives:
            negatives[i + 3][0] = positives[i + 7]
    ident = lambda t: hash(t) & (2**62 - 1)  # noqa: E731  (equal texts, equal ids)
    return [EmbedSample(list(q), list(p), [list(n) for n in ns], ident(q), ident(p), [ident(n) for n in ns])
            for q, p, ns in zip(queries, positives, negatives)]


def micro_batches(samples, dp_rank: int, dp_size: int, ga: int) -> list[EmbedMicroBatch]:
    sampler = GlobalBatchSampler(NUM_SAMPLES, GLOBAL_BATCH, seed=3)
    size = GLOBAL_BATCH // dp_size // ga
    return [EmbedMicroBatch([samples[i] for i in idx], [int(i) for i in idx])
            for idx in sampler.micro_batches(STEP, dp_rank, dp_size, size)]


def grads_of(model) -> dict[str, torch.Tensor]:
    """Every gradient in full (an FSDP2 shard is gathered: the whole tensor is compared)."""
    from torch.distributed.tensor import DTensor

    full = lambda g: g.full_tensor() if isinstance(g, DTensor) else g  # noqa: E731
    return {name: full(p.grad.detach()).clone() for name, p in model.named_parameters() if p.grad is not None}


def run_case(case: str, dp_rank: int, dp_size: int, ga: int, group=None, per_micro_batch: bool = False,
             parallel=None, dtype: torch.dtype | None = None, bf16: bool = False):
    """(loss, gradients) of one step of `case` on this layout. `per_micro_batch`: the control that takes
    negatives from each micro-batch only (the loss of today's tools), averaged over all micro-batches.
    `parallel`: a ParallelState whose FSDP2 shards the encoder (as `isotrain embed` builds it), whose DP group
    the step then uses. `dtype`: instead of the case's own. `bf16`: model.dtype=bfloat16 as isotrain embed applies
    it to fp32 weights: FSDP2's bf16 parameters under `parallel`, else autocast."""
    num_negatives, settings, train, chunk_tokens, case_dtype = CASES[case]
    dtype = torch.float32 if bf16 else dtype or case_dtype
    model = tiny_encoder().to(dtype).train(train)
    compute = torch.bfloat16 if bf16 else None
    if parallel is not None:
        from isotrain.parallel.apply import parallelize

        model, group = parallelize(model, parallel, compute_dtype=compute), parallel.dp_group
    autocast = compute if parallel is None or not parallel.dims.fsdp else None
    options = EncodeOptions(pooling="mean", chunk_tokens=chunk_tokens, seed=11, autocast_dtype=autocast)
    mbs = micro_batches(dataset(num_negatives), dp_rank, dp_size, ga)
    if not per_micro_batch:
        result = embed_forward_backward(model, mbs, settings, options, STEP, torch.device("cpu"), group)
        return result.loss, grads_of(model)
    alone = None  # a group of this process only: the control must not gather over ranks
    if group is not None:
        alone = [torch.distributed.new_group([r]) for r in range(dp_size)][dp_rank]
    total = 0.0
    for mb in mbs:
        total += embed_forward_backward(model, [mb], settings, options, STEP, torch.device("cpu"), alone).loss
    count = len(mbs) * dp_size
    grads = grads_of(model)
    flat = torch.cat([g.reshape(-1).double() for g in grads.values()] + [torch.tensor([total], dtype=torch.float64)])
    if group is not None:
        torch.distributed.all_reduce(flat, group=group)
    flat /= count
    offset = 0
    for name, g in grads.items():
        grads[name] = flat[offset:offset + g.numel()].view_as(g).to(g.dtype)
        offset += g.numel()
    return float(flat[-1]), grads


def full_graph_reference(case: str):
    """The loss of the whole global batch with one autograd graph through the model (no gradient caching)."""
    num_negatives, settings, train, _, dtype = CASES[case]
    model = tiny_encoder().to(dtype).train(train)
    options = EncodeOptions(pooling="mean", seed=11)
    (mb,) = micro_batches(dataset(num_negatives), 0, 1, 1)
    vectors = encode_chunk(model, mb.texts(), mb.seeds(options.seed, STEP), options, torch.device("cpu")).double()
    m = len(mb.samples)
    queries, documents, query_ids, document_ids = gather_global(vectors[:m], vectors[m:2 * m], vectors[2 * m:],
                                                                list(mb.text_ids()), None)
    loss = contrastive_loss(queries, documents, query_ids, document_ids, settings)
    loss.backward()
    return float(loss.detach()), grads_of(model)


def relative_error(got: dict, want: dict) -> float:
    """Largest over tensors of max|got − want| / max|want| (every gradient counted, none missing).

    A tensor's scale is floored at 1e-3 of the model's largest gradient: the attention key biases have a
    gradient of exactly 0 in exact arithmetic (softmax ignores a constant shift), so theirs is pure
    rounding, which no scale of its own can measure (tests/train/test_equivalence.py does the same)."""
    assert got.keys() == want.keys()
    floor = 1e-3 * max(float(t.abs().max()) for t in want.values())
    return max(float((got[k] - want[k]).abs().max() / want[k].abs().max().clamp(min=floor)) for k in want)
