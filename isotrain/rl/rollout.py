"""The rollout engine interface and the default in-process engine (our own KV-cache sampling loop).

An engine is anything that samples responses and accepts new weights; the RL loop talks to it
only through `RolloutEngine`, so an external engine (vLLM, SGLang) can replace `HFEngine`
later. The weight contract is the one of `isotrain.models.weights.sync_named_tensors`: Hugging Face
names of the plain causal LM, full logical shapes; `HFEngine` also takes `saved_named_tensors`' keys (a MoE
model's experts one tensor per expert and projection, the keys `save_pretrained` writes), which the RL loop sends so
that no rank gathers a layer's fused experts whole, and answers its checksums under the keys it was sent.

Log-probs: the engine reports, for each response token y_t,

    log p_engine(y_t) = log_softmax(logits_t / T)[y_t]        (T = 1 for greedy)

computed in fp32 from the unprocessed logits, i.e. *before* top-p truncation (what vLLM reports
too). The trainer recomputes the same quantity with its own forward; the two differ only by
numerics (or by stale weights, which is what importance ratios measure).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from transformers import PretrainedConfig, PreTrainedModel

from isotrain.models.expert_keys import Part, expert_format, saved_parts
from isotrain.models.unwrap import unwrap
from isotrain.models.weights import tensor_sha256
from isotrain.parallel.boxes import box_index
from isotrain.rl.decode import sample


@dataclass(frozen=True)
class SamplingParams:
    n: int  # samples per prompt
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    greedy: bool = False  # evaluation: argmax decoding, log-probs at temperature 1
    seed: int | None = None  # sampling seed of this call; a resumed run then redraws exactly the same samples

    def __post_init__(self):
        if self.n < 1 or self.max_new_tokens < 1:
            raise ValueError(f"n={self.n} and max_new_tokens={self.max_new_tokens} must both be at least 1")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 for sampling; use greedy=True instead")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


@dataclass
class Rollout:
    """One row per sample, prompt-major: prompt 0's n samples, then prompt 1's, ..."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]  # cut after (and including) the first EOS; no padding
    response_logprobs: list[list[float]]  # engine log-prob of each response token; same lengths
    truncated: list[bool]  # True when no EOS was produced within max_new_tokens


