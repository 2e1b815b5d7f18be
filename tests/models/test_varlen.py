"""`model.attn_implementation=varlen` (isotrain/models/varlen.py) on CPU: where packed rows are cut into documents,
that the cut documents give the loss and every gradient of SDPA with transformers' per-document mask, and the
refusals. On CPU each document runs through SDPA alone; tests/cuda/test_cuda.py checks flash's kernel against
that on a GPU, and tests/train/test_packing_cli.py the whole run (one process and TP)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM, LlamaConfig, MistralConfig

from isotrain.errors import ConfigError
from isotrain.models import varlen
from isotrain.models.checks import attention_kernel
from isotrain.models.packing_check import lm_forward

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64)


def test_documents_start_at_every_position_restart_and_every_row():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2],    # three documents
                                 [0, 1, 2, 3, 4, 5, 6, 7],    # one (padding continues it)
                                 [8, 9, 0, 1, 2, 3, 4, 5]])   # continuing the row before's count: still a start
    bounds = varlen.document_bounds(position_ids)
    assert bounds["cu_seq_lens_q"].tolist() == [0, 3, 5, 8, 16, 18, 24]
    assert bounds["cu_seq_lens_q"].dtype == torch.int32 and bounds["cu_seq_lens_k"] is bounds["cu_seq_lens_q"]
    assert (bounds["max_length_q"], bounds["max_length_k"]) == (8, 8)


def _packed_batch():
    generator = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 64, (n,), generator=generator) for n in (5, 7, 4, 9, 3)]
    rows = [torch.cat([docs[0], docs[1], docs[2]]), torch.cat([docs[3], docs[4], docs[4][-1:].repeat(4)])]
    positions = [torch.cat([torch.arange(5), torch.arange(7), torch.arange(4)]),
                 torch.cat([torch.arange(9), torch.arange(7)])]  # the padding continues the last document
    return torch.stack(rows), torch.stack(positions)


def _loss_and_grads(kernel: str, with_mask: bool):
    config = LlamaConfig(**TINY)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention_kernel(kernel, config,
                                                                                         AutoModelForCausalLM))
    input_ids, position_ids = _packed_batch()
    logits = lm_forward(model, input_ids, position_ids, with_mask).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64), input_ids[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("with_mask", [False, True])
def test_cut_documents_give_the_masked_loss_and_gradients(with_mask, monkeypatch):
    """Against SDPA with the per-document mask (transformers' from position ids, or isotrain's own). The cut
    documents, not the mask beside them, must have produced the varlen run's attention: every layer's."""
    want_loss, want_grads = _loss_and_grads("sdpa", with_mask)
    cut, calls = varlen._per_document, []
    monkeypatch.setattr(varlen, "_per_document", lambda *args: calls.append(args[3].tolist()) or cut(*args))
    got_loss, got_grads = _loss_and_grads("varlen", with_mask)
    assert calls == [[0, 5, 12, 16, 25, 32]] * TINY["num_hidden_layers"]
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=0)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_a_forward_without_bounds_is_sdpa():
    """Generation and other callers that pass no document bounds get transformers' sdpa path unchanged."""
    config = LlamaConfig(**TINY)
    input_ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    logits = {}
    for kernel in ("sdpa", "varlen"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=attention_kernel(kernel, config,
                                                                                             AutoModelForCausalLM))
        logits[kernel] = model(input_ids=input_ids, use_cache=False).logits
    assert torch.equal(logits["varlen"], logits["sdpa"])


@pytest.mark.parametrize("config,model_class,sentence", [
    (LlamaConfig(**TINY, attention_dropout=0.1), AutoModelForCausalLM,
     "model.attn_implementation=varlen has no attention dropout, and this model's attention_dropout is 0.1; set "
     "model.attn_implementation=sdpa or the model's attention_dropout to 0"),
    (MistralConfig(**TINY, sliding_window=16), AutoModelForCausalLM,
     "model.attn_implementation=varlen attends to whole documents, and this mistral model has a sliding window of "
     "16 tokens; set model.attn_implementation=sdpa"),
    (LlamaConfig(**TINY), AutoModel,
     "model.attn_implementation=varlen runs packed causal-LM rows (isotrain train and rl), not an embedding "
     "encoder; set model.attn_implementation=sdpa or leave it unset"),
])
def test_what_the_kernel_cannot_do_is_refused_in_one_sentence(config, model_class, sentence):
    with pytest.raises(ConfigError) as caught:
        attention_kernel("varlen", config, model_class)
    assert str(caught.value) == sentence
