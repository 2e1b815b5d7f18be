"""One micro-batch's forward on fake tensors (no memory, no weights): what a rank keeps for its backward.

The model is the run's own Hugging Face model in the dtype the rank computes in, built under FakeTensorMode,
with transformers' activation checkpointing as parallel/apply.py enables it, run through the same
forward and loss as the SFT step (`forward_loss`). Two things make it the rank's forward and not the whole
model's:

- tensor parallelism: a TP rank runs the same graph on 1/tp of the heads, KV heads, dense MLP width and
  vocabulary (the residual stream stays whole), so the fake model is the config with those four sizes divided
  by tp (head_dim kept); a MoE model's router and experts are replicated over TP and keep their sizes;
- mixed precision: FSDP2 casts the parameters themselves to bf16 (the fake model is built in bf16); without
  FSDP2 the step runs under CPU autocast, which keeps fp32 parameters and makes bf16 copies as it goes.

Fake tensors pick the math SDPA kernel, while real CPU tensors pick the flash kernel, which saves different
tensors (no expanded KV heads, no mask): `_sdpa_as_real` asks the real dispatcher on a small real input
which kernel it would take and calls that one. For a CUDA run (`device="cuda"`), which the estimate may be asked
for on a machine without a GPU, it follows CUDA's order instead (torch's sdp_utils): flash takes fp16/bf16 with
no mask, memory-efficient attention takes fp32 and masks but not grouped-query heads (`enable_gqa`), and math
takes the rest, so fp32 with grouped-query heads saves the [B, H, L, L] attention weights (measured on an H200:
bench/gpu_check.py). Where CUDA takes a fused kernel, the CPU's choice stands in for it: both save the query, key,
value, output and log-sum-exp (bf16 on an H200 measured as estimated this way, to the byte).

Likewise transformers cannot read fake position ids to see that a row holds one document and builds a mask it
would skip for real rows; unpacked rows (`packed=False`) are one document each, so the fake forward tells it so
(`_one_document_per_row`).

Mixture-of-experts layers run transformers' own experts code, except where fake tensors cannot follow it
(memory/fake_experts.py): torch's grouped_mm has no fp32 fake kernel, and expert parallelism's all-to-alls
are sized by the routing, which the fake forward replaces by balanced routing.
"""

from __future__ import annotations

import contextlib
import copy

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from isotrain.memory.fake_cp import context_parallel_on_one_process, piece_length
from isotrain.memory.fake_experts import balance_expert_parallel, grouped_mm_as_saved
from isotrain.memory.saved import SavedBytes, chunked_loss_fn, count_saved, forward_loss
from isotrain.parallel.apply import apply_activation_checkpointing, decoder_layers
from isotrain.parallel.dims import has_dense_mlp

_FLASH = 1  # torch._fused_sdp_choice: SDPBackend.FLASH_ATTENTION


def tp_rank_config(config, tp: int):
    """The config whose full model computes what one TP rank computes (sizes split by parallel/tp.py)."""
    config = copy.deepcopy(config)
    if tp == 1:
        return config
    heads = config.num_attention_heads
    config.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    config.num_attention_heads = heads // tp
    kv = getattr(config, "num_key_value_heads", None) or heads
    config.num_key_value_heads = kv // tp
    if has_dense_mlp(config):  # a MoE model's experts are replicated over TP (Mixtral's intermediate_size is theirs)
        config.intermediate_size //= tp
    config.vocab_size //= tp
    return config


def _small(t: torch.Tensor | None):
    """A real tensor like `t` with at most 4 positions: enough for the dispatcher's kernel choice."""
    if t is None:
        return None
    shape = list(t.shape)
    shape[0] = 1
    shape[-2] = min(shape[-2], 4)
    if t.dim() == 4 and t.shape[-1] == t.shape[-2] or t.dtype == torch.bool:
        shape[-1] = min(shape[-1], 4)
    return torch.zeros(shape, dtype=t.dtype)


def _cuda_takes_fused(query: torch.Tensor, attn_mask, enable_gqa: bool) -> bool:
    """Whether CUDA's SDPA takes flash or memory-efficient attention (else math), for head dims up to 256.
    Under autocast the kernel sees the autocast dtype (SDPA is on its lower-precision list)."""
    if query.shape[-1] > 256:
        return False
    dtype = query.dtype
    if torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)
    flash = dtype in (torch.float16, torch.bfloat16) and attn_mask is None
    return flash or not enable_gqa


