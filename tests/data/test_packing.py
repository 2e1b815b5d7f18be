import numpy as np
import pytest

from isotrain.data.packing import pack_examples, to_samples
from isotrain.data.tokenize import Example, shifted_labels


def make_examples(lengths, seed=0):
    rng = np.random.default_rng(seed)
    examples = []
    for row_id, n in enumerate(lengths, start=1):
        ids = rng.integers(5, 60, size=n).tolist()
        labels = shifted_labels(ids, [False] + [True] * (n - 1))
        examples.append(Example(np.asarray(ids, dtype=np.int64), labels, row_id))
    return examples


def docs_of(sample):
    """(row_id, input_ids, labels) of every document, cut at position-id restarts."""
    starts = np.flatnonzero(sample.position_ids == 0).tolist() + [len(sample)]
    return [
        (row_id, sample.input_ids[a:b].tolist(), sample.labels[a:b].tolist())
        for row_id, a, b in zip(sample.row_ids, starts[:-1], starts[1:])
    ]


def test_packing_keeps_every_document_whole_once_and_within_length():
    lengths = np.random.default_rng(1).integers(2, 33, size=200).tolist()
    examples = make_examples(lengths)
    samples = pack_examples(examples, max_seq_len=32)
    assert all(len(sample) <= 32 for sample in samples)
    seen = {}
    for sample in samples:
        for row_id, ids, labels in docs_of(sample):
            assert row_id not in seen
            seen[row_id] = (ids, labels)
    assert sorted(seen) == [e.row_id for e in examples]
    for example in examples:  # no document was split or altered
        assert seen[example.row_id] == (example.input_ids.tolist(), example.labels.tolist())
    # Any-fit packing opens a sample only for a document that fits no open one, so at most one
    # sample can end up at most half full; a packer that never combines would fail this.
    assert sum(len(sample) <= 16 for sample in samples) <= 1
    assert len(samples) < len(examples)


def test_position_and_segment_ids_restart_per_document():
    samples = pack_examples(make_examples([3, 2, 4]), max_seq_len=10)
    assert len(samples) == 1
    sample = samples[0]
    assert sample.row_ids == (1, 2, 3)  # original order inside a sample
    assert sample.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert sample.segment_ids.tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2]
    # The last label of each document is ignored, so no label crosses a boundary.
    assert [sample.labels[i] for i in (2, 4, 8)] == [-100, -100, -100]


def test_best_fit_decreasing_is_deterministic_with_ties_by_order():
    lengths = [4, 6, 4, 2, 6, 3, 5]
    first = pack_examples(make_examples(lengths), max_seq_len=10)
    second = pack_examples(make_examples(lengths), max_seq_len=10)
    assert [s.row_ids for s in first] == [s.row_ids for s in second]
    # Placed as 6(row 2) 6(5) 5(7) 4(1) 4(3) 3(6) 2(4), each into the open bin with the least room
    # that fits (oldest bin on ties): 4(1) joins row 2, 4(3) joins row 5, 3 and 2 join row 7.
    assert [s.row_ids for s in first] == [(1, 2), (3, 5), (4, 6, 7)]


def test_unpacked_samples_have_one_segment_each():
    examples = make_examples([3, 5])
    samples = to_samples(examples)
    assert [s.row_ids for s in samples] == [(1,), (2,)]
    assert samples[1].position_ids.tolist() == [0, 1, 2, 3, 4]
    assert samples[1].segment_ids.tolist() == [0] * 5


def test_an_example_longer_than_max_seq_len_is_refused():
    with pytest.raises(ValueError, match="max_seq_len=4"):
        pack_examples(make_examples([5]), max_seq_len=4)
