"""Retrieval metrics against rankings worked out by hand."""

import math

import pytest
import torch

from isotrain.embed.evaluate import retrieval_metrics, retrieval_task


def test_metrics_by_hand():
    # 3 queries over 12 documents.
    scores = torch.zeros(3, 12)
    # q0: its document 4 ranks first.
    scores[0, 4] = 1.0
    # q1: document 7 ranks third (documents 0 and 1 score higher).
    scores[1, 0], scores[1, 1], scores[1, 7] = 0.9, 0.8, 0.7
    # q2: two relevant documents, 2 at rank 2 and 11 at rank 12 (past the cut-off); document 5 first.
    scores[2, 5], scores[2, 2] = 0.9, 0.8
    scores[2, 11] = -1.0
    got = retrieval_metrics(scores, [{4}, {7}, {2, 11}])
    ndcg2 = (1 / math.log2(3)) / (1 + 1 / math.log2(3))
    want = {
        "recall@1": (1 + 0 + 0) / 3,
        "recall@10": (1 + 1 + 0.5) / 3,
        "mrr@10": (1 + 1 / 3 + 1 / 2) / 3,
        "ndcg@10": (1 + 1 / math.log2(4) + ndcg2) / 3,
    }
    assert got == pytest.approx(want, rel=1e-12)


def test_ties_keep_corpus_order_and_past_ten_counts_zero():
    scores = torch.zeros(1, 12)  # all equal: the ranking is the corpus order
    assert retrieval_metrics(scores, [{10}]) == {"recall@1": 0.0, "recall@10": 0.0, "mrr@10": 0.0, "ndcg@10": 0.0}
    got = retrieval_metrics(scores, [{9}])
    assert got["mrr@10"] == 0.1 and got["recall@10"] == 1.0 and got["ndcg@10"] == pytest.approx(1 / math.log2(11))


def test_task_pools_texts_and_repeated_queries():
    rows = [{"query": "a", "positive": "x", "negatives": ["y"]}, {"query": "b", "positive": "y"},
            {"query": "a", "positive": "z"}]
    assert retrieval_task(rows, "q: ") == (["q: a", "q: b"], ["x", "y", "z"], [{0, 2}, {1}])
