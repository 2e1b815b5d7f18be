"""The mixture rule of data/mixture.py: exact largest-remainder counts per mixture epoch, each source read as its
own seeded epochs (a small source repeats, a large one is cycled), a pure function of the seed, and exact totals."""

import json

import numpy as np
import pytest

from isotrain.config import load_config
from isotrain.data.mixture import Mixture, SourceCounters, apportion, prepare_mixture
from isotrain.data.sampler import GlobalBatchSampler
from isotrain.errors import DataError
from isotrain.models.tokenizer import train_tokenizer

SIZES = {"small": 7, "large": 30, "mid": 12}
WEIGHTS = {"small": 1.0, "large": 1.0, "mid": 3.0}


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer(["smalrgeid 0123456789"], "char", vocab_size=0)


def make_mixture(tmp_path, tok, seed=0, weights=WEIGHTS, packing=False, global_batch_size=7) -> Mixture:
    for name, size in SIZES.items():
        rows = [{"text": f"{name} {i}{'0' * (i % 3)}"} for i in range(size)]  # 6-12 tokens: one sample each
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    sources = ", ".join(f"{{path: {tmp_path / name}.jsonl, weight: {weights[name]}}}" for name in SIZES)
    cfg = load_config(None, [f"data.sources=[{sources}]", "data.format=text", "data.max_seq_len=16",
                             f"data.packing={str(packing).lower()}", f"data.cache_dir={tmp_path / 'cache'}"])
    return prepare_mixture(cfg.data, tok, seed, global_batch_size, log=lambda *_: None)


def test_largest_remainder_counts_are_exact_and_sum_to_the_epoch():
    assert apportion(49, [1, 1, 3]).tolist() == [10, 10, 29]  # quotas 9.8, 9.8, 29.4: the 9.8s get the seats
    assert apportion(42, [3, 1, 1]).tolist() == [25, 9, 8]  # 25.2, 8.4, 8.4: a tie goes to the lower index
    assert apportion(10, [0.1, 0.2, 0.7]).tolist() == [1, 2, 7]  # no float rounding: weights are exact fractions
    assert apportion(7, [2, 2, 2]).tolist() == [3, 2, 2]
    assert apportion(100, [5, 30, 12]).sum() == 100


def test_every_mixture_epoch_holds_each_source_its_count(tmp_path, tok):
    mixture = make_mixture(tmp_path, tok)
    assert len(mixture) == 49 and mixture.counts.tolist() == [10, 10, 29]  # small 7, large 30, mid 12
    for epoch in range(4):
        table = mixture.epoch_table(epoch)
        assert len(table) == 49
        assert mixture.tally(table)[0].tolist() == [10, 10, 29]


def test_each_source_is_read_as_whole_own_epochs_repeating_or_cycling(tmp_path, tok):
    mixture = make_mixture(tmp_path, tok)
    streams = {i: [] for i in range(3)}
    for epoch in range(6):
        table = mixture.epoch_table(epoch)
        for i in range(3):
            picks = table[mixture.source_of(table) == i] - mixture.offsets[i]
            streams[i].extend(picks.tolist())
    for i, size in enumerate(mixture.sizes.tolist()):
        stream = streams[i]
        whole = len(stream) // size
        assert whole >= 2
        for own_epoch in range(whole):  # every own epoch is a permutation of the source's samples
            assert sorted(stream[own_epoch * size : (own_epoch + 1) * size]) == list(range(size))
        assert stream[:size] != stream[size : 2 * size]  # reshuffled each own epoch
    # large (30 samples, 10 per mixture epoch) takes three mixture epochs to be read once, without repeats
    assert len(set(streams[1][:30])) == 30


def test_the_order_is_a_pure_function_of_the_seed(tmp_path, tok):
    a = make_mixture(tmp_path, tok, seed=3)
    b = make_mixture(tmp_path, tok, seed=3)  # from the cache entries
    c = make_mixture(tmp_path, tok, seed=4)
    for epoch in range(3):
        assert np.array_equal(a.epoch_table(epoch), b.epoch_table(epoch))
    assert not np.array_equal(a.epoch_table(0), c.epoch_table(0))
    sampler = GlobalBatchSampler(len(a), 7, 3, epoch_table=a.epoch_table)
    again = GlobalBatchSampler(len(b), 7, 3, epoch_table=b.epoch_table)
    for step in range(20):
        assert np.array_equal(sampler.global_batch(step), again.global_batch(step))
        for dp in (1, 7):  # the layout only cuts the batch
            parts = [sampler.rank_slice(step, r, dp) for r in range(dp)]
            assert np.array_equal(np.concatenate(parts), sampler.global_batch(step))


