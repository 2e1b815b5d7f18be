"""Chat rows prepared in worker processes (data/workers.py, `data.prepare_workers`): the store, the counts and the
skipped rows with their reasons are those of the one-process preparation (itself equal to the former
conversation-at-a-time implementation: tests/data/test_tokenize.py), and the rendering did run in the workers."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

import isotrain.data.dataset as dataset_module
from isotrain.config import SFTDataConfig
from isotrain.data.dataset import build_store
from isotrain.data.store import TokenStore
from isotrain.models.tokenizer import train_tokenizer

# Renders like the character tokenizer's own template, but refuses a 5-message prefix: some rows are skipped with
# the template's reason, others train.
_REFUSES_FIVE = (
    "{% if messages|length == 5 %}{{ raise_exception('no five') }}{% endif %}"
    "{% for m in messages %}{{ '<|' + m['role'] + '|>\\n' + m['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def _conversations(num: int) -> list[list[dict]]:
    rng = np.random.default_rng(0)
    words = ["the", "sum", "of", "one", "and", "two", "is", "three"]
    conversations = []
    for _ in range(num):
        messages = [{"role": "system", "content": "be brief"}] if rng.random() < 0.4 else []
        for _ in range(int(rng.integers(1, 4))):
            for role in ("user", "assistant"):
                messages.append({"role": role, "content": " ".join(rng.choice(words, int(rng.integers(1, 6))))})
        conversations.append(messages)
    return conversations


def test_chat_rows_prepared_in_workers_equal_the_one_process_preparation(tmp_path, monkeypatch):
    tokenizer = train_tokenizer(["the sum of one and two is three be brief <|:>\n"], "char", 0)
    tokenizer.chat_template = _REFUSES_FIVE
    lines = [json.dumps({"messages": m}) for m in _conversations(300)]
    lines[3], lines[5] = "{not json", json.dumps({"messages": [{"role": "user"}]})  # skipped before tokenizing
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(dataset_module, "CHAT_CHUNK_ROWS", 16)  # 19 chunks over 2 workers
    pids_file = tmp_path / "pids"
    tokenize_chunk = dataset_module.tokenize_chunk

    def recorded(*args, **kwargs):  # inherited by the forked workers
        with open(pids_file, "a") as f:
            f.write(f"{os.getpid()}\n")
        return tokenize_chunk(*args, **kwargs)

    monkeypatch.setattr(dataset_module, "tokenize_chunk", recorded)
    results = {}
    for workers in (0, 2):
        pids_file.write_text("")
        cfg = SFTDataConfig(path=str(path), format="chat", max_seq_len=48, prepare_workers=workers)
        stats = build_store(cfg, tokenizer, tmp_path / f"store-{workers}")
        results[workers] = (stats, TokenStore(tmp_path / f"store-{workers}"), pids_file.read_text().split())
    (one, one_store, one_pids), (two, two_store, two_pids) = results[0], results[2]
    assert set(one_pids) == {str(os.getpid())} and len(one_pids) == 1  # one chunk of 300 rows, here
    assert len(two_pids) == 19 and str(os.getpid()) not in two_pids
    assert two == one
    reasons = {reason.split(" (")[0] for _, reason in one.skipped}
    assert reasons == {"chat template failed to render the messages", "invalid JSON",
                       "messages[0].content must be a string"}, one.skipped
    assert one.num_truncated and one.num_samples > 100
    assert len(one_store) == len(two_store)
    for a, b in zip(one_store, two_store):
        assert a.row_ids == b.row_ids
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.labels, b.labels)


@pytest.mark.parametrize("value", [-1, 1.5])
def test_a_bad_worker_count_is_refused(value):
    with pytest.raises(ValueError, match="prepare_workers"):
        SFTDataConfig(path="x.jsonl", prepare_workers=value)
