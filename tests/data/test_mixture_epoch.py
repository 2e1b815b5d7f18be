"""What a mixture epoch is (data/mixture.py): whole global batches of the sources' samples, every one of them
trained, so each source's stream is read without a gap and its logged epochs are exact."""

import numpy as np

from isotrain.data.mixture import MixtureOrder, SourceCounters, apportion
from isotrain.data.sampler import GlobalBatchSampler

SIZES, WEIGHTS, NAMES = [7, 30, 12], [1.0, 1.0, 3.0], ["small", "large", "mid"]


def test_a_mixture_epoch_is_whole_global_batches_and_every_sample_of_it_trains():
    """49 samples in global batches of 4: a mixture epoch holds 48, apportioned by the weights, and its 12 steps
    train exactly those 48; the large source (9 per mixture epoch) gives its 30 samples once each over its first 30
    stream positions, before any repeats, even though 4 does not divide 49."""
    order = MixtureOrder(SIZES, WEIGHTS, NAMES, seed=3, global_batch_size=4,
                         input_tokens=np.arange(49) % 5 + 1, trained_tokens=np.arange(49) % 3)
    assert (len(order), order.epoch_samples) == (49, 48)
    assert order.counts.tolist() == apportion(48, WEIGHTS).tolist() == [10, 9, 29]
    sampler = GlobalBatchSampler(order.epoch_samples, 4, 3, epoch_table=order.epoch_table)
    assert sampler.steps_per_epoch == 12
    trained = [sampler.global_batch(k) for k in range(12 * 4)]
    for epoch in range(4):
        held = np.concatenate(trained[12 * epoch : 12 * (epoch + 1)])
        assert sorted(held.tolist()) == sorted(order.epoch_table(epoch).tolist())  # nothing left out
        assert order.tally(held)[0].tolist() == [10, 9, 29]
    large = [int(i) - 7 for batch in trained for i in batch if 7 <= i < 37]
    assert len(large) == 36 and len(set(large[:27])) == 27  # 3 mixture epochs: no repeat yet
    assert set(large) == set(range(30))  # the 4th completes the stream's own epoch 0: every sample once
    # The logged epochs are exact: after e mixture epochs, source i has been read e · c_i / N_i times.
    counters = SourceCounters(order, sampler, 0)
    for step in range(24):
        row = counters.add_step(step)
    assert [row[f"source/{name}/epochs"] for name in NAMES] == [2 * 10 / 7, 2 * 9 / 30, 2 * 29 / 12]
    assert sum(row[f"source/{name}/tokens_seen"] for name in NAMES) == \
        int(sum(order.input_tokens[np.concatenate(trained[:24])]))
    assert order.describe()[0] == ("mixture of 3 sources; a mixture epoch holds 48 samples (of 49: whole global "
                                   "batches; largest-remainder shares of the weights, docs/data.md):")


def test_when_the_batch_divides_the_sources_the_epoch_holds_them_all():
    order = MixtureOrder(SIZES, WEIGHTS, NAMES, seed=0, global_batch_size=7)
    assert order.epoch_samples == 49 and order.counts.tolist() == apportion(49, WEIGHTS).tolist()
