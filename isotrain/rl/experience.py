"""A rollout as the trainer sees it: every sample of an RL step, then tensors for the loss.

Every rank generates for its own prompts, then all ranks exchange their samples, so each holds
the whole rollout in prompt-major order (sample i belongs to group i // n). Advantages and the
split into mini-batches are then computed identically everywhere, from data that does not depend
on the layout.

Token alignment (targets are pre-shifted, as in SFT): a sample is prompt (p tokens) + response
(r tokens); position t predicts token t + 1, so response token j is scored at position p - 1 + j.
Per-token arrays of the response (log-probs, advantages) are placed at those positions. A micro-batch
is laid out padded (one sample per row) or packed (several per row, positions restarting at 0): see
RowLayout; the same per-token values come out of either.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch
import torch.distributed as dist

from isotrain.models.packing_check import lm_forward, lm_logits
from isotrain.rl.algos import token_logprobs
from isotrain.rl.pieces import NO_CP, Pieces


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


@dataclass(frozen=True)
class RowLayout:
    """How the sequences of a micro-batch become rows of the forward.

    padded: one prompt + response per row, right-padded, positions 0..L-1 counting through the padding.
    packed: several sequences per row, each with position ids restarting at 0, rows of at most the
    micro-batch's longest sequence (so a row's attention never costs more than a padded row's), the last
    one right-padded. Models that read position restarts as document boundaries need no mask; for those
    that do not (models/packing_check.py), `document_mask` passes isotrain's per-document causal mask.
    Every per-token value is the same in both layouts: a token sees exactly its own sequence's prefix at
    the same positions, so only where it sits in the tensor changes.
    """

    packed: bool = False
    document_mask: bool = False


PADDED = RowLayout()


def _pack(lengths: list[int], packed: bool) -> tuple[list[tuple[int, int]], int, int]:
    """(row, offset) of every sequence, the number of rows and the row length.

    Packed: first-fit decreasing into rows of capacity max(lengths); stable (ties keep their order), so the
    layout is a function of the lengths alone."""
    capacity = max(lengths)
    if not packed:
        return [(i, 0) for i in range(len(lengths))], len(lengths), capacity
    slots: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    filled: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: -lengths[k]):
        row = next((r for r, used in enumerate(filled) if used + lengths[i] <= capacity), len(filled))
        if row == len(filled):
            filled.append(0)
        slots[i] = (row, filled[row])
        filled[row] += lengths[i]
    return slots, len(filled), max(filled)


def _response_index(prompt_lens: list[int], response_lens: list[int],
                    slots: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, cols) of every response token's scoring position, sample after sample: response token j of a
    sample at (row, offset) with a p-token prompt is predicted at column offset + p - 1 + j."""
    rows = [row for (row, _), r in zip(slots, response_lens) for _ in range(r)]
    cols = [offset + p - 1 + j for (_, offset), p, r in zip(slots, prompt_lens, response_lens) for j in range(r)]
    return torch.tensor(rows, dtype=torch.int64), torch.tensor(cols, dtype=torch.int64)


