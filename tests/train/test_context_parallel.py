"""Context parallelism (parallel.cp, Ulysses) against one process: the loss of each of 3 steps, the token counts,
every first-step gradient and the weights after 3 AdamW steps, both loss reductions, fp32 and fp64, with the
equivalence machinery of test_equivalence.py (same data: variable lengths, padding, masked prompts, one packed
sample of two documents; the same tolerances).

Layouts, (dp_replicate, dp_shard, tp, ep, cp):
    1x1x1x1x2  CP 2 alone (GA 4): 4 heads, 2 KV heads split 2 ways; and one KV head (multi-query), repeated
    1x2x1x1x2  FSDP2 2 × CP 2 on 4 ranks (FSDP2 shards over dp_shard × cp; GA 2)
    1x1x1x1x4  CP 4 with 2 KV heads: fewer KV heads than the degree, each repeated twice
The sequences of a micro-batch (up to 20 tokens) are cut into contiguous pieces, padded to a multiple of the
degree; the packed sample's two documents land in different pieces under CP 4.
"""

from __future__ import annotations

import pytest

from test_equivalence import MICRO_BATCH, _multi, _single, assert_equivalent

CP2 = (1, 1, 1, 1, 2)
FSDP2_CP2 = (1, 2, 1, 1, 2)
CP4 = (1, 1, 1, 1, 4)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    path = tmp_path_factory.mktemp("cp-ref")
    return {family: _single(path, micro_batch=8, family=family) for family in ("llama", "llama_mqa")}


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
