"""What a forward keeps alive for its backward, in bytes, by kind: the one counter of activations that both the
estimate (a fake-tensor forward) and the measurement (a real forward) use.

Autograd's saved tensors are seen through `saved_tensors_hooks`; one storage is counted once, however many
views of it are saved. Activation checkpointing keeps each decoder layer's inputs instead (its own hooks hide
the rest until the layer is recomputed), so the tensor inputs of every decoder layer are counted too.
Kinds:

- `activations`: everything the model body saves (and the decoder layers' inputs);
- `compute_copies`: lower-precision copies of parameters made by autocast (`ToCopyBackward` of a leaf), kept
  by the matmuls that use them until backward;
- `logits_loss`: what the LM head and the loss save, from the head's input on (the loss's fp32 log-softmax);
- `router`: what an MoE model's router terms save (isotrain/moe/: the router logits the objective asks the
  model for, their fp32 probabilities, the z-loss's logsumexp);
- parameters themselves (or views of them) are not counted: they are model state, not activations.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DTensor

KINDS = ("activations", "compute_copies", "logits_loss", "router")
# Backward nodes that only view or cast their input: a chain of them from a leaf is still "that parameter".
# Expert parallelism indexes one expert of a DTensor's local part (SelectBackward0 of DTensor.to_local).
_VIEW_NODES = {"TBackward0", "ViewBackward0", "TransposeBackward0", "AliasBackward0", "PermuteBackward0",
               "ExpandBackward0", "UnsafeViewBackward0", "ToCopyBackward0", "_ToCopyBackward0", "SelectBackward0",
               "_ToTorchTensorBackward"}


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor, or `t` itself: what owns storage on this rank."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _param_origin(t: torch.Tensor) -> str | None:
    """'parameter' for a parameter or a view of one, 'copy' for a cast of one, None for anything else."""
    if t.is_leaf:
        return "parameter" if t.requires_grad else None
    node, cast = t.grad_fn, False
    for _ in range(6):
        if node is None:
            return None
        name = type(node).__name__
        if name == "AccumulateGrad":
            return "copy" if cast else "parameter"
        if name not in _VIEW_NODES:
            return None
        cast |= "ToCopy" in name
        nexts = [fn for fn, _ in node.next_functions if fn is not None]
        if len(nexts) != 1:
            return None
        node = nexts[0]
    return None


@dataclass
class SavedBytes:
    """Bytes by kind; `storages` remembers what was counted so a storage is never counted twice. It holds the
    storages themselves: a storage freed while counting (a graph dropped at once, e.g. one that only yields
    integer counts) would otherwise let a new storage take its address and go uncounted."""

    by_kind: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    storages: dict = field(default_factory=dict)
    kinds: dict = field(default_factory=dict)  # storage key -> the kind it was counted as
    in_head: bool = False
    in_router: bool = False
    logits_bytes: int = 0  # the logits tensor itself (alive until the loss is formed, then freed)
    logits_dtype: torch.dtype | None = None
    logits_numel: int = 0
    exchange_bytes: int = 0  # context parallelism: the exchanges' largest buffers at once (memory/fake_cp.py)
    chunk_bytes: int = 0  # the chunked loss: what one chunk's head and loss save (in `logits_loss` too)
    # A pipeline stage: bytes by kind of the micro-batch's own inputs that it saved (position ids, router mask), which
    # every stage of a rank receives as the same tensors (memory/fake_forward.py `fake_stage_forward`)
    stage_inputs: dict = field(default_factory=dict)

    @property
    def upcast_bytes(self) -> int:
        """The loss's fp32 copy of low-precision logits (none of fp32 logits)."""
        return self.logits_numel * 4 if self.logits_dtype not in (None, torch.float32) else 0

    def skip(self, t: torch.Tensor) -> None:
        """Count `t`'s storage as seen, for nothing: memory counted elsewhere (a pipeline's receive buffer)."""
        storage = local_tensor(t).untyped_storage()
        self.storages[storage._cdata] = storage

    def add(self, t: torch.Tensor, kind: str | None = None) -> None:
        if not isinstance(t, torch.Tensor):
            return
        origin = _param_origin(t)
        if origin == "parameter":
            return
        storage = local_tensor(t).untyped_storage()
        key = storage._cdata
        if key in self.storages:
            return
        self.storages[key] = storage
        if kind is None:
            kind = ("compute_copies" if origin == "copy" else "router" if self.in_router
                    else "logits_loss" if self.in_head else "activations")
        self.kinds[key] = kind
        self.by_kind[kind] += storage.nbytes()


