"""Do packed documents stay apart in this model? Decided once per run, on the run's own model, before step 1.

A packed sample marks where each document starts only by restarting its position ids at 0, and the forward
gets no attention mask. Most transformers families read those restarts as document boundaries
(`masking_utils.find_packed_sequence_indices`) and mask attention across them. A family that builds its
causal mask without position ids (OPT) lets each document attend to the ones packed before it: the loss is
silently that of another objective. So the run probes its model:

    two documents A, B: rows [A B], [A pad], [B pad] in one forward (pad continues the last document)
    mismatch = max |logits(A or B packed) - logits(same document alone)| / max |logits alone|

mismatch <= tolerance: positions suffice. Otherwise isotrain passes its own per-document causal mask and
probes again; if that does not match either, packing is refused before any step. The probe is a single
forward of 3 rows of 9 tokens (twice at most), run by every rank with the same inputs, so it is also correct
for FSDP2 / TP / EP layouts, whose forwards are collective. Under pipeline parallelism no rank holds the whole
model: the probe runs through the stages (parallel/pp.py `Pipeline.logits`), its position ids and mask given to
every stage as a training step gives them, and the rank of the last stage measures the mismatch (the others
count 0 in the maximum over ranks). So it also proves that every stage's attention sees the boundaries.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from isotrain.errors import ConfigError
from isotrain.models import varlen
from isotrain.models.unwrap import hf_model, unwrap

# Relative tolerances of the probe, by the dtype its matmuls run in. The probe runs in fp32 unless FSDP2
# casts the parameters to bf16 (autocast is simply not entered). An honouring model matches to rounding:
# measured 0 to 3e-7 (fp32) and 0 (bf16, CPU) on tiny models of every supported family. A leak is much
# larger, but can be small at initialisation: 0.26-0.62 (OPT, MPT, Falcon), 0.022 (XGLM), 0.010 (BLOOM, whose
# ALiBi bias damps attention to the earlier document). fp32: 1e-4 (~800 ulps of 2^-23) is 100x below the
# smallest leak; bf16: 4e-3 (one ulp, 2^-8) is still 2.5x below it.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 4e-3}

# Token ids of the two probe documents, before `% vocab_size`: distinct, so attending to the other
# document changes what a token sees.
_DOC_A = (5, 9, 17, 33, 2)
_DOC_B = (40, 7, 61, 11)


def segment_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, L] document index of every token: a new document starts wherever the position id does not
    go up by exactly 1 (the rule transformers uses, so the padding that continues the count belongs to
    the last document)."""
    step = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)
    return (step != 1).cumsum(-1)


def document_mask(position_ids: torch.Tensor, attn_implementation: str) -> torch.Tensor:
    """[B, 1, L, L] per-document causal mask: query i sees key j iff j <= i and both are in one document.

    sdpa takes a boolean mask (True = attend); eager adds the mask to the scores, so it gets 0 / -inf
    (finfo.min, which stays finite when added to bf16 scores promoted to fp32).
    """
    segments = segment_ids(position_ids)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (segments[:, :, None] == segments[:, None, :]) & causal
    allowed = allowed[:, None]
    if attn_implementation == "sdpa":
        return allowed
    minimum = torch.finfo(torch.float32).min
    return torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill(~allowed, minimum)


def lm_logits(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, with_mask: bool):
    """The forward every packed SFT batch goes through: logits [B, L, V] (a DTensor under TP loss_parallel).

    use_cache=False: with a KV cache transformers stops detecting packed documents. `with_mask`: the model
    ignores position restarts, so isotrain passes the per-document mask itself."""
    return lm_forward(model, input_ids, position_ids, with_mask).logits


def attention_kwargs(model: nn.Module, position_ids: torch.Tensor, with_mask: bool) -> dict:
    """The forward arguments that keep packed documents apart, as `lm_forward` passes them: the varlen kernel's
    document bounds, and with `with_mask` isotrain's per-document mask."""
    kwargs = {}
    if hf_model(model).config._attn_implementation == varlen.NAME:
        kwargs.update(varlen.document_bounds(position_ids))
    if with_mask:
        kwargs["attention_mask"] = document_mask(position_ids, hf_model(model).config._attn_implementation)
    return kwargs


def lm_forward(model: nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor, with_mask: bool,
               router_logits: bool = False, logits_to_keep: torch.Tensor | None = None):
    """`lm_logits`' forward, returning the model output; `router_logits`: an MoE model also returns its
    routers' logits (`.router_logits`, one [B·L, E] tensor per MoE layer). No labels are passed, so
    transformers adds no aux loss of its own (isotrain forms it: isotrain/moe/). `logits_to_keep`: the
    positions whose logits the head computes (transformers' argument; default every position)."""
    kwargs = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
    kwargs.update(attention_kwargs(model, position_ids, with_mask))
    if router_logits:
        kwargs["output_router_logits"] = True
    return model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **kwargs)