def make_micro_batch(batch: RolloutBatch, pad_id: int, mask_truncated: bool,
                     per_token: dict[str, list[list[float]] | None], layout: RowLayout = PADDED) -> dict:
    """Tensors [rows, L] of some samples, laid out by `layout`: input_ids, position_ids, targets, mask,
    sequence_ids (the sample of each token, for per-sequence loss weights), segment_ids (the same, -1 on padding:
    the real prompt + response tokens an MoE router term counts), the per-token arrays, and
    response_index (where each response token is scored) to read per-token outputs back per sample.

    No attention mask when padded: causal attention keeps real tokens from seeing the padding after them,
    and position ids keep counting through the padding, exactly as SFT batches do. The padding after the
    last sequence of a packed row continues that sequence's positions, so it starts no new document.
    """
    prompt_lens = [len(p) for p in batch.prompt_ids]
    response_lens = [len(r) for r in batch.response_ids]
    sequences = [p + r for p, r in zip(batch.prompt_ids, batch.response_ids)]
    slots, num_rows, length = _pack([len(s) for s in sequences], layout.packed)
    input_ids = np.full((num_rows, length), pad_id, dtype=np.int64)
    positions = np.tile(np.arange(length, dtype=np.int64), (num_rows, 1))
    targets = np.zeros((num_rows, length), dtype=np.int64)
    mask = np.zeros((num_rows, length), dtype=np.float32)
    sequence_ids = np.zeros((num_rows, length), dtype=np.int64)
    segment_ids = np.full((num_rows, length), -1, dtype=np.int64)  # -1: padding (moe/routing.input_token_mask)
    last = [0] * num_rows  # offset of each row's last sequence
    for i, (seq, p, (row, offset)) in enumerate(zip(sequences, prompt_lens, slots)):
        end = offset + len(seq)
        input_ids[row, offset:end] = seq
        targets[row, offset : end - 1] = seq[1:]
        sequence_ids[row, offset:end] = i
        segment_ids[row, offset:end] = i
        if not (mask_truncated and batch.truncated[i]):
            mask[row, offset + p - 1 : end - 1] = 1.0
        last[row] = max(last[row], offset)
    for (row, offset), seq in zip(slots, sequences):
        # Restart at 0; a row's last sequence keeps counting through the padding after it.
        stop = length if offset == last[row] else offset + len(seq)
        positions[row, offset:stop] = np.arange(stop - offset)
    rows, cols = _response_index(prompt_lens, response_lens, slots)
    mb = {
        "input_ids": torch.from_numpy(input_ids),
        "position_ids": torch.from_numpy(positions),
        "targets": torch.from_numpy(targets),
        "mask": torch.from_numpy(mask),
        "sequence_ids": torch.from_numpy(sequence_ids),
        "segment_ids": torch.from_numpy(segment_ids),
        "response_index": (rows, cols),
        "response_lens": response_lens,
        "document_mask": layout.packed and layout.document_mask,
        "num_input_tokens": sum(len(s) for s in sequences),
    }
    for name, values in per_token.items():
        mb[name] = _place(values, rows, cols, (num_rows, length)) if values is not None else None
    return mb


def _place(values: list[list[float]], rows: torch.Tensor, cols: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    out = torch.zeros(shape, dtype=torch.float32)
    out[rows, cols] = torch.tensor([x for row in values for x in row], dtype=torch.float32)
    return out


def per_sample(mb: dict, values: torch.Tensor) -> list[list[float]]:
    """[rows, L] values per position -> each sample's values at its response tokens (response coordinates)."""
    flat = values[mb["response_index"]].tolist()
    out, start = [], 0
    for n in mb["response_lens"]:
        out.append(flat[start : start + n])
        start += n
    return out


def forward_logits(model, mb: dict, device: torch.device) -> torch.Tensor:
    """The model's logits [rows, L, ·] of a micro-batch, with isotrain's document mask when its layout needs it."""
    return lm_logits(model, mb["input_ids"].to(device), mb["position_ids"].to(device), mb["document_mask"])


def forward_output(model, mb: dict, device: torch.device, router_logits: bool):
    """`forward_logits`' forward, returning the model output; `router_logits`: with the MoE routers' logits."""
    return lm_forward(model, mb["input_ids"].to(device), mb["position_ids"].to(device), mb["document_mask"],
                      router_logits=router_logits)


@torch.no_grad()
def per_response_token(batch: RolloutBatch, pad_id: int, micro_batch_size: int, device: torch.device,
                       autocast_dtype, score, layout: RowLayout = PADDED, pieces: Pieces = NO_CP) -> list[list[float]]:
    """`score(mb)` -> [rows, L] values per position, run micro-batch by micro-batch under the run's autocast;
    returns each sample's values at its response tokens (response coordinates). Under context parallelism
    (`pieces`) each CP rank scores its piece of the rows and the pieces are gathered back into whole rows."""
    out: list[list[float]] = []
    for start in range(0, len(batch), micro_batch_size):
        part = batch.select(range(start, min(start + micro_batch_size, len(batch))))
        mb = make_micro_batch(part, pad_id, False, {}, layout)
        piece, _ = pieces.cut(mb)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None), \
                pieces.attention(mb, device):
            values = score(piece)
        # (fp64 models keep fp64: the values of any layout then agree to fp64 rounding)
        values = pieces.whole(values.to(torch.promote_types(values.dtype, torch.float32)), mb["input_ids"].shape[1])
        out += per_sample(mb, values.cpu())
    return out


def response_logprobs(model, batch: RolloutBatch, pad_id: int, micro_batch_size: int, temperature: float,
                      device: torch.device, autocast_dtype=None, layout: RowLayout = PADDED,
                      pieces: Pieces = NO_CP) -> list[list[float]]:
    """Each sample's log-prob of every response token under `model` (the sampling distribution at `temperature`)."""

    def score(mb: dict) -> torch.Tensor:
        return token_logprobs(forward_logits(model, mb, device), mb["targets"].to(device), temperature)

    return per_response_token(batch, pad_id, micro_batch_size, device, autocast_dtype, score, layout, pieces)
