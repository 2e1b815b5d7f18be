import numpy as np
import pytest

from isotrain.data.sampler import GlobalBatchSampler
from isotrain.errors import ConfigError, DataError

N, G = 64, 16


def assembled(sampler, step, dp_size, micro_batch_size):
    """The global batch as the union of every rank's micro-batches, in rank then micro order."""
    parts = []
    for rank in range(dp_size):
        micro = sampler.micro_batches(step, rank, dp_size, micro_batch_size)
        assert all(len(m) == micro_batch_size for m in micro)
        parts.extend(micro)
    return np.concatenate(parts)


def test_global_batches_do_not_depend_on_the_layout():
    """Invariant 3: the same ids, in the same order, for any DP size and micro-batch size."""
    for step in range(3 * (N // G) + 1):  # spans epochs
        reference = GlobalBatchSampler(N, G, seed=3).global_batch(step)
        for dp_size in (1, 2, 4):
            per_rank = G // dp_size
            for micro_batch_size in [m for m in range(1, per_rank + 1) if per_rank % m == 0]:
                # A fresh sampler per layout: nothing may leak from one layout to another.
                sampler = GlobalBatchSampler(N, G, seed=3)
                got = assembled(sampler, step, dp_size, micro_batch_size)
                assert got.tolist() == reference.tolist(), (step, dp_size, micro_batch_size)


def test_batches_of_an_epoch_are_disjoint_and_cover_whole_batches():
    sampler = GlobalBatchSampler(70, G, seed=0)  # 70 = 4 * 16 + 6: the tail of 6 is not used
    assert sampler.steps_per_epoch == 4
    batches = [sampler.global_batch(step) for step in range(4)]
    ids = np.concatenate(batches)
    assert len(ids) == len(set(ids.tolist())) == G * 4
    assert ids.min() >= 0 and ids.max() < 70


def test_each_epoch_has_its_own_permutation_and_seeds_reproduce():
    sampler = GlobalBatchSampler(N, G, seed=0)
    epoch_0 = np.concatenate([sampler.global_batch(s) for s in range(4)])
    epoch_1 = np.concatenate([sampler.global_batch(s) for s in range(4, 8)])
    assert sorted(epoch_0.tolist()) == sorted(epoch_1.tolist()) == list(range(N))
    assert epoch_0.tolist() != epoch_1.tolist()
    again = GlobalBatchSampler(N, G, seed=0)
    assert [again.global_batch(s).tolist() for s in (6, 0, 5)] == [
        sampler.global_batch(s).tolist() for s in (6, 0, 5)
    ]  # random access in any order: no hidden position
    other_seed = GlobalBatchSampler(N, G, seed=1)
    assert other_seed.global_batch(0).tolist() != sampler.global_batch(0).tolist()
    assert GlobalBatchSampler(N, G, seed=-5).global_batch(0).shape == (G,)


def test_no_shuffle_reads_in_order():
    sampler = GlobalBatchSampler(N, G, seed=0, shuffle=False)
    assert sampler.global_batch(1).tolist() == list(range(16, 32))
    assert sampler.rank_slice(1, 1, 2).tolist() == list(range(24, 32))


def test_too_little_data_and_indivisible_layouts_are_clear_errors():
    with pytest.raises(DataError, match=r"10 samples, fewer than train.global_batch_size=16; use a smaller"):
        GlobalBatchSampler(10, 16, seed=0)
    sampler = GlobalBatchSampler(N, G, seed=0)
    with pytest.raises(ConfigError, match="not divisible by the data-parallel size 3"):
        sampler.rank_slice(0, 0, 3)
    with pytest.raises(ConfigError, match="micro_batch_size=3 does not divide the 8 samples per rank"):
        sampler.micro_batches(0, 0, 2, 3)


def test_state_dict_guards_resume_compatibility():
    sampler = GlobalBatchSampler(N, G, seed=0)
    state = sampler.state_dict()
    assert state == {"num_samples": N, "global_batch_size": G, "seed": 0, "shuffle": True}
    GlobalBatchSampler(N, G, seed=0).check_compatible(state)
    with pytest.raises(ConfigError, match="global_batch_size=16 but this run has 32"):
        GlobalBatchSampler(N, 32, seed=0).check_compatible(state)
    with pytest.raises(ConfigError, match="num_samples=64 but this run has 65"):
        GlobalBatchSampler(65, G, seed=0).check_compatible(state)
