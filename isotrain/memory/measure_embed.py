"""The embedding estimate's terms (memory/estimate_embed.py) measured on a live rank running the recipe's own step,
`embed_forward_backward` (embed/gradcache.py), unchanged: only names it calls are wrapped while it runs.

- model states: the bytes of the real parameters, gradients (after a first step's backward) and AdamW state;
- activations: what each forward with gradient keeps for its backward, from `encode_chunk` through
  `cached_surrogate` (memory/saved.py's counter), the largest of the step's forwards; likewise autocast's weight
  copies (bf16 without FSDP2) kept by a forward;
- embeddings and gradient cache: every tensor the step function itself holds while a forward with gradient runs
  (read off its frame: the vectors, their split copies, the gradient cache, ids, the forward's vectors);
- contrastive loss: `contrastive_loss`'s inputs and what it saves, then, in its backward, the similarity's
  gradient and the inputs' gradients (memory/embed_step.py's counter, the one the estimate uses on fake tensors);
- FSDP2's buffers, sampled during the step as for SFT (memory/measure.py `fsdp_buffers`).
"""

from __future__ import annotations

import contextlib
import sys

import torch

from isotrain.memory.embed_step import count_loss, watch_backward
from isotrain.memory.measure import (fsdp_buffers, fsdp_groups, gradient_bytes, optimizer_bytes, parameter_bytes,
                                     storage_bytes)
from isotrain.memory.saved import count_saved, tensors_in
from isotrain.parallel.apply import decoder_layers


@contextlib.contextmanager
def _instrumented_step(model):
    """Wrap what embed_forward_backward calls; yield the peaks found while the block runs it once."""
    import isotrain.embed.gradcache as gradcache

    peaks = {"activations": 0, "compute_copies": 0, "embeddings": 0, "loss": 0}
    originals = {name: getattr(gradcache, name) for name in ("encode_chunk", "cached_surrogate", "contrastive_loss")}
    open_count = contextlib.ExitStack()
    counting = []

    def encode_chunk(*args, **kwargs):
        if not torch.is_grad_enabled():  # the first pass keeps nothing for backward
            return originals["encode_chunk"](*args, **kwargs)
        counting[:] = [open_count.enter_context(count_saved(model, decoder_layers(model)))]
        return originals["encode_chunk"](*args, **kwargs)

    def cached_surrogate(vectors, cached, positions):
        held = tensors_in(sys._getframe(1).f_locals.values())  # embed_forward_backward's own tensors, `vectors` included
        peaks["embeddings"] = max(peaks["embeddings"], storage_bytes(held))
        result = originals["cached_surrogate"](vectors, cached, positions)
        open_count.close()
        for kind in ("activations", "compute_copies"):
            peaks[kind] = max(peaks[kind], counting[0].by_kind[kind])
        return result

    def contrastive_loss(queries, documents, query_ids, document_ids, settings):
        with count_loss(queries, documents, query_ids, document_ids) as counted:
            loss = originals["contrastive_loss"](queries, documents, query_ids, document_ids, settings)
        watch_backward(loss, queries, documents, counted)
        losses.append(counted)
        return loss

    losses = []
    for name, wrapper in (("encode_chunk", encode_chunk), ("cached_surrogate", cached_surrogate),
                          ("contrastive_loss", contrastive_loss)):
        setattr(gradcache, name, wrapper)
    try:
        yield peaks
    finally:
        for name, original in originals.items():
            setattr(gradcache, name, original)
        open_count.close()
    peaks["loss"] = max((counted.total for counted in losses), default=0)


def measure_embed_terms(model, optimizer, steps: tuple[list, list], settings, options, device,
                        group=None) -> dict[str, int]:
    """Every term of the embedding estimate, by name, read off the live rank: one real step on `steps[0]` (this
    rank's micro-batches; gradients read before the update, AdamW's state after it), then the instrumented step on
    `steps[1]`."""
    from isotrain.embed.gradcache import embed_forward_backward
    from isotrain.train.step import optimizer_step

    measured = {"parameters": parameter_bytes(model)}
    result = embed_forward_backward(model, steps[0], settings, options, 0, device, group)
    measured["gradients"] = gradient_bytes(model)
    parameters = [p for p in model.parameters() if p.requires_grad]
    optimizer_step(optimizer, parameters, 1e-3, 1.0, result.loss)
    measured["optimizer moments"] = optimizer_bytes(optimizer)
    with fsdp_buffers(model) as buffers, _instrumented_step(model) as peaks:
        embed_forward_backward(model, steps[1], settings, options, 1, device, group)
    if fsdp_groups(model):
        measured["FSDP2 all-gather buffers"] = buffers["gathered"]
        measured["FSDP2 reduce-scatter buffers"] = buffers["reduce"]
    measured["activations"] = peaks["activations"]
    measured["compute copies"] = peaks["compute_copies"]
    measured["embeddings and gradient cache"] = peaks["embeddings"]
    measured["contrastive loss"] = peaks["loss"]
    return measured
