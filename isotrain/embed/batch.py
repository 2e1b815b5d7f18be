"""A micro-batch of tokenized contrastive samples, texts in the order the loss lays them out."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from isotrain.embed.encode import POSITIVE, QUERY, text_seed


@dataclass
class EmbedSample:
    """One tokenized row: a query, its positive and N hard negatives, each with a text id (equal text, equal id)."""

    query: list[int]
    positive: list[int]
    negatives: list[list[int]]
    query_id: int
    positive_id: int
    negative_ids: list[int]


@dataclass
class EmbedMicroBatch:
    samples: list[EmbedSample]
    indices: list[int]  # dataset index of each sample: with the step, the key of its dropout masks

    @property
    def num_negatives(self) -> int:
        return len(self.samples[0].negatives) if self.samples else 0

    def texts(self) -> list[list[int]]:
        """[queries (m), positives (m), hard negatives (m·N, sample by sample)]."""
        return ([s.query for s in self.samples] + [s.positive for s in self.samples]
                + [tokens for s in self.samples for tokens in s.negatives])

    def seeds(self, seed: int, step: int) -> list[int]:
        """One seed per text of `texts()`, from (seed, step, dataset index, role)."""
        def role_seeds(role):
            return [text_seed(seed, step, index, role) for index in self.indices]

        negatives = [text_seed(seed, step, index, 2 + j) for index in self.indices for j in range(self.num_negatives)]
        return role_seeds(QUERY) + role_seeds(POSITIVE) + negatives

    def text_ids(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """int64 ids of the queries [m], positives [m], hard negatives [m·N]."""
        as_tensor = lambda values: torch.tensor(values, dtype=torch.int64)  # noqa: E731
        return (as_tensor([s.query_id for s in self.samples]), as_tensor([s.positive_id for s in self.samples]),
                as_tensor([i for s in self.samples for i in s.negative_ids]))

    def num_tokens(self) -> int:
        return sum(len(tokens) for tokens in self.texts())
