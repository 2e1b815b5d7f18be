"""Retrieval evaluation on held-out {query, positive, negatives} rows: Recall@1/10, MRR@10, NDCG@10.

The corpus is every distinct positive and negative text of the held-out rows; query i's relevant documents
are the texts given as positives of rows whose query equals query i (usually its own positive alone).
Documents are ranked by cosine similarity, ties broken by corpus order (first seen first).

    Recall@k = |relevant ∩ top k| / |relevant|,    MRR@10 = 1 / rank of the first relevant document (0 past 10),
    NDCG@10  = Σ_{relevant d in top 10} 1/log2(1 + rank d)  /  Σ_{r=1}^{min(|relevant|, 10)} 1/log2(1 + r),
each averaged over the distinct queries.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from isotrain.embed.encode import EncodeOptions, encode_chunk, forward_groups, in_text_order


def retrieval_metrics(scores: torch.Tensor, relevant: list[set[int]]) -> dict[str, float]:
    """scores [Q, C] (higher is closer), relevant[q] = corpus indices relevant to query q -> metric means."""
    # A stable sort on the negated scores keeps equal scores in corpus order.
    order = torch.sort(-scores, dim=1, stable=True).indices.tolist()
    totals = {"recall@1": 0.0, "recall@10": 0.0, "mrr@10": 0.0, "ndcg@10": 0.0}
    for ranking, wanted in zip(order, relevant):
        ranks = [r for r, doc in enumerate(ranking, start=1) if doc in wanted]
        totals["recall@1"] += sum(r <= 1 for r in ranks) / len(wanted)
        totals["recall@10"] += sum(r <= 10 for r in ranks) / len(wanted)
        totals["mrr@10"] += 1.0 / ranks[0] if ranks and ranks[0] <= 10 else 0.0
        ideal = sum(1.0 / math.log2(1 + r) for r in range(1, min(len(wanted), 10) + 1))
        totals["ndcg@10"] += sum(1.0 / math.log2(1 + r) for r in ranks if r <= 10) / ideal
    return {name: value / len(relevant) for name, value in totals.items()}


def encode_texts(model, tokenizer, texts: list[str], options: EncodeOptions, max_len: int, device,
                 normalize: bool = True) -> torch.Tensor:
    """[n, H] vectors of `texts` in eval mode (no dropout, no gradient), as the saved model gives them."""
    token_lists = [tokenizer(t, truncation=True, max_length=max_len)["input_ids"] for t in texts]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            groups = forward_groups([len(t) for t in token_lists], options.chunk_tokens or 4096)
            parts = [encode_chunk(model, [token_lists[i] for i in group], [0] * len(group), options, device)
                     for group in groups]
    finally:
        model.train(was_training)
    vectors = in_text_order(groups, parts).float()
    return F.normalize(vectors, dim=-1) if normalize else vectors


def retrieval_task(rows: list[dict], query_prefix: str = "") -> tuple[list[str], list[str], list[set[int]]]:
    """(distinct queries, corpus, relevant corpus indices per query) of held-out rows."""
    corpus: dict[str, int] = {}
    relevant: dict[str, set[int]] = {}
    for row in rows:
        for text in (row["positive"], *(row.get("negatives") or [])):
            corpus.setdefault(text, len(corpus))
        relevant.setdefault(query_prefix + row["query"], set()).add(corpus[row["positive"]])
    return list(relevant), list(corpus), list(relevant.values())


def evaluate_retrieval(model, tokenizer, rows: list[dict], options: EncodeOptions, max_len: int, device,
                       query_prefix: str = "") -> dict[str, float]:
    queries, corpus, relevant = retrieval_task(rows, query_prefix)
    q = encode_texts(model, tokenizer, queries, options, max_len, device)
    d = encode_texts(model, tokenizer, corpus, options, max_len, device)
    return retrieval_metrics(q @ d.T, relevant)
