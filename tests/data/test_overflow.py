"""Rows longer than data.max_seq_len (data.overflow): a text corpus keeps every token, split into pieces that all
train; truncate and drop do what they say and are counted; one epoch counts exactly the corpus's tokens on one
process and on two ranks, packed and unpacked."""

from __future__ import annotations

import functools
import json

import numpy as np
import pytest

from helpers import run_concurrently
from zygote import run_forked_ranks
from isotrain.config import ConfigError, build_config, load_config
from isotrain.data import prepare_dataset
from isotrain.data.tokenize import IGNORE_INDEX, shifted_labels, tokenize_rows
from isotrain.models.tokenizer import train_tokenizer

L = 8


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["abcdefghijklmnopqrstuvwxyz"], "char", 64)


def document(tok, text: str) -> tuple[np.ndarray, np.ndarray]:
    """The whole row as `text` format tokenizes it, before any cut: bos + text + eos, every token after bos a target."""
    ids = [tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"], tok.eos_token_id]
    return np.asarray(ids), shifted_labels(ids, [False] + [True] * (len(ids) - 1))


# Tokens per row (bos + characters + eos): 5 (shorter than L), 8 (exactly L), 9, 17 and 41 (L + 1, 2L + 1, 5L + 1:
# their last piece would be a lone eos with no target).
TEXTS = ["abc", "abcdef", "abcdefg", "abcdefghijklmno", "abcdefghijklmnopqrstuvwxyzabcdefghijklm"]


def test_split_pieces_hold_every_token_as_input_once_and_every_target_once(tok):
    rows = [{"text": text} for text in TEXTS]
    examples, stats = tokenize_rows(rows, [1, 2, 3, 4, 5], tok, "text", L, "split")
    for row_id, text in enumerate(TEXTS, start=1):
        ids, labels = document(tok, text)
        pieces = [e for e in examples if e.row_id == row_id]
        assert all(len(piece.input_ids) <= L for piece in pieces)
        assert all((piece.labels != IGNORE_INDEX).any() for piece in pieces)
        got_ids = np.concatenate([piece.input_ids for piece in pieces])
        got_labels = np.concatenate([piece.labels for piece in pieces])
        if len(ids) % L == 1:  # the lone eos is left out: it is an input of nothing, and already the last target
            assert len(pieces) == len(ids) // L and labels[-2] == ids[-1] == pieces[-1].labels[-1]
            ids, labels = ids[:-1], labels[:-1]
        assert np.array_equal(got_ids, ids) and np.array_equal(got_labels, labels)
    assert (stats.num_rows, stats.num_split, stats.num_truncated, stats.skipped) == (5, 3, 0, [])
    assert stats.corpus_trained_tokens == sum(len(document(tok, t)[0]) - 1 for t in TEXTS)
    assert sum(np.count_nonzero(e.labels != IGNORE_INDEX) for e in examples) == stats.corpus_trained_tokens


def test_truncate_keeps_the_first_tokens_and_drop_skips_the_row_with_its_reason(tok):
    rows = [{"text": text} for text in TEXTS]
    truncated, stats = tokenize_rows(rows, [1, 2, 3, 4, 5], tok, "text", L, "truncate")
    assert [len(e.input_ids) for e in truncated] == [5, 8, 8, 8, 8]
    assert stats.num_truncated == 3 and all(e.labels[-1] == IGNORE_INDEX for e in truncated)
    kept, stats = tokenize_rows(rows, [1, 2, 3, 4, 5], tok, "text", L, "drop")
    assert [e.row_id for e in kept] == [1, 2]
    assert stats.skipped == [(3, "9 tokens > data.max_seq_len=8 (data.overflow=drop)"),
                             (4, "17 tokens > data.max_seq_len=8 (data.overflow=drop)"),
                             (5, "41 tokens > data.max_seq_len=8 (data.overflow=drop)")]


def test_the_data_line_states_the_share_of_the_corpus_trained(tmp_path, tok):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in TEXTS))
    targets = sum(len(document(tok, t)[0]) - 1 for t in TEXTS)
    lines = {}
    for overflow in ("split", "truncate"):
        cfg = build_config({"model": {"config": {"model_type": "llama"}}, "data": {
            "path": str(path), "format": "text", "max_seq_len": L, "overflow": overflow,
            "cache_dir": str(tmp_path / "cache")}})
        log = []
        prepare_dataset(cfg.data, tok, log=log.append)
        lines[overflow] = log[-1]
    assert lines["split"] == (f"data corpus.jsonl: 5 rows -> 10 samples, 77 tokens, {targets} trained (100.0% of the "
                              f"{targets} targets in the rows); 3 rows longer than data.max_seq_len=8 split into "
                              "pieces (10 examples from 5 rows)")
    assert lines["truncate"] == (f"data corpus.jsonl: 5 rows -> 5 samples, 37 tokens, 32 trained ({32 / targets:.1%} "
                                 f"of the {targets} targets in the rows); 3 rows truncated to data.max_seq_len=8 "
                                 "(data.overflow=split keeps every token)")