def _probe_batch(vocab_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and position_ids [3, |A|+|B|] of the rows [A B], [A pad], [B pad]."""
    a = [t % vocab_size for t in _DOC_A]
    b = [t % vocab_size for t in _DOC_B]
    length = len(a) + len(b)
    pad = [a[-1]] * length  # any id: the padding continues the document before it
    input_ids = torch.tensor([a + b, (a + pad)[:length], (b + pad)[:length]], device=device)
    restart = list(range(len(a))) + list(range(len(b)))
    position_ids = torch.tensor([restart, list(range(length)), list(range(length))], device=device)
    return input_ids, position_ids


def all_ranks_max(value: float, device: torch.device) -> float:
    """The largest value over all ranks, so every rank takes the same decision (one diverging rank would
    leave the others waiting in the first training collective)."""
    if not dist.is_initialized():
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


@torch.no_grad()
def probe_mismatch(model: nn.Module, with_mask: bool, device: torch.device, pipeline=None) -> float:
    """max |logits packed - logits alone| / max |logits alone| over both documents, on every rank. `pipeline`: this
    rank's stages (parallel/pp.py Pipeline) under pipeline parallelism, else None."""
    from isotrain.parallel.tp import full_logits

    input_ids, position_ids = _probe_batch(hf_model(model).config.vocab_size, device)
    # Compiled layers run eagerly here: compiling for the probe's shape would cost a compilation and change
    # which shapes the training steps compile for; what the probe tests (the masking) is the same code.
    with torch.compiler.set_stance("force_eager"):
        if pipeline is None:
            logits = lm_logits(unwrap(model), input_ids, position_ids, with_mask)
        else:
            kwargs = {"position_ids": position_ids, **attention_kwargs(model, position_ids, with_mask)}
            logits = pipeline.logits(hf_model(model), input_ids, kwargs, device)
    if logits is None:  # a pipeline rank without the last stage: the last stage's rank measures
        return all_ranks_max(0.0, device)
    logits = full_logits(logits).float()
    n = len(_DOC_A)
    packed = torch.cat([logits[0, :n], logits[0, n:]])
    alone = torch.cat([logits[1, :n], logits[2, : logits.shape[1] - n]])
    mismatch = float((packed - alone).abs().max() / alone.abs().max().clamp(min=1e-12))
    return all_ranks_max(mismatch, device)


def check_packing(model: nn.Module, device: torch.device, compute_dtype: torch.dtype = torch.float32,
                  pipeline=None) -> bool:
    """Whether packed batches need isotrain's per-document mask (False: position ids suffice).

    `compute_dtype`: what the probe's matmuls run in (bf16 only when FSDP2 casts the parameters); it picks
    the tolerance. `pipeline`: this rank's stages under pipeline parallelism (probe_mismatch). Runs in eval
    mode (no dropout, no router noise: nothing is drawn from the RNGs, so a seeded or resumed run's random
    stream is unchanged) and restores the training mode. Raises ConfigError when neither positions nor the
    mask keep the documents apart.
    """
    tolerance = TOLERANCE[compute_dtype]
    training = model.training
    model.eval()
    try:
        if probe_mismatch(model, False, device, pipeline) <= tolerance:
            return False
        if _mask_supported(model) and _masked_mismatch(model, device, pipeline) <= tolerance:
            return True
    finally:
        model.train(training)
        _reshard(model)
    name = architecture(model)
    raise ConfigError(f"data.packing=true would let packed documents attend to each other in {name}, which "
                      "ignores the position-id restarts that mark them and cannot take isotrain's per-document "
                      "attention mask; set data.packing=false")


def _reshard(model: nn.Module) -> None:
    """Free the parameters that the probe's forwards gathered. A forward without a backward leaves FSDP2 modules
    gathered, and the training steps must start from the shards, as torch's pipelining reshards after its own
    forward-only shape inference: left gathered, FSDP2 2 and PP 2 × FSDP2 2 runs on packed data ended 3 steps with
    weights 1e-2 (token mean) to 0.13 (sequence mean) away from one process's
    (tests/train/test_pipeline_parallel.py)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _masked_mismatch(model: nn.Module, device: torch.device, pipeline=None) -> float:
    """The probe with isotrain's mask; a family whose attention cannot take a 4-D mask (BLOOM's ALiBi code
    unpacks a 2-D one) fails the same way on every rank and counts as not keeping documents apart."""
    try:
        return probe_mismatch(model, True, device, pipeline)
    except (RuntimeError, ValueError, TypeError, IndexError):
        return float("inf")


def packing_needs_mask(packing: bool, model_dtype: str, model: nn.Module, parallel, device: torch.device,
                       log) -> bool:
    """The run's decision, before any step: False when `packing` (data.packing) is off or positions suffice, True
    when the step must pass isotrain's mask; ConfigError when packing cannot be kept exact. `model_dtype`:
    model.dtype."""
    if not packing:
        return False
    from isotrain.parallel.pp import Pipeline

    needs_mask = check_packing(model, device, probe_dtype(model_dtype, parallel), Pipeline.of(parallel))
    name = architecture(model)
    if needs_mask:
        log(f"packing: {name} ignores position-id restarts; isotrain passes a per-document attention mask "
            "(probe: packed == unpacked)")
    else:
        log(f"packing: {name} keeps packed documents apart by their position ids (probe: packed == unpacked)")
    return needs_mask


def probe_dtype(model_dtype: str, parallel) -> torch.dtype:
    """What the probe's matmuls run in: FSDP2 runs the forward in bf16 (its mixed-precision policy); elsewhere
    bf16 is autocast by the step, which the probe does not enter, so it compares in fp32."""
    fsdp_bf16 = model_dtype == "bfloat16" and parallel.dims.fsdp
    return torch.bfloat16 if fsdp_bf16 else torch.float32


def architecture(model: nn.Module) -> str:
    """The transformers class of the model, e.g. OPTForCausalLM (FSDP2 subclasses it as FSDPOPTForCausalLM)."""
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(hf_model(model)).__mro__ if not issubclass(cls, FSDPModule)).__name__


def _mask_supported(model: nn.Module) -> bool:
    """isotrain's mask is written for sdpa and eager attention, and has no sliding window: a family with a
    window would silently lose it, so such a family is refused rather than masked."""
    config = hf_model(model).config
    return config._attn_implementation in ("sdpa", "eager") and not getattr(config, "sliding_window", None)
