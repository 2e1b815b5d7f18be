"""The order of training samples, as a pure function of (seed, epoch, dataset size, global batch).

Invariant 3: the global batch of step k is

    epoch  = k // steps_per_epoch
    perm   = permutation of range(num_samples) drawn from rng(seed, epoch)
    batch  = table(epoch)[perm[(k % steps_per_epoch) * G : (k % steps_per_epoch + 1) * G]]

where table(epoch) is the identity for one dataset, and for a weighted mixture the samples that mixture
epoch holds (data/mixture.py: a pure function of the seed, the sources, their weights and sizes).

The world size, micro-batch size and gradient accumulation only decide how a batch is *cut*
(rank r takes the contiguous slice [r*G/dp, (r+1)*G/dp), then consecutive micro-batches), never
which samples it holds. The sampler keeps no position: the trainer passes the step, so resuming
at step k on any layout continues with exactly batch k.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from isotrain.errors import ConfigError, DataError


class GlobalBatchSampler:
    def __init__(self, num_samples: int, global_batch_size: int, seed: int, shuffle: bool = True,
                 epoch_table: Callable[[int], np.ndarray] | None = None):
        """`epoch_table(epoch)`: the `num_samples` dataset indices that epoch holds, position by position (a
        mixture's); None: position j is sample j in every epoch."""
        if global_batch_size <= 0:
            raise ConfigError(f"train.global_batch_size={global_batch_size} must be positive")
        self.num_samples = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch_table = epoch_table
        # Each epoch uses only whole global batches; the tail of the permutation is left out.
        self.steps_per_epoch = num_samples // global_batch_size
        if self.steps_per_epoch == 0:
            raise DataError(
                f"the dataset has {num_samples} samples, fewer than train.global_batch_size={global_batch_size}; "
                "use a smaller global batch or more data"
            )
        self._cached_epoch: int | None = None  # memo of the last permutation, not a position
        self._cached_perm: np.ndarray | None = None

    def permutation(self, epoch: int) -> np.ndarray:
        """The sample order of `epoch`: depends on (seed, epoch, num_samples) only."""
        if epoch != self._cached_epoch:
            if self.shuffle:
                # SeedSequence needs non-negative entries; seed % 2**64 is a bijection on int64 seeds.
                rng = np.random.default_rng([self.seed % 2**64, epoch])
                perm = rng.permutation(self.num_samples)
            else:
                perm = np.arange(self.num_samples)
            self._cached_epoch, self._cached_perm = epoch, perm.astype(np.int64)
        return self._cached_perm

    def global_batch(self, step: int) -> np.ndarray:
        """Indices of the `global_batch_size` samples that optimizer step `step` learns from."""
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        epoch, index = divmod(step, self.steps_per_epoch)
        start = index * self.global_batch_size
        positions = self.permutation(epoch)[start : start + self.global_batch_size]
        return positions.copy() if self.epoch_table is None else self.epoch_table(epoch)[positions]

    def rank_slice(self, step: int, dp_rank: int, dp_size: int) -> np.ndarray:
        """The contiguous share of data-parallel rank `dp_rank` in the global batch of `step`."""
        if self.global_batch_size % dp_size != 0:
            raise ConfigError(
                f"train.global_batch_size={self.global_batch_size} is not divisible by the data-parallel "
                f"size {dp_size}; use a multiple of {dp_size}"
            )
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside [0, {dp_size})")
        per_rank = self.global_batch_size // dp_size
        return self.global_batch(step)[dp_rank * per_rank : (dp_rank + 1) * per_rank]

    def micro_batches(self, step: int, dp_rank: int, dp_size: int, micro_batch_size: int) -> list[np.ndarray]:
        """The rank's share cut into consecutive micro-batches of `micro_batch_size` samples."""
        share = self.rank_slice(step, dp_rank, dp_size)
        if micro_batch_size <= 0 or len(share) % micro_batch_size != 0:
            raise ConfigError(
                f"train.micro_batch_size={micro_batch_size} does not divide the {len(share)} samples per rank "
                f"(global batch {self.global_batch_size} / {dp_size} ranks); use a divisor of {len(share)}"
            )
        return [share[i : i + micro_batch_size] for i in range(0, len(share), micro_batch_size)]

    def state_dict(self) -> dict:
        return {
            "num_samples": self.num_samples,
            "global_batch_size": self.global_batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def check_compatible(self, state: dict) -> None:
        """Refuse to resume with a data order different from the checkpoint's."""
        current = self.state_dict()
        for key, value in current.items():
            if state.get(key) != value:
                raise ConfigError(
                    f"the checkpoint was trained with data order {key}={state.get(key)!r} but this run has {value!r}; "
                    "resume with the same data, train.global_batch_size and train.seed, or start a new output_dir"
                )
