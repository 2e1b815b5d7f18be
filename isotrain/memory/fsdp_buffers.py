"""FSDP2's buffers at their peak, of any model FSDP2 wraps as isotrain does (one group per decoder layer and one root):
the full model's (memory/estimate.py, estimate_embed.py) or a pipeline stage's (memory/pipeline.py)."""

from __future__ import annotations

from dataclasses import dataclass

from isotrain.memory.shards import expert_parameter_names, local_numel, tp_split_dims
from isotrain.memory.terms import DTYPES, FP32_BYTES, Term
from isotrain.parallel.dims import ParallelDims


@dataclass(frozen=True)
class _Unsharded:
    """Elements of one FSDP2 group on this TP rank: as its parameters (`numel`) and as FSDP2's buffers, whose
    every tensor is padded to dp_shard equal row chunks (`padded`)."""
    numel: int = 0
    padded: int = 0


def _unsharded_groups(model, config, degrees: ParallelDims) -> tuple[_Unsharded, _Unsharded, _Unsharded, _Unsharded]:
    """(root, its trainable parameters, its trainable parameters used after the decoder layers, largest decoder
    layer) of this TP rank; under expert parallelism without the experts, which FSDP2 leaves alone."""
    from isotrain.parallel.apply import decoder_layers

    split = tp_split_dims(model, config) if degrees.tp > 1 else {}
    no_dp = ParallelDims(1, 1, degrees.tp)
    names = {id(p): n for n, p in model.named_parameters()}
    ignored = expert_parameter_names(model) if degrees.ep > 1 else set()

    def group(params) -> _Unsharded:
        params = [p for p in params if names[id(p)] not in ignored]
        return _Unsharded(
            sum(local_numel(tuple(p.shape), split.get(names[id(p)]), no_dp) for p in params),
            sum(local_numel(tuple(p.shape), split.get(names[id(p)]), degrees) * degrees.dp_shard for p in params))

    layers = decoder_layers(model)
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_layers]
    trained = [p for p in root if p.requires_grad]
    # The input embeddings' gradients come last in backward (BERT's position and token-type embeddings and their
    # norm with them); the final norm's and the head's (the embedding's too when tied to the head) come first.
    embedding = model.get_input_embeddings()  # (None on a later pipeline stage; an earlier one's head has no weight)
    output = model.get_output_embeddings()
    tied = embedding is not None and getattr(output, "weight", None) is embedding.weight
    before = {id(p) for p in _embedding_block(model, embedding).parameters()} if embedding is not None else set()
    after = [p for p in trained if id(p) not in before or (tied and p is embedding.weight)]
    return group(root), group(trained), group(after), max((group(layer.parameters()) for layer in layers),
                                                           key=lambda g: g.padded, default=_Unsharded())


def _embedding_block(model, embedding):
    """The module that embeds the input: BERT's `embeddings` (word, position and token-type embeddings and their
    norm), or the input embedding itself where it sits directly in the base model beside the final norm."""
    base = getattr(model, getattr(model, "base_model_prefix", ""), model)
    modules = dict(model.named_modules())
    parent = modules[next(name for name, module in modules.items() if module is embedding).rpartition(".")[0]]
    return embedding if parent is base or parent is model else parent


def fsdp_terms(model, config, degrees: ParallelDims, dtype: str) -> list[Term]:
    """FSDP2's buffers at their peak (torch 2.14 `fully_shard`, one group per decoder layer and one root, the
    root not resharded after forward; docs/memory.md).

    All-gather: a group's all-gather fills one flat buffer, then copies it out into the unsharded parameters (both
    padded). In forward FSDP2 keeps the flat buffer until the next group's copy-out; in backward the group in use
    prefetches the next one's all-gather. Either way one group's flat buffer and another's (or the same group's)
    parameters exist beside the gathered root: root + layer + max(root, layer).

    Reduce-scatter: a layer's post-backward copies its unsharded gradients (compute dtype) into a padded fp32
    reduce-scatter input, which FSDP2 holds until the next group's reduce. The root reduces only at the end of
    backward (its forward inputs, token ids, need no gradient), so the head's and final norm's gradients wait all
    through the layers' backward; at the end the root's gradients meet the last layer's held input, then their own.
    """
    if not degrees.fsdp:
        return []
    storage, compute = DTYPES[dtype]
    root, trained_root, after, layer = _unsharded_groups(model, config, degrees)
    gathered_numel = root.padded + layer.padded + max(root.padded, layer.padded)
    gathered = gathered_numel * compute.itemsize
    if storage.itemsize < FP32_BYTES:
        gathered += gathered_numel * storage.itemsize
    during_layers = (layer.numel + after.numel) * compute.itemsize + layer.padded * FP32_BYTES
    at_root = trained_root.numel * compute.itemsize + max(layer.padded, trained_root.padded) * FP32_BYTES
    experts = " (experts excluded: expert parallel)" if degrees.ep > 1 else ""
    return [Term("FSDP2 all-gather buffers", gathered,
                 "root + layer + max(root, layer) unsharded, padded, compute dtype" + experts),
            Term("FSDP2 reduce-scatter buffers", max(during_layers, at_root),
                 "a layer's gradients (compute dtype) + its fp32 reduce-scatter input + the head's gradients; "
                 "or the root's at the end")]
