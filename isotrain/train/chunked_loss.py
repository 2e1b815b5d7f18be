"""SFT cross-entropy over chunks of tokens: no step holds the fp32 logits of a whole micro-batch (`train.loss_chunk_tokens`).

The unchunked loss computes logits = head(h) for every position of a micro-batch, [B, L, V], casts them to fp32
and sums Σ_t w_t ℓ_t (weights: train/loss.py). For V = 128k and one 4k-token row that is 2 GB of fp32 logits, and
as much again for their gradient. The chunked loss computes the same sum

    Σ_t w_t ℓ_t = Σ_c Σ_{t ∈ c} w_t ℓ_t,    ℓ_t = CE(fp32(head(h_t)), y_t)

over chunks c of at most C trained tokens. Only trained tokens (y_t != -100) are taken: the others have ℓ_t = 0
and no gradient, in both paths. Each chunk runs under activation checkpointing: its logits are freed after the
forward and recomputed in backward, so at most one chunk's logits (C × V fp32, and their gradient) exist at a
time. The per-token maths is token_losses' own; only the order of the fp32 sums changes (within rounding), and
the head runs once more per trained token (the recompute).

Where it runs: inside the forward of the model the step calls (DDP, FSDP2's root, peft's wrapper), never after
it. The causal LM is called with `logits_to_keep` = no position, so its head projects 0 tokens; a hook on its
decoder keeps the final hidden states, and a hook on the causal LM itself, placed ahead of FSDP2's post-forward
hook, computes the loss and returns it as the output's `loss`. So FSDP2 still holds the root's parameters (head,
embeddings) gathered when the head runs, registers its pre-backward hook on the loss, and reduce-scatters the
head's gradient with the root's; DDP sees one forward per backward as always. With train.compile the decoder
layers are compiled, never the root as a whole (its hooks change per call: parallel/apply.py), and each chunk's
head and loss are compiled for any chunk length (faster than eager chunks: docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from isotrain.errors import ConfigError
from isotrain.models.packing_check import all_ranks_max, architecture, attention_kwargs, lm_forward
from isotrain.models.unwrap import hf_model, unwrap
from isotrain.train.loss import IGNORE_INDEX, token_losses


def check_chunked_loss_settings(chunk_tokens: int, tp: int) -> None:
    """Before any work: vocabulary-parallel logits (TP) are not chunked."""
    if chunk_tokens > 0 and tp > 1:
        raise ConfigError(f"train.loss_chunk_tokens={chunk_tokens} does not work with parallel.tp={tp} (the logits "
                          "are split over the vocabulary there); set train.loss_chunk_tokens=0 or parallel.tp=1")


def chunk_loss_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Σ_t w_t ℓ_t of one chunk: hidden [n, H], labels and weights [n]; the logits [n, V] live only in here."""
    logits = head(hidden)  # under the step's autocast, if any, as the unchunked forward's head
    with torch.autocast(logits.device.type, enabled=False):  # the unchunked loss runs after autocast's scope
        return (token_losses(logits, labels) * weights).sum()


@functools.cache
def _compiled_chunk_loss_sum():
    """chunk_loss_sum compiled once for any chunk length (dynamic shapes): inductor fuses the log-softmax, the
    target pick and the weights around the head's matmul (the loss alone ran 1.2 x faster than eager here)."""
    return torch.compile(chunk_loss_sum, dynamic=True)


def chunked_loss_sum(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor,
                     chunk_tokens: int, trained: torch.Tensor | None = None, compiled: bool = False) -> torch.Tensor:
    """Σ_t w_t ℓ_t over a micro-batch, at most `chunk_tokens` tokens' logits at a time (forward and backward).

    hidden [B, L, H] (the decoder's final hidden states), labels and weights [B, L] on hidden's device.
    `trained` [n]: the flat positions with a label, if the caller has them without a device read (host labels).
    `compiled`: each chunk's head and loss run compiled (train.compile), else eagerly.
    A micro-batch without trained tokens still runs the head on 0 tokens, so every parameter gets a (zero)
    gradient, as in the unchunked loss (DDP waits for every parameter's gradient)."""
    hidden = hidden.reshape(-1, hidden.shape[-1])
    labels, weights = labels.reshape(-1), weights.reshape(-1)
    if trained is None:
        trained = (labels != IGNORE_INDEX).nonzero().squeeze(-1)
    hidden, labels, weights = hidden.index_select(0, trained), labels[trained], weights[trained]
    loss_sum_fn = _compiled_chunk_loss_sum() if compiled else chunk_loss_sum
    sums = []
    for start in range(0, max(len(trained), 1), chunk_tokens):
        end = start + chunk_tokens
        # preserve_rng_state (the default): a head with dropout (LoRA) draws the same mask in the recompute.
        sums.append(checkpoint(loss_sum_fn, head, hidden[start:end], labels[start:end], weights[start:end],
                               use_reentrant=False))
    return sums[0] if len(sums) == 1 else torch.stack(sums).sum()


def no_positions(device: torch.device) -> torch.Tensor:
    """`logits_to_keep` that keeps no position: the causal LM's head runs on 0 tokens."""
    return torch.empty(0, dtype=torch.long, device=device)