def test_text_splits_by_default_and_the_other_formats_truncate_or_refuse_split():
    base = ["model.config={model_type: llama}"]
    assert load_config(None, [*base, "data.format=text"]).data.overflow_rule == "split"
    assert load_config(None, [*base, "data.format=chat"]).data.overflow_rule == "truncate"
    with pytest.raises(ConfigError, match=r"^data.overflow=split applies to data.format=text only: a piece of a "
                                          r"prompt_completion row would train without its prompt; set "
                                          r"data.overflow=truncate or drop$"):
        load_config(None, [*base, "data.format=prompt_completion", "data.overflow=split"])
    with pytest.raises(ConfigError, match="unknown config key 'data.overflow'"):
        load_config(None, ["data.overflow=drop"], recipe="rl")


# One epoch through the real CLI. The char tokenizer gives one token per character, so every count below is known
# from the texts alone; no row's last piece is a lone eos.
CORPUS = ["ab", "abc", "abcdefghij", "abcdefghijklmnopqrstuvwxyzabcd", "abcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrst",
          "abcdefghijklmn", "abcde", "abcdefghijklmnopqrstuvwxyzabcdefghijklmnopqrstuvwxyzabcdefghij"]
SEQ = 16
# Pieces of <= 16 tokens (3 rows split): 4 | 5 | 12 | 16 16 | 16 16 16 | 16 | 7 | 16 16 16 16 = 14 samples
# unpacked; packed (best fit, longest first) the 4 joins the 12 and the 5 the 7: 12 samples.
RUNS = {"unpacked": (["data.packing=false"], 14), "packed": (["data.packing=true"], 12)}
TINY = ["model.config.model_type=llama", "model.config.hidden_size=32", "model.config.intermediate_size=64",
        "model.config.num_hidden_layers=2", "model.config.num_attention_heads=2", "model.config.num_key_value_heads=1",
        f"model.config.max_position_embeddings={SEQ}"]


@pytest.fixture(scope="module")
def epoch_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("overflow")
    data = root / "corpus.jsonl"
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in CORPUS))

    def train(name: str, nproc: int):
        packing, samples = RUNS[name.split()[0]]
        args = ["train", *TINY, "tokenizer.type=char", "data.format=text", f"data.path={data}",
                f"data.max_seq_len={SEQ}", *packing, "train.global_batch_size=2", "train.micro_batch_size=1",
                f"train.max_steps={samples // 2}", "eval.path=null", "logging.progress=false",
                "checkpoint.every_steps=0", f"output_dir={root / name.replace(' ', '-')}"]
        proc = run_forked_ranks(nproc, args)
        return proc, root / name.replace(" ", "-"), samples

    jobs = {f"{kind} {nproc}": functools.partial(train, f"{kind} {nproc}", nproc) for kind in RUNS for nproc in (1, 2)}
    return run_concurrently(jobs)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["unpacked 1", "unpacked 2", "packed 1", "packed 2"])
def test_one_epoch_trains_every_token_of_a_corpus_with_rows_longer_than_max_seq_len(epoch_runs, run):
    proc, run_dir, samples = epoch_runs[run]
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = sum(len(text) + 2 for text in CORPUS)  # bos + characters + eos
    assert f"data corpus.jsonl: 8 rows -> {samples} samples, {tokens} tokens, {tokens - 8} trained (100.0% " \
           in proc.stdout
    last = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert (last["tokens_seen"], last["trained_tokens"], last["samples_seen"]) == (tokens, tokens - len(CORPUS),
                                                                                   samples)
