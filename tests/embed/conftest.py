"""Shared fixtures of the embed tests."""

import json
import random

import pytest


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """40 pairs on 2 hard negatives each, plus one malformed row (line 41)."""
    rng = random.Random(0)
    words = ("alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron pi rho sigma tau "
             "upsilon").split()
    lines = []
    for _ in range(40):
        topic = rng.sample(words, 3)
        lines.append(json.dumps({"query": " ".join(topic), "positive": " ".join(topic + rng.sample(words, 4)),
                                 "negatives": [" ".join(rng.sample(words, 6)) for _ in range(2)]}))
    lines.append(json.dumps({"query": "no positive"}))
    path = tmp_path_factory.mktemp("embed-data") / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return str(path)