@contextlib.contextmanager
def _sdpa_as_real(device: str = "cpu"):
    original = F.scaled_dot_product_attention

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if query.device.type == "cpu":
            if device == "cuda" and not _cuda_takes_fused(query, attn_mask, enable_gqa):
                # CUDA's math kernel, a composite: autograd saves each of its steps, the attention weights too.
                out, _ = torch.ops.aten._scaled_dot_product_attention_math(
                    query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
                return out
            with unset_fake_temporarily():
                q, k, v = _small(query), _small(key), _small(value)
                mask = None if attn_mask is None else _small(attn_mask)
                choice = torch._fused_sdp_choice(q, k, v, mask, dropout_p, is_causal, scale=scale,
                                                 enable_gqa=enable_gqa)
            if choice == _FLASH:
                out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
                return out
        return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def _one_document_per_row(enabled: bool):
    import transformers.masking_utils as masking

    original = masking.find_packed_sequence_indices
    if enabled:
        masking.find_packed_sequence_indices = lambda position_ids: None  # what it returns for arange rows
    try:
        yield
    finally:
        masking.find_packed_sequence_indices = original


def fake_forward(config, attn_implementation: str, *, micro_batch_size: int, seq_len: int, tp: int,
                 param_dtype: torch.dtype, autocast_dtype: torch.dtype | None,
                 activation_checkpointing: bool, packed: bool = False, ep: int = 1, router=None,
                 chunk_tokens: int = 0, device: str = "cpu", cp: int = 1,
                 cp_style: str = "ulysses") -> SavedBytes:
    """What one rank's forward of a full micro-batch (every position a trained token) keeps for backward.
    `ep`: the expert-parallel degree; `router`: an MoE model's RouterSettings (its router terms join the loss);
    `chunk_tokens`: train.loss_chunk_tokens; `device`: where the run computes ("cpu" or "cuda"), which decides
    the attention kernel; `cp`, `cp_style`: context parallelism (memory/fake_cp.py: the rank's piece of every row,
    attention by the style's own code; `saved.exchange_bytes` gets its exchange buffers)."""
    from transformers import AutoModelForCausalLM

    config = tp_rank_config(config, tp)
    with (FakeTensorMode(allow_non_fake_inputs=True), _sdpa_as_real(device), _one_document_per_row(not packed),
          grouped_mm_as_saved(), contextlib.ExitStack() as stack):
        model = AutoModelForCausalLM.from_config(config, dtype=param_dtype, attn_implementation=attn_implementation)
        model.config.use_cache = False
        if ep > 1:
            balance_expert_parallel(model, ep)
        if activation_checkpointing:
            apply_activation_checkpointing(model)
        model.train()
        exchange = None
        if cp > 1:
            exchange = stack.enter_context(context_parallel_on_one_process(model, cp, cp_style, micro_batch_size,
                                                                           seq_len))
            seq_len = piece_length(seq_len, cp, cp_style)
        input_ids = torch.zeros(micro_batch_size, seq_len, dtype=torch.long)
        # Separate [B, L] tensors, as the collated batch holds them (data/collate.py).
        position_ids = torch.arange(seq_len).expand(micro_batch_size, seq_len).contiguous()
        labels = torch.zeros(micro_batch_size, seq_len, dtype=torch.long)
        weights = torch.ones(micro_batch_size, seq_len)
        with count_saved(model, decoder_layers(model)) as saved:
            forward_loss(model, input_ids, position_ids, labels, weights, autocast_dtype, router=router, saved=saved,
                         chunk_tokens=chunk_tokens)
    saved.exchange_bytes = exchange.bytes if exchange is not None else 0
    return saved


class _Registered(torch.autograd.Function):
    """The identity, as FSDP2's RegisterPostBackwardFunction is on a root's forward inputs."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


def _stage_owner(saved: SavedBytes, router, labels, weights, chunk_tokens: int):
    """What the step's Pipeline gives a StageModule (parallel/pp.py): `router_fn`, which attaches an MoE stage's router
    terms of its layers to its output (counted as `router`: train/pipeline_step.py; `micro_batch` scope, as
    `forward_loss`), and the chunked loss's `head_loss` (`chunked_loss_fn`)."""
    from dataclasses import replace
    from types import SimpleNamespace

    from isotrain.moe.objective import RouterStep
    from isotrain.parallel.pp import with_side_loss
    from isotrain.train.chunked_loss import stage_loss_forward

    def router_fn(output, router_logits, mask):
        saved.in_router = True
        term = RouterStep(replace(router, aux_loss_scope="micro_batch"), 1).term(router_logits, mask, 0)
        saved.in_router = False
        return with_side_loss(output, term)

    def head_loss(model, inputs, kwargs, index):
        return stage_loss_forward(model, inputs, kwargs, chunked_loss_fn(labels, weights, chunk_tokens, saved))

    return SimpleNamespace(router_fn=router_fn, head_loss=head_loss if chunk_tokens else None,
                           forward_only=False)


def fake_stage_forward(config, attn_implementation: str, *, stage: int, pp: int, micro_batch_size: int,
                       seq_len: int, autocast_dtype: torch.dtype | None, activation_checkpointing: bool,
                       device: str = "cpu", param_dtype: torch.dtype = torch.float32, tp: int = 1,
                       fsdp: bool = False, split=None, chunk_tokens: int = 0, ep: int = 1,
                       router=None) -> tuple[SavedBytes, int, int]:
    """What one micro-batch's forward of pipeline stage `stage` of `pp` (its layers: `split`, parallel.pp_split, or
    an even share) keeps for its backward (parallel/pp.py: the
    Hugging Face model reduced to the stage, run by the schedule's `StageModule`, the last stage's loss after it),
    with (bytes of the hidden states it receives, bytes of what it sends on; 0 at the first / last stage). The
    received hidden states are the schedule's receive buffer, counted with those (memory/pipeline.py), not here.
    `param_dtype`: FSDP2's compute dtype (its stage computes, and sends, in it); `tp`: one TP rank's share of the
    heads, MLP width and vocabulary (`tp_rank_config`, as `fake_forward`). `fsdp`: FSDP2's root registers its
    post-backward on the stage's inputs through an identity autograd function, so what the stage makes of the
    received hidden states (a norm's fp32 upcast) is an activation, not a cast of a leaf (a weight copy).
    `chunk_tokens` (train.loss_chunk_tokens): the last stage computes its loss in chunks inside its forward, as the
    step's `head_loss` does (`chunked_loss_fn`: the kept hidden states and one chunk's head and loss). `ep`, `router`:
    an MoE model's expert-parallel degree (the stage's experts over its EP group, balanced routing, as `fake_forward`)
    and its RouterSettings (the stage's router terms, counted as `router`)."""
    from transformers import AutoModelForCausalLM

    from isotrain.moe.routing import input_token_mask
    from isotrain.parallel.pp import PassThrough, StageModule, apply_pp
    from isotrain.train.loss import loss_weights, token_losses

    autocast = (torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype is not None
                else contextlib.nullcontext())
    config = tp_rank_config(config, tp)
    with (FakeTensorMode(allow_non_fake_inputs=True), _sdpa_as_real(device), _one_document_per_row(True),
          grouped_mm_as_saved()):
        model = AutoModelForCausalLM.from_config(config, dtype=param_dtype, attn_implementation=attn_implementation)
        model.config.use_cache = False
        apply_pp(model, stage, pp, split=split)  # first, as parallel/apply.py does
        if ep > 1:
            balance_expert_parallel(model, ep)
        if activation_checkpointing:
            apply_activation_checkpointing(model)
        model.train()
        position_ids = torch.arange(seq_len).expand(micro_batch_size, seq_len).contiguous()
        received = 0
        if stage == 0:
            x = torch.zeros(micro_batch_size, seq_len, dtype=torch.long)
        else:  # the residual stream between stages: fp32 under autocast (it leaves the residual adds), or FSDP2's dtype
            x = torch.zeros(micro_batch_size, seq_len, config.hidden_size, dtype=param_dtype, requires_grad=True)
            received = x.nbytes
        labels, segments = torch.zeros(2, micro_batch_size, seq_len, dtype=torch.long)
        weights, _ = loss_weights(labels, segments, "token")
        kwargs = {"position_ids": position_ids, "micro_batch": 0 if chunk_tokens else None,
                  "router_mask": input_token_mask(segments) if router is not None else None}
        own = [layer for layer in decoder_layers(model) if not isinstance(layer, PassThrough)]
        with count_saved(model, own) as saved:
            module = StageModule(model, stage, pp, owner=_stage_owner(saved, router, labels, weights, chunk_tokens))
            if stage > 0:
                saved.skip(x)  # the receive buffer: counted with the pipeline's buffers
            with autocast:
                output = module(_Registered.apply(x) if fsdp and stage > 0 else x, **kwargs)
                if stage == pp - 1:  # the step's loss_fn (train/pipeline_step.py): target = [labels, segment ids]
                    weighted = output if chunk_tokens else (token_losses(output, labels) * weights).sum()
                    weighted / torch.ones((), dtype=torch.long)
        sent = output.nbytes if stage < pp - 1 else 0
        for t in (value for value in kwargs.values() if isinstance(value, torch.Tensor)):
            key = t.untyped_storage()._cdata
            if key in saved.kinds:
                kind = saved.kinds[key]
                saved.stage_inputs[kind] = saved.stage_inputs.get(kind, 0) + saved.storages[key].nbytes()
    return saved, received, sent


@contextlib.contextmanager
def _rows_without_padding():
    """Rows holding real tokens only. Transformers reads a real padding mask of all ones and drops it (no mask: the
    fused or causal kernel), but cannot read a fake one, so it would build a [B, 1, L, L] mask the real forward does
    not have; its skip checks are asked as for no padding mask, which is what an all-ones mask means."""
    import transformers.masking_utils as masking

    causal, bidirectional = masking._ignore_causal_mask_sdpa, masking._ignore_bidirectional_mask_sdpa
    masking._ignore_causal_mask_sdpa = lambda padding_mask, *args, **kwargs: causal(None, *args, **kwargs)
    masking._ignore_bidirectional_mask_sdpa = lambda padding_mask, *args, **kwargs: bidirectional(None, *args,
                                                                                                   **kwargs)
    try:
        yield
    finally:
        masking._ignore_causal_mask_sdpa, masking._ignore_bidirectional_mask_sdpa = causal, bidirectional


@contextlib.contextmanager
def _keyed_dropout_on_full_rows():
    """embed/dropout.py reads each row's real span off the attention mask (a data-dependent read that fake tensors
    cannot do); every row is all real tokens here, so its span is the whole row. The masks it then draws, and the
    float multipliers it keeps for backward, are the real forward's."""
    import isotrain.embed.dropout as dropout

    original = dropout.row_spans
    dropout.row_spans = lambda attention_mask: [(0, attention_mask.shape[1])] * attention_mask.shape[0]
    try:
        yield
    finally:
        dropout.row_spans = original


def fake_encode(config, attn_implementation: str, *, num_texts: int, seq_len: int, pooling: str,
                padding_side: str = "right", device: str = "cpu", param_dtype: torch.dtype = torch.float32,
                autocast_dtype: torch.dtype | None = None, activation_checkpointing: bool = False) -> SavedBytes:
    """What one forward with gradient of GradCache's second pass (embed/gradcache.py, step 4) keeps for its
    backward: `num_texts` texts of `seq_len` real tokens each through the recipe's own `encode_chunk` (the base
    model in train mode: dropout keyed per text, eager attention while the model has attention dropout), then the
    product with their rows of the gradient cache (`cached_surrogate`). Mixed precision as in `fake_forward`: bf16
    parameters under FSDP2 (`param_dtype`), else autocast (`autocast_dtype`) over fp32 ones; with
    `activation_checkpointing`, each encoder layer as the recipe checkpoints it (embed/model.py).
    `device` ("cpu" or "cuda") decides the attention kernel, as in `fake_forward`."""
    from transformers import AutoModel

    from isotrain.embed.dropout import checkpoint_contexts
    from isotrain.embed.encode import EncodeOptions, encode_chunk
    from isotrain.embed.gradcache import cached_surrogate
    from isotrain.embed.model import freeze_pooler

    with (FakeTensorMode(allow_non_fake_inputs=True), _sdpa_as_real(device), _rows_without_padding(),
          _keyed_dropout_on_full_rows()):
        model = AutoModel.from_config(config, dtype=param_dtype, attn_implementation=attn_implementation)
        model.config.use_cache = False
        freeze_pooler(model)
        if activation_checkpointing:
            apply_activation_checkpointing(model, checkpoint_contexts)
        model.train()
        options = EncodeOptions(pooling=pooling, padding_side=padding_side, autocast_dtype=autocast_dtype)
        texts = list(range(num_texts))
        with count_saved(model, decoder_layers(model)) as saved:
            vectors = encode_chunk(model, [[0] * seq_len for _ in texts], texts, options, torch.device("cpu"))
            cached_surrogate(vectors, torch.zeros(num_texts, vectors.shape[-1]), texts)
    return saved
