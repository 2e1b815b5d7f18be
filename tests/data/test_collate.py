import numpy as np
import pytest
import torch

from isotrain.data.collate import collate
from isotrain.data.packing import pack_examples, sample_from_documents, to_samples
from isotrain.data.tokenize import Example, shifted_labels

PAD = 0


def example(ids, num_prompt=1, row_id=0):
    targets = [False] * num_prompt + [True] * (len(ids) - num_prompt)
    return Example(np.asarray(ids, dtype=np.int64), shifted_labels(ids, targets), row_id)


def test_padding_values_and_token_counts():
    packed = sample_from_documents([example([5, 6, 7]), example([8, 9], num_prompt=2)])
    single = to_samples([example([10, 11])])[0]
    batch = collate([packed, single], pad_id=PAD)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9], [10, 11, PAD, PAD, PAD]]
    assert batch["labels"].tolist() == [[6, 7, -100, -100, -100], [11, -100, -100, -100, -100]]
    # Padding continues the last document's positions, so it never looks like a new document.
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 3, 4]]
    assert batch["segment_ids"].tolist() == [[0, 0, 0, 1, 1], [0, 0, -1, -1, -1]]
    assert batch["num_input_tokens"] == 7 and batch["num_trained_tokens"] == 3
    assert isinstance(batch["num_input_tokens"], int) and isinstance(batch["num_trained_tokens"], int)
    assert all(batch[k].dtype == torch.int64 for k in ("input_ids", "labels", "position_ids", "segment_ids"))
    assert "attention_mask" not in batch


@pytest.fixture(scope="module")
def tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config).float().eval()


def logits(model, batch):
    # use_cache=False as in training: with a KV cache transformers does not detect packed documents.
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits


def test_packed_documents_do_not_attend_to_each_other(tiny_llama):
    first, second = example([5, 6, 7, 8, 9], row_id=1), example([10, 11, 12, 13], row_id=2)
    [packed] = pack_examples([first, second], max_seq_len=16)
    assert packed.row_ids == (1, 2)
    together = logits(tiny_llama, collate([packed], PAD))
    alone = logits(tiny_llama, collate(to_samples([second]), PAD))
    torch.testing.assert_close(together[0, 5:], alone[0], atol=1e-5, rtol=0)
    # Sanity: without the position-id restart the second document does see the first.
    concatenated = collate(to_samples([example([5, 6, 7, 8, 9, 10, 11, 12, 13])]), PAD)
    assert not torch.allclose(logits(tiny_llama, concatenated)[0, 5:], alone[0], atol=1e-3)


def test_right_padding_does_not_change_real_tokens(tiny_llama):
    long, short = to_samples([example(list(range(3, 12))), example([20, 21, 22])])
    padded = logits(tiny_llama, collate([long, short], PAD))
    alone = logits(tiny_llama, collate([short], PAD))
    torch.testing.assert_close(padded[1, :3], alone[0], atol=1e-5, rtol=0)


def test_a_fixed_length_pads_every_row_to_it_and_keeps_the_counts():
    packed = sample_from_documents([example([5, 6, 7]), example([8, 9], num_prompt=2)])
    batch = collate([packed], pad_id=PAD, length=8)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, PAD, PAD, PAD]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]  # the padding continues the last document
    assert batch["labels"].tolist() == [[6, 7, -100, -100, -100, -100, -100, -100]]
    assert (batch["num_input_tokens"], batch["num_trained_tokens"]) == (5, 2)
    with pytest.raises(ValueError, match="a sample of 5 tokens does not fit the collate length 4"):
        collate([packed], pad_id=PAD, length=4)