def tensors_in(values) -> list[torch.Tensor]:
    """The tensors among `values`, and inside the lists and tuples among them (one level)."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (tuple, list)):
            found.extend(v for v in value if isinstance(v, torch.Tensor))
    return found


@contextlib.contextmanager
def count_saved(model: nn.Module, layers: list[nn.Module], target=None):
    """Count, while the block runs a forward (only: a backward would add the recomputed layers), what `model`
    keeps for backward. `layers`: its decoder layers (their inputs are kept under activation checkpointing).
    A model without an output head (AutoModel) has no `logits_loss` part: all it saves is `activations`.
    `target`: a function giving the SavedBytes to count into at each moment (None: count nothing then), for a
    caller that splits the count (a pipeline's micro-batches); without it one SavedBytes is yielded."""
    saved = SavedBytes() if target is None else None
    current = (lambda: saved) if target is None else target

    def head_starts(mod, args):
        if current() is not None:
            current().in_head = True

    def head_ends(mod, args, out):
        if current() is not None:
            _note_logits(current(), out)

    head = model.get_output_embeddings()  # None for a base model without a head (an embedding encoder)
    handles = [] if head is None else [head.register_forward_pre_hook(head_starts),
                                       head.register_forward_hook(head_ends)]

    def layer_inputs(mod, args, kwargs):
        if current() is not None:
            for t in tensors_in([*args, *kwargs.values()]):
                current().add(t, "activations")

    for layer in layers:
        handles.append(layer.register_forward_pre_hook(layer_inputs, with_kwargs=True))

    def pack(t):
        if current() is not None:
            current().add(t)
        return t

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield saved
    finally:
        for handle in handles:
            handle.remove()


def _note_logits(saved: SavedBytes, out: torch.Tensor) -> None:
    local = local_tensor(out)
    saved.logits_bytes = local.untyped_storage().nbytes()
    saved.logits_dtype, saved.logits_numel = local.dtype, local.numel()


def chunks_kept(loss_sum, head: nn.Module, *args):
    """`loss_sum(head, *args)` (train/chunked_loss.py `chunked_loss_sum`), and the trained tokens' final hidden states
    [n, H] whose slices its chunks took (the head's input in each chunk is one): the tensor their checkpoints keep
    until backward."""
    inputs = []
    handle = head.register_forward_pre_hook(lambda module, hook_args: inputs.append(hook_args[0]))
    try:
        loss = loss_sum(head, *args)
    finally:
        handle.remove()
    return loss, inputs[0] if inputs[0]._base is None else inputs[0]._base


def chunked_loss_fn(labels, weights, chunk_tokens: int, saved: SavedBytes | None):
    """The chunked SFT loss (train/chunked_loss.py) as `lm_loss_forward` takes it, plus one more forward of a
    first chunk outside checkpointing, left out of the loss: what a chunk's head and loss hold when backward
    recomputes it, counted as the unchunked loss is (saved tensors and logits; `saved.chunk_bytes`: its saved
    tensors alone). Its inputs are the chunks' own (their kept hidden states; labels and weights of the trained
    tokens like theirs, counted once), which the chunks' checkpoints keep until backward (autograd's saved-tensor
    hooks see them; the kept hidden states are counted again explicitly, once, should a torch keep them unseen).
    Every position is trained (the estimate's assumption and the measured batches'), so the trained positions
    need no data-dependent `nonzero`, which fake tensors cannot run."""
    from isotrain.train.chunked_loss import chunk_loss_sum, chunked_loss_sum

    trained = torch.arange(labels.numel(), device=labels.device)

    def loss_fn(hidden, head):
        loss, kept = chunks_kept(chunked_loss_sum, head, hidden, labels, weights, chunk_tokens, trained)
        if saved is None:
            return loss
        saved.add(kept, "logits_loss")
        chunk_labels, chunk_weights = labels.reshape(-1)[trained], weights.reshape(-1)[trained]
        saved.skip(chunk_labels)
        saved.skip(chunk_weights)
        first = slice(0, chunk_tokens)
        before = saved.by_kind["logits_loss"]
        chunk_loss_sum(head, kept[first], chunk_labels[first], chunk_weights[first])
        saved.chunk_bytes = saved.by_kind["logits_loss"] - before
        return loss

    return loss_fn


def forward_loss(model: nn.Module, input_ids, position_ids, labels, weights, autocast_dtype, with_mask=False,
                 router=None, saved: SavedBytes | None = None, chunk_tokens: int = 0):
    """The SFT step's forward of one micro-batch (train/step.py `_sft_loss_sum`): the logits under autocast
    when the step uses it, then Σ weighted token losses in fp32. `router` (an MoE model's RouterSettings): the
    model also returns its router logits and the micro-batch's router term joins the loss, as in the step
    (`micro_batch` scope, which needs no collective and saves the same tensors as `global`); what it saves
    is counted as `router` in `saved`. `chunk_tokens` > 0: the chunked loss (`chunked_loss_fn`)."""
    from dataclasses import replace

    from isotrain.models.packing_check import lm_forward
    from isotrain.moe.objective import RouterStep
    from isotrain.moe.routing import input_token_mask
    from isotrain.train.chunked_loss import lm_loss_forward
    from isotrain.train.loss import token_losses

    autocast = (torch.autocast(input_ids.device.type, dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
    with autocast:
        if chunk_tokens > 0:
            output = lm_loss_forward(model, input_ids, position_ids, with_mask,
                                     chunked_loss_fn(labels, weights, chunk_tokens, saved),
                                     router_logits=router is not None)
        else:
            output = lm_forward(model, input_ids, position_ids, with_mask, router_logits=router is not None)
    loss = output.loss if chunk_tokens > 0 else (token_losses(output.logits, labels) * weights).sum()
    if router is None:
        return loss
    if saved is not None:
        saved.in_router = True
    step = RouterStep(replace(router, aux_loss_scope="micro_batch"), 1)
    term = step.term(output.router_logits, input_token_mask(torch.zeros_like(labels)), 0)
    if saved is not None:
        saved.in_router = False
    return loss + term