class RolloutEngine(Protocol):
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Rollout: ...

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face parameter names of the plain causal LM, full logical shapes."""

    def checksums(self) -> dict[str, str]:
        """sha256 hex of each weight (bytes of the fp32 contiguous CPU tensor), by name."""

    def release_memory(self) -> None:
        """Free the weights; generate() raises until update_weights() restored all of them."""

    def close(self) -> None: ...


class HFEngine:
    """Batched KV-cache sampling (`isotrain.rl.decode`) on the engine's own plain copy of the model; CPU OK.

    Sampling draws from torch's global RNG, so a seeded run is reproducible.
    """

    def __init__(self, model: PreTrainedModel, tokenizer, batch_size: int = 64):
        # Its own copy: the trainer keeps training while the engine's weights only change on sync.
        self._setup(_plain_copy(model), tokenizer, batch_size)

    @classmethod
    def from_config(cls, config: PretrainedConfig, tokenizer, batch_size: int = 64) -> HFEngine:
        """An engine with no usable weights yet (all stale): call update_weights before generate."""
        from isotrain.models.build import empty_model

        engine = cls.__new__(cls)
        engine._setup(empty_model(config), tokenizer, batch_size)
        engine.release_memory()  # uninitialised weights must never produce a rollout
        return engine

    def _setup(self, model: PreTrainedModel, tokenizer, batch_size: int) -> None:
        self._model = model.eval().requires_grad_(False)
        for param in self._model.parameters():
            param.grad = None
        self._batch_size = batch_size
        self._pad_id, self._eos_id = _special_ids(tokenizer)
        # Tied weights are one Parameter under several names (named_parameters() lists it once,
        # under its first name); every alias maps to that name.
        self._params = dict(self._model.named_parameters())
        first_name = {id(p): name for name, p in self._params.items()}
        self._aliases = {
            name: first_name[id(p)] for name, p in self._model.named_parameters(remove_duplicate=False)
        }
        self._shapes = {name: p.shape for name, p in self._params.items()}
        self._stale: set[str] = set()
        # Saved keys that name a block of a parameter, or the parameter under another name (models/expert_keys.py):
        # {key: (parameter name, its Part)}; a parameter last filled through them reports checksums by them.
        fmt = expert_format(model.config)
        self._saved_parts = {name: saved_parts(name, tuple(shape), fmt) for name, shape in self._shapes.items()}
        self._part_of = {part.key: (name, part) for name, parts in self._saved_parts.items() for part in parts
                         if len(parts) > 1 or part.key != name}
        self._missing_parts: dict[str, set[str]] = {}  # parameter -> its part keys not received yet in this sync
        self._filled_by_parts: set[str] = set()

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Rollout:
        if self._stale:
            raise RuntimeError(
                f"{len(self._stale)} of {len(self._shapes)} engine weights are stale or released "
                f"(e.g. {sorted(self._stale)[0]}); call update_weights first"
            )
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("generate got an empty prompt; every prompt needs at least one token (e.g. bos)")
        rows = [list(p) for p in prompt_ids for _ in range(params.n)]  # prompt-major order
        rollout = Rollout(rows, [], [], [])
        # A call seed samples from its own RNG stream and leaves the caller's global RNG untouched.
        with torch.random.fork_rng(enabled=params.seed is not None):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            for start in range(0, len(rows), self._batch_size):
                responses, logprobs, truncated = self._generate_batch(rows[start : start + self._batch_size], params)
                rollout.response_ids += responses
                rollout.response_logprobs += logprobs
                rollout.truncated += truncated
        return rollout

    def _generate_batch(self, rows: list[list[int]], params: SamplingParams):
        # Left padding: generation appends on the right.
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([[self._pad_id] * (width - len(r)) + r for r in rows])
        attention_mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        tokens, chosen = sample(
            self._model,
            input_ids,
            attention_mask,
            max_new_tokens=params.max_new_tokens,
            eos_id=self._eos_id,
            pad_id=self._pad_id,
            temperature=params.temperature,
            top_p=params.top_p,
            greedy=params.greedy,
        )
        responses, logprobs, truncated = [], [], []
        for row_tokens, row_logprobs in zip(tokens.tolist(), chosen.tolist()):
            length = row_tokens.index(self._eos_id) + 1 if self._eos_id in row_tokens else None
            responses.append(row_tokens[:length] if length else row_tokens)
            logprobs.append(row_logprobs[:length] if length else row_logprobs)
            truncated.append(length is None)
        return responses, logprobs, truncated

    @torch.no_grad()
    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy tensors into the engine's parameters in place; names may be any alias of a tied weight.

        A bad name or shape stops the update and leaves every weight stale (a half-applied update
        must never produce rollouts) until every weight has been sent again.
        """
        try:
            for name, tensor in named_tensors:
                self._copy_one(name, tensor)
        except BaseException:
            self._stale = set(self._shapes)
            raise

    def _copy_one(self, name: str, tensor: torch.Tensor) -> None:
        target = self._aliases.get(name)
        if target is None and name in self._part_of:
            self._copy_part(*self._part_of[name], tensor)
            return
        if target is None:
            raise ValueError(
                f"update_weights got unknown weight {name!r}; the engine has e.g. {next(iter(self._shapes))!r} "
                "(Hugging Face names of the plain causal LM, as sync_named_tensors yields them)"
            )
        if tuple(tensor.shape) != tuple(self._shapes[target]):
            raise ValueError(
                f"update_weights got {name!r} of shape {tuple(tensor.shape)}, the engine expects "
                f"{tuple(self._shapes[target])} (send full logical shapes, not shards)"
            )
        self._storage(target).copy_(tensor)
        self._stale.discard(target)
        self._filled_by_parts.discard(target)

    def _copy_part(self, target: str, part: Part, tensor: torch.Tensor) -> None:
        """One saved key's block of a parameter; the parameter is stale from its first part of a sync until its last
        arrives (a half-updated fused tensor never samples)."""
        if tuple(tensor.shape) != part.shape:
            raise ValueError(f"update_weights got {part.key!r} of shape {tuple(tensor.shape)}, the engine expects "
                             f"{part.shape} (send full logical shapes, not shards)")
        missing = self._missing_parts.setdefault(target, {p.key for p in self._saved_parts[target]})
        self._stale.add(target)
        block = self._storage(target)[box_index(part.box)]
        block.copy_(tensor.reshape(block.shape))
        missing.discard(part.key)
        if not missing:
            del self._missing_parts[target]
            self._stale.discard(target)
            self._filled_by_parts.add(target)

    def _storage(self, target: str) -> torch.Tensor:
        param = self._params[target]
        if param.shape != self._shapes[target]:
            # Released: rebuild the storage. Assigning .data keeps tied aliases one Parameter.
            param.data = torch.empty(self._shapes[target], dtype=param.dtype, device=param.device)
        return param

    def checksums(self) -> dict[str, str]:
        """sha256 of each weight that holds storage (released ones are left out), by the name it was last sent under:
        a parameter filled through saved keys (a MoE model's experts) by those keys, one checksum per block."""
        sums = {}
        for name, p in self._params.items():
            if p.shape != self._shapes[name]:
                continue
            if name not in self._filled_by_parts:
                sums[name] = tensor_sha256(p)
                continue
            for part in self._saved_parts[name]:
                sums[part.key] = tensor_sha256(p[box_index(part.box)].reshape(part.shape))
        return sums

    def release_memory(self) -> None:
        for param in self._params.values():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        self._stale = set(self._shapes)
        self._missing_parts.clear()

    def close(self) -> None:
        self.release_memory()


def _special_ids(tokenizer) -> tuple[int, int]:
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError("the tokenizer has no eos token; rollouts need one to know where a response ends")
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    return pad_id, eos_id


def _plain_copy(model: torch.nn.Module) -> PreTrainedModel:
    """A deep copy of the plain causal LM behind DDP / peft wrappers (LoRA merged into the copy)."""
    model = unwrap(model)
    if any(hasattr(p, "full_tensor") for p in model.parameters()):
        raise ValueError(
            "HFEngine cannot copy an FSDP2-sharded model; build it with HFEngine.from_config and "
            "send the weights with update_weights(sync_named_tensors(model))"
        )
    if hasattr(model, "merge_and_unload"):
        return copy.deepcopy(model).merge_and_unload()  # a peft model: merge on the copy only
    if any(".base_layer." in name for name, _ in model.named_parameters()):
        raise ValueError("HFEngine got a model with injected LoRA layers; pass the PeftModel or a plain model")
    return copy.deepcopy(model)
