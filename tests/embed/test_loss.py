"""The global-batch InfoNCE against a plain-Python reference written row by row from text strings."""

import math

import pytest
import torch

from isotrain.embed.loss import LossSettings, contrastive_loss, false_negatives, hard_negative_column


def reference(queries, positives, negatives, q_texts, p_texts, n_texts, tau, symmetric, dims, mask):
    """Row by row: query i against every positive and every hard negative of the batch, skipping
    columns whose text is i's positive text (or whose query repeats query i) when `mask`."""
    g = len(q_texts)
    docs = [(positives[j], p_texts[j], j) for j in range(g)]
    docs += [(negatives[j][k], n_texts[j][k], None) for j in range(g) for k in range(len(n_texts[j]))]

    def unit(v, k):
        v = v[:k].double()
        return v / v.norm()

    total = 0.0
    for k in dims:
        forward = 0.0
        for i in range(g):
            q = unit(queries[i], k)
            logits, own = [], None
            for column, (d, text, owner) in enumerate(docs):
                is_own = column == i
                if mask and not is_own and (text == p_texts[i] or (owner is not None and q_texts[owner] == q_texts[i])):
                    continue
                logits.append(float(q @ unit(d, k)) / tau)
                if is_own:
                    own = logits[-1]
            forward += math.log(sum(math.exp(x) for x in logits)) - own
        loss = forward / g
        if symmetric:
            backward = 0.0
            for i in range(g):
                p = unit(positives[i], k)
                logits, own = [], None
                for j in range(g):
                    if mask and j != i and (q_texts[j] == q_texts[i] or p_texts[j] == p_texts[i]):
                        continue
                    logits.append(float(p @ unit(queries[j], k)) / tau)
                    if j == i:
                        own = logits[-1]
                backward += math.log(sum(math.exp(x) for x in logits)) - own
            loss = (loss + backward / g) / 2
        total += loss
    return total / len(dims)


def ids_of(texts):
    table = {}
    return torch.tensor([table.setdefault(t, len(table)) for t in texts], dtype=torch.int64)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("num_negatives", [0, 2])
@pytest.mark.parametrize("mask", [False, True])
@pytest.mark.parametrize("dims", [(), (8, 4)])
def test_matches_row_by_row_reference(symmetric, num_negatives, mask, dims):
    torch.manual_seed(0)
    g, h = 5, 8
    q_texts = ["q0", "q1", "q0", "q3", "q4"]  # sample 2 repeats query 0
    p_texts = ["p0", "p1", "p2", "p1", "p4"]  # sample 3 repeats positive 1
    n_texts = [[f"n{i}{j}" for j in range(num_negatives)] for i in range(g)]
    if num_negatives:
        n_texts[4][1] = "p0"  # a hard negative of sample 4 is sample 0's positive
    queries, positives = torch.randn(g, h), torch.randn(g, h)
    negatives = torch.randn(g, num_negatives, h)
    docs = torch.cat([positives, negatives.reshape(-1, h)])
    all_ids = ids_of(q_texts + p_texts + [t for row in n_texts for t in row])
    settings = LossSettings(temperature=0.1, symmetric=symmetric, matryoshka_dims=dims, mask_duplicates=mask)
    got = contrastive_loss(queries, docs, all_ids[:g], all_ids[g:], settings)
    want = reference(queries, positives, negatives, q_texts, p_texts, n_texts, 0.1, symmetric, dims or (h,), mask)
    assert math.isclose(float(got), want, rel_tol=1e-6)


def test_hand_computed_two_samples():
    # q0 = p0 = e1, q1 = p1 = e2 (orthogonal), τ = 1: each row's logits are (1, 0) -> loss = log(1 + e^-1).
    q = torch.eye(2)
    ids = torch.tensor([0, 1]), torch.tensor([2, 3])
    loss = contrastive_loss(q, q.clone(), *ids, LossSettings(temperature=1.0))
    assert math.isclose(float(loss), math.log(1 + math.exp(-1)), rel_tol=1e-7)


def test_hard_negative_columns_and_masks():
    # G = 2 samples, N = 2 negatives each: columns p0 p1 n00 n01 n10 n11.
    assert [hard_negative_column(i, j, 2, 2) for i in range(2) for j in range(2)] == [2, 3, 4, 5]
    query_ids = torch.tensor([10, 11])
    document_ids = torch.tensor([20, 21, 30, 21, 32, 20])  # n01 equals p1, n11 equals p0
    to_docs, to_queries = false_negatives(query_ids, document_ids)
    assert to_docs.tolist() == [[False, False, False, False, False, True],
                                [False, False, False, True, False, False]]
    assert not to_queries.any()
