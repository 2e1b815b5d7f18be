"""Bad shards and mixtures through the real CLI: each exits non-zero with one sentence naming the value and the fix,
and no traceback (invariant 8)."""

from __future__ import annotations

import functools
import gzip
import json

import pytest

from helpers import run_concurrently
from zygote import run_forked_ranks

TEXT = "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(8))


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources-cli")
    (root / "good.jsonl").write_text(TEXT)
    (root / "fake.jsonl.gz").write_text(TEXT)  # named .gz, written plain
    (root / "shards").mkdir()
    with gzip.open(root / "shards" / "a.jsonl.gz", "wt") as handle:
        handle.write(TEXT)
    (root / "shards" / "b.jsonl").write_text("".join(json.dumps({"body": f"row {i}"}) + "\n" for i in range(4)))
    (root / "both.yaml").write_text(f"model:\n  config: {{model_type: llama}}\ndata:\n  path: {root / 'good.jsonl'}\n"
                                    f"  sources:\n    - path: {root / 'good.jsonl'}\n")
    good, fake = root / "good.jsonl", root / "fake.jsonl.gz"
    cases = {
        "glob without match": [f"data.path={root / 'missing-*.jsonl'}"],
        "shard of another schema": [f"data.path={root / 'shards'}"],
        "weight zero": [f"data.sources=[{{path: {good}, weight: 0}}]"],
        "not gzip": [f"data.sources=[{{path: {good}, weight: 2}}, {{path: {fake}}}]"],
    }
    # One output_dir each: runs started side by side on one directory would meet its lock.
    commands = {name: ["train", *args, "data.format=text", f"output_dir={root / 'runs' / str(i)}"]
                for i, (name, args) in enumerate(cases.items())}
    commands["path and sources"] = ["train", str(root / "both.yaml"), f"output_dir={root / 'runs' / 'both'}"]
    # Forked from a process that has imported isotrain (tests/zygote.py): no seconds of imports per command.
    runs = run_concurrently({name: functools.partial(run_forked_ranks, 1, command) for name, command in commands.items()})
    assert not list((root / "runs").glob("*/metrics.jsonl"))
    return root, runs


def assert_one_sentence(proc, expected: str) -> None:
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    assert " ".join(lines[0].split()) == f"error: {expected}"


def test_a_glob_that_matches_nothing(cli_runs):
    root, runs = cli_runs
    assert_one_sentence(runs["glob without match"],
                        f"data.path '{root / 'missing-*.jsonl'}' matches no file; check the pattern, or point "
                        "data.path at a .jsonl, .jsonl.gz, .json or .parquet file, a glob or directory of such "
                        "shards, or a directory saved with datasets.save_to_disk")


def test_a_shard_with_another_schema(cli_runs):
    root, runs = cli_runs
    assert_one_sentence(runs["shard of another schema"],
                        "data.path shard 'b.jsonl' has rows but not one valid row (first: line 1: missing 'text'), "
                        f"so its schema differs from the other shards of '{root / 'shards'}'; fix or remove it")


def test_a_weight_that_is_not_positive(cli_runs):
    _, runs = cli_runs
    assert_one_sentence(runs["weight zero"],
                        "data.sources[0].weight=0 must be > 0 (a source's share of each mixture epoch is its weight / "
                        "the sum of weights); give it a positive weight or remove the source")


def test_a_jsonl_gz_that_is_not_gzip(cli_runs):
    root, runs = cli_runs
    assert_one_sentence(runs["not gzip"],
                        f"data.sources[1].path '{root / 'fake.jsonl.gz'}' is not gzip data although its name ends in "
                        ".gz; compress it with gzip or rename it to .jsonl")


def test_data_path_and_data_sources_together(cli_runs):
    root, runs = cli_runs
    assert_one_sentence(runs["path and sources"],
                        f"data.path='{root / 'good.jsonl'}' and data.sources are both set; keep one of them (a "
                        "single source is data.sources=[{path: ...}])")
