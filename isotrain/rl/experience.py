"""A rollout as the trainer sees it: every sample of an RL step, then tensors for the loss.

Every rank generates for its own prompts, then all ranks exchange their samples, so each holds
the whole rollout in prompt-major order (sample i belongs to group i // n). Advantages and the
split into mini-batches are then computed identically everywhere, from data that does not depend
on the layout.

Token alignment (targets are pre-shifted, as in SFT): a sample is prompt (p tokens) + response
(r tokens); position t predicts token t + 1, so response token j is scored at position p - 1 + j.
Per-token arrays of the response (log-probs, advantages) are placed at those positions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.distributed as dist

from isotrain.rl.algos import token_logprobs


@dataclass
class RolloutBatch:
    prompt_index: list[int]  # row of the prompt file
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    engine_logprobs: list[list[float]]
    truncated: list[bool]
    scores: list[float]  # the reward function's value
    rewards: list[float]  # after overlong shaping: what advantages are computed from

    def __len__(self) -> int:
        return len(self.prompt_ids)

    def select(self, indices) -> RolloutBatch:
        return RolloutBatch(**{f.name: [getattr(self, f.name)[i] for i in indices] for f in fields(self)})

    @classmethod
    def concat(cls, parts: list[RolloutBatch]) -> RolloutBatch:
        return cls(**{f.name: [x for part in parts for x in getattr(part, f.name)] for f in fields(cls)})


def all_gather_rollout(local: RolloutBatch, group=None) -> RolloutBatch:
    """Every DP rank's samples, in DP-rank order (= prompt order, since DP rank r drew the r-th slice).
    `group` is the DP group: TP ranks of one DP rank hold the same samples and must not add them twice."""
    return RolloutBatch.concat(_gather(local, group))


def all_gather_lists(local: list, group=None) -> list:
    """Concatenate per-DP-rank lists (e.g. per-sample log-probs) in DP-rank order."""
    return [x for part in _gather(local, group) for x in part]


def _gather(local, group) -> list:
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [local]
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, local, group=group)
    return parts


def _place(rows: list[list[float]], prompt_lens: list[int], length: int) -> torch.Tensor:
    out = np.zeros((len(rows), length), dtype=np.float32)
    for i, (row, p) in enumerate(zip(rows, prompt_lens)):
        out[i, p - 1 : p - 1 + len(row)] = row
    return torch.from_numpy(out)


def make_micro_batch(batch: RolloutBatch, pad_id: int, mask_truncated: bool,
                     per_token: dict[str, list[list[float]] | None]) -> dict:
    """Right-padded tensors [B, L] of some samples: input_ids, position_ids, targets, mask and the per-token arrays.

    No attention mask: causal attention keeps real tokens from seeing the padding after them, and
    position ids keep counting through the padding, exactly as SFT batches do.
    """
    prompt_lens = [len(p) for p in batch.prompt_ids]
    sequences = [p + r for p, r in zip(batch.prompt_ids, batch.response_ids)]
    length = max(len(s) for s in sequences)
    input_ids = np.full((len(sequences), length), pad_id, dtype=np.int64)
    targets = np.zeros((len(sequences), length), dtype=np.int64)
    mask = np.zeros((len(sequences), length), dtype=np.float32)
    for i, (seq, p) in enumerate(zip(sequences, prompt_lens)):
        input_ids[i, : len(seq)] = seq
        targets[i, : len(seq) - 1] = seq[1:]
        if not (mask_truncated and batch.truncated[i]):
            mask[i, p - 1 : len(seq) - 1] = 1.0
    mb = {
        "input_ids": torch.from_numpy(input_ids),
        "position_ids": torch.arange(length).expand(len(sequences), length).contiguous(),
        "targets": torch.from_numpy(targets),
        "mask": torch.from_numpy(mask),
        "num_input_tokens": sum(len(s) for s in sequences),
    }
    for name, rows in per_token.items():
        mb[name] = _place(rows, prompt_lens, length) if rows is not None else None
    return mb


@torch.no_grad()
def per_response_token(batch: RolloutBatch, pad_id: int, micro_batch_size: int, device: torch.device,
                       autocast_dtype, score) -> list[list[float]]:
    """`score(mb)` -> [B, L] values per position, run micro-batch by micro-batch under the run's autocast;
    returns each sample's values at its response tokens (response coordinates)."""
    out: list[list[float]] = []
    for start in range(0, len(batch), micro_batch_size):
        part = batch.select(range(start, min(start + micro_batch_size, len(batch))))
        mb = make_micro_batch(part, pad_id, False, {})
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            values = score(mb).float().cpu()
        for i, (prompt, response) in enumerate(zip(part.prompt_ids, part.response_ids)):
            p = len(prompt)
            out.append(values[i, p - 1 : p - 1 + len(response)].tolist())
    return out


def response_logprobs(model, batch: RolloutBatch, pad_id: int, micro_batch_size: int, temperature: float,
                      device: torch.device, autocast_dtype=None) -> list[list[float]]:
    """Each sample's log-prob of every response token under `model` (the sampling distribution at `temperature`)."""

    def score(mb: dict) -> torch.Tensor:
        logits = model(input_ids=mb["input_ids"].to(device), position_ids=mb["position_ids"].to(device),
                       use_cache=False).logits
        return token_logprobs(logits, mb["targets"].to(device), temperature)

    return per_response_token(batch, pad_id, micro_batch_size, device, autocast_dtype, score)
