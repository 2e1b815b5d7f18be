"""Context parallelism (parallel.cp, Ulysses and ring attention) against one process: the loss of each of 3 steps,
the token counts, every first-step gradient and the weights after 3 AdamW steps, both loss reductions, fp32 and
fp64, with the equivalence machinery of test_equivalence.py (same data: variable lengths, padding, masked prompts,
one packed sample of two documents; the same tolerances).

Layouts, (dp_replicate, dp_shard, tp, ep, cp[, "ring"]):
    1x1x1x1x2  CP 2 alone (GA 4): 4 heads, 2 KV heads split 2 ways; and one KV head (multi-query), repeated
    1x2x1x1x2  FSDP2 2 × CP 2 on 4 ranks (FSDP2 shards over dp_shard × cp; GA 2)
    1x1x1x1x4  CP 4 with 2 KV heads: fewer KV heads than the degree, each repeated twice
and the same with ring attention (parallel.cp_style=ring, zig-zag pieces): CP 2 with GA 4 and GA 2 (2 and 1 KV
heads; GA 2 also with activation checkpointing and the chunked loss), and on a model of 2 heads and 1 KV head
FSDP2 2 × CP 2 and CP 4, more ranks than heads. With tensor
parallelism: TP 2 × CP 2 (Ulysses and ring) on 4 ranks, FSDP2 2 × TP 2 × ring CP 2 on 8.
The sequences of a micro-batch (up to 20 tokens) are cut into pieces, padded to a multiple of the degree (of twice
the degree for ring's zig-zag); the packed sample's two documents land in different pieces.
"""

from __future__ import annotations

import pytest

from test_equivalence import MICRO_BATCH, _multi, _single, assert_equivalent

CP2 = (1, 1, 1, 1, 2)
FSDP2_CP2 = (1, 2, 1, 1, 2)
CP4 = (1, 1, 1, 1, 4)
RING_CP2 = (*CP2, "ring")
RING_FSDP2_CP2 = (*FSDP2_CP2, "ring")
RING_CP4 = (*CP4, "ring")
TP2_CP2 = (1, 1, 2, 1, 2)
RING_TP2_CP2 = (*TP2_CP2, "ring")


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    path = tmp_path_factory.mktemp("cp-ref")
    return {family: _single(path, micro_batch=8, family=family) for family in ("llama", "llama_mqa", "llama_2heads")}


@pytest.mark.slow
def test_cp2_matches_single_process(tmp_path, references):
    """CP 2 with 2 KV heads (split) and with 1 KV head (repeated to the degree)."""
    results = _multi(tmp_path, 2, [CP2], MICRO_BATCH, "families=llama,llama_mqa")
    for family in ("llama", "llama_mqa"):
        assert_equivalent(results[(family, CP2)], references[family])


@pytest.mark.slow
def test_fsdp2_x_cp2_and_cp4_match_single_process(tmp_path, references):
    results = _multi(tmp_path, 4, [FSDP2_CP2, CP4], MICRO_BATCH)
    assert_equivalent(results[FSDP2_CP2], references["llama"])
    assert_equivalent(results[CP4], references["llama"])


@pytest.mark.slow
@pytest.mark.parametrize("micro_batch, flags", [(MICRO_BATCH, ()), (4, ("ac", "chunk=5"))],
                         ids=["ga4", "ga2-checkpointing-chunked"])
def test_ring_cp2_matches_single_process(tmp_path, references, micro_batch, flags):
    """Ring attention on CP 2, 2 KV heads and 1 KV head, with gradient accumulation 4; and with GA 2, every decoder
    layer's activations checkpointed (ring attention recomputed inside the backward), also with the chunked loss
    (5 tokens a chunk, across the zig-zag piece's two chunks)."""
    results = _multi(tmp_path, 2, [RING_CP2], micro_batch, "families=llama,llama_mqa", *flags)
    for family in ("llama", "llama_mqa"):
        assert_equivalent(results[(family, RING_CP2)], references[family])
    if flags:
        assert_equivalent(results[("chunked", RING_CP2)], references["llama"])


@pytest.mark.slow
def test_ring_fsdp2_x_cp2_and_cp4_with_fewer_heads_than_ranks_match_single_process(tmp_path, references):
    """A model of 2 attention heads and 1 KV head: FSDP2 2 × ring CP 2, and ring CP 4, more ranks than heads."""
    results = _multi(tmp_path, 4, [RING_FSDP2_CP2, RING_CP4], MICRO_BATCH, "families=llama_2heads")
    assert_equivalent(results[("llama_2heads", RING_FSDP2_CP2)], references["llama_2heads"])
    assert_equivalent(results[("llama_2heads", RING_CP4)], references["llama_2heads"])


@pytest.mark.slow
def test_tp2_x_cp2_matches_single_process(tmp_path, references):
    """TP 2 × CP 2, Ulysses and ring: each TP rank's 2 heads (1 KV head) attend over the CP ranks; the gradients
    are summed over CP beside TP's own reductions (no DP: sync_replica_grads over dp_replicate × cp)."""
    results = _multi(tmp_path, 4, [TP2_CP2, RING_TP2_CP2], MICRO_BATCH)
    assert_equivalent(results[TP2_CP2], references["llama"])
    assert_equivalent(results[RING_TP2_CP2], references["llama"])


@pytest.mark.slow
def test_fsdp2_x_tp2_x_ring_cp2_matches_single_process(tmp_path, references):
    """8 ranks, FSDP2 2 × TP 2 × ring CP 2: FSDP2 shards the TP shards over dp_shard × cp."""
    results = _multi(tmp_path, 8, [(1, 2, 2, 1, 2, "ring")], MICRO_BATCH)
    assert_equivalent(results[(1, 2, 2, 1, 2, "ring")], references["llama"])