@pytest.mark.parametrize("packing", [False, True])
def test_epoch_totals_and_source_counters_are_exact(tmp_path, tok, packing):
    mixture = make_mixture(tmp_path, tok, packing=packing, global_batch_size=4)  # e.g. 48 of 49 per mixture epoch
    table = mixture.epoch_table(0)
    samples = [mixture[int(i)] for i in table]
    assert mixture.stats.num_samples == mixture.epoch_samples == len(table) == len(mixture) // 4 * 4
    assert mixture.stats.total_input_tokens == sum(len(s.input_ids) for s in samples)
    assert mixture.stats.total_trained_tokens == sum(int((s.labels != -100).sum()) for s in samples)
    for dataset in mixture.datasets:
        assert dataset.trained_counts().tolist() == [int((s.labels != -100).sum()) for s in dataset.samples]
    one_epoch = GlobalBatchSampler(len(table), len(table), 0, epoch_table=mixture.epoch_table)
    totals = SourceCounters(mixture, one_epoch, 0)
    totals.add_step(0)  # one step = mixture epoch 0: the logged totals, exactly
    assert totals.totals[1].sum() == mixture.stats.total_input_tokens
    assert totals.totals[2].sum() == mixture.stats.total_trained_tokens
    sampler = GlobalBatchSampler(mixture.epoch_samples, 4, 0, epoch_table=mixture.epoch_table)
    counters = SourceCounters(mixture, sampler, 0)
    for step in range(sampler.steps_per_epoch * 2 + 3):
        row = counters.add_step(step)
    resumed = SourceCounters(mixture, sampler, step + 1)  # recomputed from the step alone
    assert np.array_equal(resumed.totals, counters.totals)
    seen = [int(i) for k in range(step + 1) for i in sampler.global_batch(k)]
    assert sum(row[f"source/{name}/samples_seen"] for name in mixture.names) == len(seen)
    assert sum(row[f"source/{name}/tokens_seen"] for name in mixture.names) == \
        sum(len(mixture[i].input_ids) for i in seen)
    assert row["source/small/epochs"] == row["source/small/samples_seen"] / mixture.sizes[0]


def test_a_source_without_a_seat_is_refused(tmp_path, tok):
    with pytest.raises(DataError, match=r"^data.sources\[0\] \('small', weight 0.001\) gets 0 of the 49 samples of "
                                        r"a mixture epoch; raise its weight or remove the source$"):
        make_mixture(tmp_path, tok, weights={"small": 0.001, "large": 1.0, "mid": 1.0})


def test_trained_counts_are_remembered_and_damage_found_reading_them_removes_the_entry(tmp_path, tok, monkeypatch):
    from pathlib import Path

    from isotrain.data.store import StoreMismatch, TokenStore

    dataset = make_mixture(tmp_path, tok).datasets[0]
    expected = dataset.trained_counts().tolist()
    monkeypatch.setattr(TokenStore, "trained_counts", lambda self: pytest.fail("the labels were read again"))
    assert dataset.trained_counts().tolist() == expected
    entry = Path(dataset.cache_path)
    (entry.parent.parent / "trained-counts" / f"{entry.name}.npy").unlink()

    def damaged(self):
        raise StoreMismatch("block 0 of labels.bin (bytes 0-80) does not match its checksum")

    monkeypatch.setattr(TokenStore, "trained_counts", damaged)
    with pytest.raises(DataError, match=r"cache entry .* is damaged \(block 0 of labels.bin .*\); it was removed"):
        dataset.trained_counts()
    assert not entry.exists()


def test_adding_a_source_tokenizes_only_that_one(tmp_path, tok):
    make_mixture(tmp_path, tok)
    (tmp_path / "new.jsonl").write_text("".join(json.dumps({"text": f"new {i}"}) + "\n" for i in range(5)))
    sources = ", ".join(f"{{path: {tmp_path / name}.jsonl, weight: {WEIGHTS.get(name, 1.0)}}}"
                        for name in [*SIZES, "new"])
    cfg = load_config(None, [f"data.sources=[{sources}]", "data.format=text", "data.max_seq_len=16",
                             f"data.cache_dir={tmp_path / 'cache'}"])
    logs = []
    mixture = prepare_mixture(cfg.data, tok, 0, 6, log=logs.append)
    assert sum("loaded tokenized data from cache" in line for line in logs) == 3
    assert any(line.startswith("data new.jsonl: 5 rows") for line in logs)
    assert mixture.names == ["small", "large", "mid", "new"] and len(mixture) == 54
