"""InfoNCE over the whole global batch: pure tensor functions (shapes in docstrings).

Layout of the candidate documents of a global batch of G samples with N hard negatives each,
in the canonical global sample order (the sampler's, independent of ranks and GA):

    documents = [p_0, p_1, ..., p_{G-1},  n_{0,0}, ..., n_{0,N-1},  n_{1,0}, ...,  n_{G-1,N-1}]

so the positive of query i is column i and its j-th hard negative is column G + i·N + j
(`hard_negative_column`). Every query is scored against every document of the global batch.

    loss_q→d = 1/G Σ_i −log softmax_j(cos(q_i, d_j)/τ)[i]
    loss_d→q = 1/G Σ_i −log softmax_j(cos(p_i, q_j)/τ)[i]        (symmetric term)
    loss     = mean over Matryoshka dims k of  (loss_q→d + loss_d→q)/2   (or loss_q→d alone),

each with the first k coordinates, re-normalised. A column whose text equals the text of row i's
own positive (another sample's copy of it, or a hard negative equal to it), or the positive of a
sample that repeats query i, is a false negative: it is masked out of row i's softmax
(`false_negatives`; likewise in the symmetric term).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LossSettings:
    temperature: float = 0.05
    symmetric: bool = False
    matryoshka_dims: tuple[int, ...] = ()  # empty: the full dimension only
    mask_duplicates: bool = True


def hard_negative_column(sample: int, negative: int, num_samples: int, num_negatives: int) -> int:
    """Column of hard negative `negative` of global sample `sample` in the document layout above."""
    return num_samples + sample * num_negatives + negative


def _not_own(mask: torch.Tensor) -> torch.Tensor:
    """`mask` [R, C ≥ R] with its diagonal (each row's own label) cleared."""
    diagonal = torch.arange(mask.shape[0], device=mask.device)
    mask = mask.clone()
    mask[diagonal, diagonal] = False
    return mask


def false_negatives(query_ids: torch.Tensor, document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks of the query→document [G, G(1+N)] and document→query [G, G] scores.

    Column j is a false negative of row i (j ≠ i) when it holds row i's positive text, or, among the
    positives, when sample j repeats query i (then p_j answers q_i too); symmetrically, query j is a
    false negative of positive i when it repeats query i or when p_j repeats p_i."""
    num_samples = query_ids.shape[0]
    positive_ids = document_ids[:num_samples]
    same_query = query_ids[:, None] == query_ids[None, :]
    same_positive = positive_ids[:, None] == positive_ids[None, :]
    to_documents = positive_ids[:, None] == document_ids[None, :]
    to_documents[:, :num_samples] |= same_query
    return _not_own(to_documents), _not_own(same_query | same_positive)


def _info_nce(rows: torch.Tensor, columns: torch.Tensor, temperature: float, masked: torch.Tensor | None) -> torch.Tensor:
    """rows [R, k], columns [C ≥ R, k], both unit length; the label of row i is column i. Mean over rows."""
    scores = rows @ columns.T / temperature
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    labels = torch.arange(rows.shape[0], device=rows.device)
    return F.cross_entropy(scores, labels, reduction="mean")


def contrastive_loss(queries: torch.Tensor, documents: torch.Tensor, query_ids: torch.Tensor,
                     document_ids: torch.Tensor, settings: LossSettings) -> torch.Tensor:
    """queries [G, H], documents [G·(1+N), H] (layout above), query_ids [G], document_ids [G·(1+N)]
    (int64 text ids: equal texts, equal ids) -> the scalar loss of the global batch."""
    num_samples = queries.shape[0]
    dims = settings.matryoshka_dims or (queries.shape[1],)
    doc_mask, query_mask = false_negatives(query_ids, document_ids) if settings.mask_duplicates else (None, None)
    total = queries.new_zeros(())
    for k in dims:
        q = F.normalize(queries[:, :k], dim=-1)
        d = F.normalize(documents[:, :k], dim=-1)
        loss = _info_nce(q, d, settings.temperature, doc_mask)
        if settings.symmetric:
            loss = (loss + _info_nce(d[:num_samples], q, settings.temperature, query_mask)) / 2
        total = total + loss
    return total / len(dims)
