"""A weighted mixture of data sources: one sequence of samples that the world-size-free sampler indexes.

Sources i = 0..n-1 (`data.sources`, in order) are prepared on their own (tokenized, packed, cached: data/dataset.py),
N_i samples each, weights w_i > 0. The mixture is their concatenation (sample j of source i is mixture index
o_i + j, o_i = N_0 + ... + N_{i-1}), and one mixture epoch holds M = G · floor((N_0 + ... + N_{n-1}) / G) samples,
as many whole global batches of G as all sources together fill (none of its samples is left out of training):

    count    c_i: M seats apportioned by largest remainder over the quotas q_i = M · w_i / Σ_k w_k, computed
             exactly (a float weight is an exact binary fraction): floor(q_i) each, then one more to each of the
             M - Σ floor(q_i) sources with the largest remainders q_i - floor(q_i), ties to the lower i. Σ c_i = M;
             weights proportional to the sizes give c_i = N_i when G divides Σ N_k. A source whose c_i
             would be 0 is refused.
    stream   source i is read as an endless stream of its own epochs: own epoch f is the permutation of
             range(N_i) drawn from rng(seed, STREAM_TAG, i, f), and stream position t is sample
             perm_{i, t // N_i}[t mod N_i].
    epoch e  holds the stream positions [e · c_i, (e + 1) · c_i) of every source (table_e, source by source).
             A source with c_i > N_i repeats inside one mixture epoch (over its own epochs); one with c_i < N_i
             is cycled across mixture epochs. Source i restarts (a new own epoch, reshuffled) at every stream
             position that is a multiple of N_i, wherever in a mixture epoch that falls; after e mixture epochs it
             has been read exactly e · c_i / N_i times, and after step k, (its samples in batches 0..k) / N_i times.
    order    the sampler shuffles table_e's positions like one dataset's (a permutation of range(M) from
             rng(seed, e)): global batch k is table_e[perm_e[(k mod S) · G : (k mod S + 1) · G]], e = k // S,
             S = M / G (data/sampler.py): every position of table_e is trained, so every stream position once.

The global batch of step k is therefore a pure function of (seed, the sources in order, their weights and sizes,
G, k): no world size, micro-batch size or GA enters it (invariant 3), and a run resumed at step k on any layout
continues with batch k. Invariant 2: the totals of a mixture epoch (samples, input and trained tokens of the
samples table_e holds) are exact integer sums read from the stores' indexes; epoch 0's are the mixture's
DataStats and are logged at start-up, with each source's share. Per-source counts of what the run has consumed
(`SourceCounters`) are sums over the global batches, the same on every rank and for every layout.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path

import numpy as np

from isotrain.config import SFTDataConfig
from isotrain.data.dataset import DataStats, Dataset, prepare_dataset
from isotrain.data.packing import Sample
from isotrain.errors import DataError

STREAM_TAG = 0x6D6978  # "mix": keeps the sources' streams apart from the sampler's rng(seed, epoch)


def apportion(total: int, weights: Sequence[float]) -> np.ndarray:
    """Largest-remainder apportionment of `total` seats by `weights` (module docstring), exactly."""
    exact = [Fraction(weight) for weight in weights]
    quotas = [total * weight / sum(exact) for weight in exact]
    counts = [int(quota) for quota in quotas]  # floor: quotas are >= 0
    by_remainder = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in by_remainder[: total - sum(counts)]:
        counts[i] += 1
    return np.array(counts, dtype=np.int64)


class MixtureOrder:
    """Which mixture indices each mixture epoch holds, for sources of `sizes` samples and `weights` (module
    docstring): what a mixture of prepared stores (`Mixture`) and of RL's prompt sets have in common."""

    def __init__(self, sizes: Sequence[int], weights: Sequence[float], names: Sequence[str], seed: int,
                 global_batch_size: int, input_tokens: np.ndarray | None = None,
                 trained_tokens: np.ndarray | None = None):
        """`input_tokens`, `trained_tokens`: per mixture index, for `tally` (zeros when not given)."""
        self.weights, self.names, self.seed = list(weights), list(names), seed
        self.sizes = np.array(sizes, dtype=np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        total = len(self)
        # Whole global batches (module docstring); fewer samples than one batch are left to the sampler to refuse.
        self.epoch_samples = total - total % global_batch_size if total >= global_batch_size else total
        self.counts = apportion(self.epoch_samples, weights)
        for i, count in enumerate(self.counts):
            if count == 0:
                raise DataError(f"data.sources[{i}] ({names[i]!r}, weight {weights[i]:g}) gets 0 of the "
                                f"{self.epoch_samples} samples of a mixture epoch; raise its weight or remove the "
                                "source")
        zeros = np.zeros(total, dtype=np.int64)
        self.input_tokens = zeros if input_tokens is None else np.asarray(input_tokens, dtype=np.int64)
        self.trained_tokens = zeros if trained_tokens is None else np.asarray(trained_tokens, dtype=np.int64)
        self._memo: tuple[int, np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def source_of(self, indices: np.ndarray) -> np.ndarray:
        """The source of each mixture index."""
        return np.searchsorted(self.offsets, indices, side="right") - 1

    def tally(self, indices: np.ndarray) -> np.ndarray:
        """[3, n]: samples, input tokens and trained tokens of each source among the mixture `indices`."""
        sources = self.source_of(indices)
        n = len(self.names)
        return np.stack([np.bincount(sources, minlength=n),
                         np.bincount(sources, weights=self.input_tokens[indices], minlength=n),
                         np.bincount(sources, weights=self.trained_tokens[indices], minlength=n)]).astype(np.int64)

    def describe(self, unit: str = "samples") -> list[str]:
        """The start-up lines: how many `unit` a mixture epoch holds, each source's share of it and when it
        restarts, and mixture epoch 0's exact totals."""
        epoch = self.tally(self.epoch_table(0))
        total = sum(Fraction(weight) for weight in self.weights)
        lines = [f"mixture of {len(self.names)} sources; a mixture epoch holds {self.epoch_samples} {unit} (of "
                 f"{len(self)}: whole global batches; largest-remainder shares of the weights, docs/data.md):"]
        for i, name in enumerate(self.names):
            lines.append(f"  {name}: weight {self.weights[i]:g} ({float(Fraction(self.weights[i]) / total):.1%}) -> "
                         f"{self.counts[i]} of its {self.sizes[i]} {unit} per mixture epoch "
                         f"({self.counts[i] / self.sizes[i]:.3g} of its own epochs), {epoch[1, i]:,} tokens, "
                         f"{epoch[2, i]:,} trained")
        lines.append(f"mixture epoch 0: {self.epoch_samples} {unit}, {int(epoch[1].sum()):,} tokens, "
                     f"{int(epoch[2].sum()):,} trained (exact)")
        return lines

    def epoch_table(self, epoch: int) -> np.ndarray:
        """table_e: the M mixture indices that mixture epoch `epoch` holds, source by source (module docstring)."""
        if self._memo is None or self._memo[0] != epoch:
            parts = [self._stream(i, epoch * int(count), int(count)) for i, count in enumerate(self.counts)]
            self._memo = (epoch, np.concatenate(parts))
        return self._memo[1]

    def _stream(self, source: int, start: int, count: int) -> np.ndarray:
        """Mixture indices of stream positions [start, start + count) of `source`."""
        size, parts = int(self.sizes[source]), []
        while count > 0:
            own_epoch, position = divmod(start, size)
            take = min(size - position, count)
            rng = np.random.default_rng([self.seed % 2**64, STREAM_TAG, source, own_epoch])
            parts.append(rng.permutation(size)[position : position + take])
            start, count = start + take, count - take
        return np.concatenate(parts) + self.offsets[source]


class Mixture(MixtureOrder, Sequence):
    """The concatenated samples of several prepared sources, and the samples each mixture epoch holds."""

    def __init__(self, datasets: list[Dataset], weights: list[float], names: list[str], seed: int,
                 global_batch_size: int, trained_counts: list[np.ndarray]):
        # Per mixture index, read from the stores' indexes once: 8 bytes per sample each, like the index itself.
        super().__init__([len(dataset) for dataset in datasets], weights, names, seed, global_batch_size,
                         np.concatenate([dataset.samples.lengths() for dataset in datasets]),
                         np.concatenate(trained_counts))
        self.datasets = datasets
        self.stats = self._epoch_stats()
        self.cache_path = None

    def __getitem__(self, index: int) -> Sample:
        source = self.source_of(np.array([index]))[0]
        return self.datasets[source][int(index) - int(self.offsets[source])]

    @property
    def fingerprint(self) -> str:
        """What a resume must match: every source's cache entry and weight, in order (the names are only labels)."""
        spec = [[Path(dataset.cache_path).name, repr(float(weight))] for dataset, weight in zip(self.datasets,
                                                                                                 self.weights)]
        return "mixture-" + hashlib.sha256(json.dumps(spec).encode()).hexdigest()

    def _epoch_stats(self) -> DataStats:
        """Mixture epoch 0 as one dataset: its exact totals, and the row counts of all sources."""
        _, tokens, trained = self.tally(self.epoch_table(0)).sum(axis=1)
        parts = [dataset.stats for dataset in self.datasets]
        return DataStats(
            num_rows_read=sum(s.num_rows_read for s in parts), num_rows_skipped=sum(s.num_rows_skipped for s in parts),
            skipped=[], num_truncated=sum(s.num_truncated for s in parts), num_samples=self.epoch_samples,
            total_input_tokens=int(tokens), total_trained_tokens=int(trained),
            num_documents=sum(s.num_documents for s in parts), num_split=sum(s.num_split for s in parts),
            num_pieces=sum(s.num_pieces for s in parts), corpus_tokens=sum(s.corpus_tokens for s in parts),
            corpus_trained_tokens=sum(s.corpus_trained_tokens for s in parts))


class SourceCounters:
    """Exact per-source sums of the samples, input tokens and trained tokens that the run's global batches held,
    and each source's own epochs read (samples / N_i): the metrics.jsonl fields `source/<name>/...`."""

    def __init__(self, mixture: MixtureOrder, sampler, step: int):
        """The sums over the global batches of steps [0, step) of `sampler` (a GlobalBatchSampler over
        `mixture`), e.g. where a resumed run starts."""
        self.mixture, self.sampler = mixture, sampler
        whole_epochs, rest = divmod(step, sampler.steps_per_epoch)
        self.totals = np.zeros((3, len(mixture.names)), dtype=np.int64)
        for epoch in range(whole_epochs + 1):
            positions = sampler.permutation(epoch)[: None if epoch < whole_epochs else rest * sampler.global_batch_size]
            self.totals += mixture.tally(mixture.epoch_table(epoch)[positions])

    def add_step(self, step: int) -> dict:
        """Add global batch `step` and return the metrics fields after it."""
        self.totals += self.mixture.tally(self.sampler.global_batch(step))
        row = {}
        for i, name in enumerate(self.mixture.names):
            row[f"source/{name}/samples_seen"] = int(self.totals[0, i])
            row[f"source/{name}/tokens_seen"] = int(self.totals[1, i])
            row[f"source/{name}/trained_tokens"] = int(self.totals[2, i])
            row[f"source/{name}/epochs"] = float(self.totals[0, i] / self.mixture.sizes[i])
        return row


def prepare_mixture(data_cfg: SFTDataConfig, tokenizer, seed: int, global_batch_size: int, *, log=print) -> Mixture:
    """Each of `data_cfg.sources` prepared like data.path (its own cache entry, so adding a source tokenizes only
    that one), then their mixture for `seed` in global batches of `global_batch_size`."""
    datasets, trained = [], []
    for i, source in enumerate(data_cfg.sources):
        source_cfg = data_cfg.model_copy(update={"path": source.path, "format": source.format or data_cfg.format,
                                                 "sources": None})
        dataset = prepare_dataset(source_cfg, tokenizer, log=log, field=f"data.sources[{i}].path")
        datasets.append(dataset)
        trained.append(dataset.trained_counts())
    mixture = Mixture(datasets, [source.weight for source in data_cfg.sources],
                      [source.label for source in data_cfg.sources], seed, global_batch_size, trained)
    for line in mixture.describe():
        log(line)
    return mixture

