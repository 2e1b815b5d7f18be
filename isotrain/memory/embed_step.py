"""The embedding step's own terms (`isotrain embed`, embed/gradcache.py), from the config alone.

GradCache runs a step in phases, and each term below is what one phase holds (docs/memory.md):

  1. no-gradient forwards of every local micro-batch: nothing is kept but the pooled vectors (fp32 in fp32 and in
     bf16 runs: bf16 hidden states are pooled after an upcast, embed/encode.py);
  2-3. the global loss, on every rank, of the WHOLE global batch in fp64: the gathered queries [G, H] and documents
     [G(1+N), H] and their text ids, what the loss saves (the similarity matrix's [G, G(1+N)] log-softmax and
     false-negative mask, the normalised vectors), the similarity's [G, G(1+N)] gradient during its backward, and
     the [G(2+N), H] gradients of the gathered vectors;
  4. one forward with gradient at a time, of at most embed.chunk_tokens padded tokens (0: a micro-batch's texts in
     one forward), whose activations live until its backward; beside it, all step long, the vectors of every local
     text twice (as embedded, then split into queries / positives / negatives), their fp32 gradient cache, one
     micro-batch's concatenated rows of it, the running forward's own vectors, and the local text ids.

Texts are assumed data.max_seq_len tokens long, the longest a text is cut to (data are not read), so a forward of
chunk_tokens padded tokens holds chunk_tokens // max_seq_len texts; hard negatives are embed.hard_negatives per
sample (0 when unset: the run takes the fewest a row carries).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from isotrain.memory.saved import SavedBytes

FP32_BYTES, FP64_BYTES, ID_BYTES = 4, 8, 8  # the step's vectors, the loss's dtype, int64 text ids


@dataclass(frozen=True)
class EmbedShapes:
    """The sizes of one rank's step: G global samples, N hard negatives each, `local_samples` = G / DP on this rank
    in micro-batches of `micro_samples`, texts of `seq_len` tokens, `hidden` wide vectors."""
    global_samples: int
    negatives: int
    local_samples: int
    micro_samples: int
    seq_len: int
    hidden: int
    chunk_tokens: int

    @property
    def texts_per_sample(self) -> int:
        return 2 + self.negatives  # query, positive, hard negatives

    @property
    def micro_texts(self) -> int:
        return self.micro_samples * self.texts_per_sample

    @property
    def texts_per_forward(self) -> int:
        """Texts of one padded forward (embed/encode.py `forward_groups` on equal lengths: as many as fit in
        chunk_tokens, a text longer than it alone; no bound: the micro-batch's texts in one forward)."""
        if self.chunk_tokens <= 0:
            return self.micro_texts
        return max(1, min(self.micro_texts, self.chunk_tokens // self.seq_len))


def kept_vector_bytes(shapes: EmbedShapes) -> int:
    """What embed_forward_backward holds through its second pass: the local vectors as embedded and as split
    (two fp32 copies), their fp32 gradient cache, one micro-batch's concatenated cache rows, the local text ids,
    and the vectors of the forward with gradient that runs."""
    local_texts = shapes.local_samples * shapes.texts_per_sample
    vectors = local_texts * shapes.hidden * FP32_BYTES
    rows = (shapes.micro_texts + shapes.texts_per_forward) * shapes.hidden * FP32_BYTES
    return 3 * vectors + rows + local_texts * ID_BYTES


@dataclass
class LossBytes:
    """What the global loss holds, by part; `total` is the term."""
    inputs: int = 0  # gathered fp64 queries and documents, their text ids
    saved: int = 0  # what the loss saves for its backward
    similarity_grad: int = 0  # the largest gradient of a similarity matrix in the loss's backward
    input_grads: int = 0  # ∂L/∂queries, ∂L/∂documents (fp64)

    @property
    def total(self) -> int:
        return self.inputs + self.saved + self.similarity_grad + self.input_grads


def _storage_bytes(tensors) -> int:
    seen = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


@contextlib.contextmanager
def count_loss(queries: torch.Tensor, documents: torch.Tensor, query_ids: torch.Tensor, document_ids: torch.Tensor):
    """Count, while the block computes the contrastive loss of these inputs (embed/loss.py), what it holds; then
    `watch_backward(loss, counted)` before its backward adds the gradients. The inputs (leaves that require grad)
    are counted as inputs, never as saved tensors."""
    counted = LossBytes(inputs=_storage_bytes([queries, documents, query_ids, document_ids]))
    saved = SavedBytes()

    def pack(t):
        saved.add(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield counted
    counted.saved = sum(saved.by_kind.values())


def watch_backward(loss: torch.Tensor, queries: torch.Tensor, documents: torch.Tensor, counted: LossBytes) -> None:
    """Record, as the loss's backward runs, the gradient of each similarity matrix (the input gradient of every
    log-softmax in its graph: cross-entropy's) and the gradients of the queries and documents."""
    def similarity(grad_inputs, grad_outputs):
        counted.similarity_grad = max(counted.similarity_grad, _storage_bytes(g for g in grad_inputs if g is not None))

    pending, seen = [loss.grad_fn], set()
    while pending:
        node = pending.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "LogSoftmaxBackward0":
            node.register_hook(similarity)
        pending.extend(fn for fn, _ in node.next_functions)

    def input_grad(grad):
        counted.input_grads += grad.untyped_storage().nbytes()

    queries.register_hook(input_grad)
    documents.register_hook(input_grad)


def fake_loss_bytes(shapes: EmbedShapes, settings) -> LossBytes:
    """The global loss and its gradients on fake fp64 inputs of the global batch's shapes (gradcache.py
    `global_loss_and_grads`), counted as the live step is (memory/measure_embed.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from isotrain.embed.loss import contrastive_loss

    num_documents = shapes.global_samples * (1 + shapes.negatives)
    with FakeTensorMode():
        queries = torch.zeros(shapes.global_samples, shapes.hidden, dtype=torch.float64, requires_grad=True)
        documents = torch.zeros(num_documents, shapes.hidden, dtype=torch.float64, requires_grad=True)
        query_ids = torch.zeros(shapes.global_samples, dtype=torch.int64)
        document_ids = torch.zeros(num_documents, dtype=torch.int64)
        with count_loss(queries, documents, query_ids, document_ids) as counted:
            loss = contrastive_loss(queries, documents, query_ids, document_ids, settings)
        watch_backward(loss, queries, documents, counted)
        torch.autograd.grad(loss, [queries, documents])
    return counted
