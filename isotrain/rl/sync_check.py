"""Proof that an external rollout engine samples with the trainer's current weights, after every sync.

Two checks, both before any sample of the new policy is trained on (invariant 9):
1. checksums: the sha256 of every tensor the trainer sent (computed while sending, fp32 bytes,
   models/weights.py's definition) must equal what the engine reports it loaded, name for name. This
   proves the transport: no bucket lost, reordered, truncated or skipped, no tensor left out.
2. the probe: the engine decodes one prompt greedily with what it now holds, and its log-probs of that
   sequence must equal the trainer's own forward's, max_t |log p_engine(y_t) - log p_trainer(y_t)| <=
   max_diff (log-probs at T = 1, rl/rollout.py's definition). This proves the weights are *used*: loaded
   into the right slots, with the right layout (fused projections, tied head), the prefix cache reset.
A failure raises TrainingError (one sentence) and the run stops before training on stale samples. With LoRA sent
as adapters (`sync_adapter_and_verify`) the checksums cover the base weights at the start and the adapter's
tensors at every sync, and the probe compares the engine's adapter with the trainer's peft forward.

The engine gets the weights under the keys `save_pretrained` writes (`saved_named_tensors`: a MoE model's experts one
tensor per expert, gathered one expert at a time from the expert-parallel or FSDP2 shards), the names vLLM's loaders
take from a Hugging Face checkpoint; the checksums cover each expert's tensors under its global id.

Every rank runs the same calls (saved_named_tensors and the probe's forward are collectives under FSDP2 and EP).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from isotrain.errors import TrainingError
from isotrain.models.weights import saved_named_tensors, tensor_sha256
from isotrain.rl.experience import RolloutBatch, response_logprobs
from isotrain.rl.rollout import SamplingParams


def recording_checksums(named_tensors: Iterable[tuple[str, torch.Tensor]], into: dict) -> Iterator:
    """The tensors unchanged; each one's sha256 is recorded in `into` as it passes."""
    for name, tensor in named_tensors:
        into[name] = tensor_sha256(tensor)
        yield name, tensor


def check_checksums(trainer: dict[str, str], engine: dict[str, str], when: str) -> None:
    differ = sorted(name for name in trainer.keys() | engine.keys() if trainer.get(name) != engine.get(name))
    if differ:
        raise TrainingError(
            f"{when}, the rollout engine's weights differ from the trainer's in {len(differ)} of {len(trainer)} "
            f"tensors (e.g. {differ[0]}): it would sample with stale or corrupted weights, so the run stops before "
            "training on them; check the engine's log and rerun (checkpoint.resume=auto continues from the last save)"
        )


def probe(engine, model, prompt_ids: list[int], max_new_tokens: int, max_diff: float, device, when: str,
          autocast_dtype=None, layout=None) -> float:
    """Greedy-decode `prompt_ids` on the engine, score the result with `model`; the largest |Δ log p|."""
    out = engine.generate([prompt_ids], SamplingParams(n=1, max_new_tokens=max_new_tokens, greedy=True))
    batch = RolloutBatch([0], out.prompt_ids, out.response_ids, out.response_logprobs, out.truncated, [0.0], [0.0])
    kwargs = {"layout": layout} if layout is not None else {}
    was_training = model.training
    model.eval()
    try:
        trainer = response_logprobs(model, batch, pad_id=0, micro_batch_size=1, temperature=1.0, device=device,
                                    autocast_dtype=autocast_dtype, **kwargs)[0]
    finally:
        model.train(was_training)
        _reshard(model)
    gap = max((abs(a - b) for a, b in zip(out.response_logprobs[0], trainer)), default=0.0)
    if not gap <= max_diff:  # also NaN
        raise TrainingError(
            f"{when}, the rollout engine's log-probs of a probe sequence differ from the trainer's by up to {gap:.3g} "
            f"(rollout.vllm.probe_max_diff={max_diff:g}): it samples with other weights than the trainer holds, so "
            "the run stops before training on them; check the engine's log, or raise probe_max_diff for a "
            "lower-precision engine"
        )
    return gap


def _reshard(model) -> None:
    """Free the parameters the probe's forward gathered (a forward without a backward leaves FSDP2 modules gathered),
    so that the next step starts from the shards, as models/packing_check.py does after its probe: left gathered
    under FSDP2 2 × TP 2 (with or without EP), the backward of the step after the first sync's probe failed
    ("Trying to resize storage that is not resizable") in `isotrain rl rollout.engine=vllm`."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def sync_adapter_and_verify(engine, model, with_base: bool, probe_prompt: list[int], max_new_tokens: int,
                            max_diff: float, device, when: str, autocast_dtype=None, layout=None) -> float:
    """LoRA as adapters: the base weights (adapters off) only when `with_base` (the start), then the adapter alone, as
    a new adapter version; the checksums of both and the probe (the engine's adapter against the trainer's peft
    forward) as in sync_and_verify."""
    from isotrain.models.lora import adapter_state_dict, reference_logits_context, save_adapter

    if with_base:
        sent: dict[str, str] = {}
        with reference_logits_context(model):
            engine.update_weights(recording_checksums(saved_named_tensors(model), sent))
        check_checksums(sent, engine.checksums(), when)
    loaded = engine.update_adapter(lambda directory: save_adapter(model, directory))
    check_checksums({name: tensor_sha256(t) for name, t in adapter_state_dict(model).items()}, loaded, when)
    return probe(engine, model, probe_prompt, max_new_tokens, max_diff, device, when, autocast_dtype, layout)


def sync_and_verify(engine, model, probe_prompt: list[int], max_new_tokens: int, max_diff: float, device, when: str,
                    autocast_dtype=None, layout=None) -> float:
    """Send the trainer's weights to the engine, then both checks; returns the probe's largest |Δ log p|."""
    sent: dict[str, str] = {}
    engine.update_weights(recording_checksums(saved_named_tensors(model), sent))
    check_checksums(sent, engine.checksums(), when)
    return probe(engine, model, probe_prompt, max_new_tokens, max_diff, device, when, autocast_dtype, layout)