@contextlib.contextmanager
def _loss_in_forward(model: nn.Module, loss_fn):
    """While open, every forward of `model` returns `loss_fn(final hidden states [B, L, H], head)` as its `loss`,
    computed inside the forward of the causal LM (see the module docstring)."""
    lm = hf_model(model)
    decoder = getattr(lm, getattr(lm, "base_model_prefix", "model"))
    captured = []

    def keep_hidden(_module, _args, output):
        captured.append(output[0])  # last_hidden_state, after the final norm

    def attach_loss(_module, _args, output):
        output["loss"] = loss_fn(captured.pop(), lm.get_output_embeddings())
        return output

    handles = [decoder.register_forward_hook(keep_hidden),
               lm.register_forward_hook(attach_loss, prepend=True)]  # ahead of FSDP2's post-forward hook
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def lm_loss_forward(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, with_mask: bool,
                    loss_fn, router_logits: bool = False):
    """`lm_forward` (models/packing_check.py) whose output's `loss` is `loss_fn(hidden, head)` and whose head
    projects no position (`.logits` is [B, 0, V]); `.router_logits` as lm_forward gives them."""
    with _loss_in_forward(model, loss_fn):
        return lm_forward(model, input_ids, position_ids, with_mask, router_logits=router_logits,
                          logits_to_keep=no_positions(input_ids.device))


def sft_chunked_forward(model: nn.Module, mb: dict, weights: torch.Tensor, chunk_tokens: int, with_mask: bool,
                        device: torch.device, router_logits: bool = False, compiled: bool = False):
    """The SFT forward of one micro-batch with the chunked loss: its output, `.loss` = Σ_t w_t ℓ_t.
    `compiled`: the chunks' head and loss are compiled (chunked_loss_sum)."""
    host_labels = mb["labels"]
    trained = (host_labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(-1).to(device)  # host: no device read
    labels = host_labels.to(device)

    def loss_fn(hidden, head):
        return chunked_loss_sum(head, hidden, labels, weights, chunk_tokens, trained, compiled)

    return lm_loss_forward(model, mb["input_ids"].to(device), mb["position_ids"].to(device), with_mask, loss_fn,
                           router_logits)


def stage_chunked_forward(model: nn.Module, inputs: dict, kwargs: dict, labels: torch.Tensor, weights: torch.Tensor,
                          chunk_tokens: int, compiled: bool = False):
    """The last pipeline stage's forward of one micro-batch with the chunked loss (parallel/pp.py StageModule):
    `inputs` its input ids or the previous stage's hidden states, `kwargs` the rest of the model's arguments; the
    output's `.loss` is Σ_t w_t ℓ_t, computed inside the model's forward as `sft_chunked_forward` computes it.
    `labels` [B, L] on the host (the trained positions are found without a device read), `weights` [B, L] on the
    model's device."""
    device = weights.device
    trained = (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(-1).to(device)
    labels = labels.to(device)

    def loss_fn(hidden, head):
        return chunked_loss_sum(head, hidden, labels, weights, chunk_tokens, trained, compiled)

    return stage_loss_forward(model, inputs, kwargs, loss_fn)


def stage_loss_forward(model: nn.Module, inputs: dict, kwargs: dict, loss_fn):
    """A pipeline stage's forward whose head projects no position and whose output's `.loss` is
    `loss_fn(final hidden states [B, L, H], head)` (the memory estimate's fake last stage runs it too)."""
    device = next(iter(inputs.values())).device
    with _loss_in_forward(model, loss_fn):
        return model(**inputs, use_cache=False, logits_to_keep=no_positions(device), **kwargs)


# The probe compares one matmul with itself: any difference is the family's own work on its logits.
PROBE_TOLERANCE = 1e-6


@torch.no_grad()
def check_head_is_linear(model: nn.Module, device: torch.device) -> None:
    """Refuse (ConfigError) a family whose logits are not just its head applied to the final hidden states (a
    softcap, a scale, a cut vocabulary) or whose forward ignores `logits_to_keep`: the chunked loss would
    compute another objective, or no less memory. One forward of 2 rows of 8 tokens with full logits and one
    with the chunked path's hooks, run by every rank with the same inputs (the forwards are collective). A pipeline
    stage (parallel/pp.py) runs its own part: one without the input embedding is given hidden states, and one
    without the head hands them on unchanged, so that the last stage's head is the one probed."""
    lm = hf_model(model)
    position_ids = torch.arange(8, device=device).repeat(2, 1)
    if lm.get_input_embeddings() is None:  # a later pipeline stage
        size, dtype = lm.config.hidden_size, next(lm.parameters()).dtype
        inputs = {"inputs_embeds": torch.linspace(-1, 1, 16 * size, dtype=dtype, device=device).reshape(2, 8, size)}
    else:
        inputs = {"input_ids": (torch.arange(16, device=device).reshape(2, 8) * 7 + 3) % lm.config.vocab_size}
    kwargs = {**inputs, "position_ids": position_ids, **attention_kwargs(model, position_ids, False)}
    training = model.training
    model.eval()
    try:
        with torch.compiler.set_stance("force_eager"):  # as the packing probe: no compilation for the probe's shape
            logits = unwrap(model)(use_cache=False, **kwargs).logits.float()
            with _loss_in_forward(unwrap(model), lambda hidden, head: head(hidden)):
                output = unwrap(model)(use_cache=False, logits_to_keep=no_positions(device), **kwargs)
    finally:
        model.train(training)
    mismatch = float((output.loss.float() - logits).abs().max() / logits.abs().max().clamp(min=1e-12))
    keeps_all = float(output.logits.shape[1] != 0)
    mismatch, keeps_all = all_ranks_max(mismatch, device), all_ranks_max(keeps_all, device)
    name = architecture(model)
    if keeps_all:
        raise ConfigError(f"train.loss_chunk_tokens needs a model whose forward takes logits_to_keep, and {name} "
                          "computes every position's logits anyway; set train.loss_chunk_tokens=0")
    if mismatch > PROBE_TOLERANCE:
        raise ConfigError(f"train.loss_chunk_tokens cannot be used with {name}, whose logits are more than its output "
                          f"layer applied to the final hidden states (relative difference {mismatch:.1e}, e.g. a "
                          "softcap or a scale); set train.loss_chunk_tokens=0")
