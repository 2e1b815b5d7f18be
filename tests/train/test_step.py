"""The SFT step (`train_step`): the same maths as forward_backward + optimizer_step, with one host sync, and a
packed global batch gives the loss, gradient norm and update of the same documents unpacked.

Tiny Llama (hidden 64, 2 layers), token-mean loss; documents of long-tailed lengths (3..40 tokens) with
prompt-masked first tokens, packed by isotrain's best-fit packer into rows of at most 48 tokens; the
gradients are compared as `train_step` leaves them before its update.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from isotrain.config import ModelConfig, TrainConfig
from isotrain.data.collate import collate
from isotrain.data.packing import pack_examples, to_samples
from isotrain.data.tokenize import Example, shifted_labels
from isotrain.models.build import build_plain
from isotrain.models.tokenizer import train_tokenizer
from isotrain.train.optim import build_optimizer
from isotrain.train.step import StepOptions, forward_backward, optimizer_step, train_step

CPU = torch.device("cpu")
LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64}
LENGTHS = [40, 3, 17, 9, 25, 5, 31, 12, 4, 22]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["0123456789 abcdefghijklmnopqrstuvwxyz+="] * 4, "char", 64)


@pytest.fixture(scope="module")
def examples(tokenizer):
    rng = np.random.default_rng(0)
    docs = []
    for row, n in enumerate(LENGTHS):
        ids = rng.integers(4, len(tokenizer), size=n).tolist()
        prompt = min(2, n - 1)  # the first tokens are a prompt: not trained
        docs.append(Example(np.asarray(ids, dtype=np.int64), shifted_labels(ids, [False] * prompt + [True] * (n - prompt)), row))
    return docs


def model_and_optimizer(tokenizer):
    model = build_plain(ModelConfig(config=LLAMA), tokenizer, seed=1).train()
    return model, build_optimizer(model, TrainConfig(weight_decay=0.1))


def run_step(model, optimizer, micro_batches, grad_clip: float):
    """(StepResult, weights after the update, gradients before clipping and update)."""
    grads = {}

    def keep_grads():
        grads.update({name: p.grad.clone() for name, p in model.named_parameters()})

    result = train_step(model, optimizer, micro_batches, 1e-2, StepOptions(grad_clip=grad_clip), CPU, keep_grads)
    return result, {name: p.detach().clone() for name, p in model.named_parameters()}, grads


@pytest.mark.parametrize("grad_clip", [0.05, 0.0])  # 0.05 clips: the norm is ~1 at initialisation
def test_train_step_equals_forward_backward_then_optimizer_step(tokenizer, examples, grad_clip):
    micro_batches = [collate(to_samples(examples[i : i + 4]), tokenizer.pad_token_id) for i in (0, 4, 8)]
    model, optimizer = model_and_optimizer(tokenizer)
    reference_model, reference_optimizer = copy.deepcopy(model), None
    reference_optimizer = build_optimizer(reference_model, TrainConfig(weight_decay=0.1))
    for _ in range(2):  # the second step runs on AdamW moments of the first
        result, weights, _ = run_step(model, optimizer, micro_batches, grad_clip)
        loss, counts = forward_backward(reference_model, micro_batches, StepOptions(grad_clip=grad_clip), CPU)
        params = [p for p in reference_model.parameters() if p.requires_grad]
        norm = optimizer_step(reference_optimizer, params, 1e-2, grad_clip, loss)
        assert (result.loss, result.grad_norm) == (loss, norm)
        assert (result.num_input_tokens, result.num_trained_tokens, result.num_samples) == (counts[0], counts[1], counts[3])
        for name, param in reference_model.named_parameters():
            assert torch.equal(weights[name], param), name


def test_a_packed_global_batch_trains_like_the_same_documents_unpacked(tokenizer, examples):
    packed = pack_examples(examples, max_seq_len=48)
    assert len(packed) < len(examples) and max(len(s.row_ids) for s in packed) >= 3
    packed_batches = [collate(packed[i : i + 2], tokenizer.pad_token_id) for i in range(0, len(packed), 2)]
    alone_batches = [collate(to_samples(examples[i : i + 5]), tokenizer.pad_token_id) for i in (0, 5)]

    model, optimizer = model_and_optimizer(tokenizer)
    alone_model, alone_optimizer = copy.deepcopy(model), None
    alone_optimizer = build_optimizer(alone_model, TrainConfig(weight_decay=0.1))
    got, _, got_grads = run_step(model, optimizer, packed_batches, 1.0)
    want, _, want_grads = run_step(alone_model, alone_optimizer, alone_batches, 1.0)

    assert (got.num_input_tokens, got.num_trained_tokens) == (want.num_input_tokens, want.num_trained_tokens)
    assert got.num_input_tokens == sum(LENGTHS)
    assert (got.num_samples, want.num_samples) == (len(packed), len(examples))
    assert got.loss == pytest.approx(want.loss, rel=1e-6)
    assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-5)
    # Gradients, not weights: AdamW's first update is ≈ lr·sign(g), so fp32 rounding of a near-zero gradient
    # entry (packed rows sum in another order) can flip single weights by 2·lr without any error in the maths.
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
