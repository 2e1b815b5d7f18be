"""train.loss_chunk_tokens: the chunked cross-entropy gives the unchunked loss and gradients, and never holds the
logits of more than one chunk.

Tiny Llama / Qwen3-MoE (hidden 32, 2 layers, vocabulary 64) on equivalence_worker's batch: variable lengths, padding,
prompt-masked tokens and one packed sample of two documents. fp64 agrees to ~1e-15; fp32 within rounding (1e-6
relative: the chunk sums and the head's gradient are summed in another order). Layouts (DDP 2, FSDP2 2) are in
test_equivalence.py.
"""

from __future__ import annotations

import copy

import pytest
import torch

from equivalence_worker import VOCAB, make_samples, tiny_model
from isotrain.config import MoeConfig
from isotrain.data.collate import collate
from isotrain.errors import ConfigError
from isotrain.moe.settings import router_settings
from isotrain.train.chunked_loss import check_chunked_loss_settings, check_head_is_linear
from isotrain.train.step import StepOptions, forward_backward, train_step

CPU = torch.device("cpu")


def micro_batches(size: int = 4) -> list[dict]:
    samples = make_samples()
    return [collate(samples[i : i + size], pad_id=0) for i in range(0, len(samples), size)]


def loss_and_grads(model, options: StepOptions, size: int = 4):
    loss, counts = forward_backward(model, micro_batches(size), options, CPU)
    return loss, {name: p.grad.clone() for name, p in model.named_parameters()}


def worst_relative(grads: dict, reference: dict) -> float:
    return max(float((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)) for n, g in reference.items())


@pytest.mark.parametrize("reduction", ["token", "sequence"])
@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("chunk_tokens", [1, 7, 4096])  # one token, chunks across rows, one chunk
def test_chunked_loss_equals_the_unchunked_loss(reduction, dtype, tolerance, chunk_tokens):
    model = tiny_model(dtype).train()
    chunked = copy.deepcopy(model)
    want_loss, want_grads = loss_and_grads(model, StepOptions(loss_reduction=reduction))
    loss, grads = loss_and_grads(chunked, StepOptions(loss_reduction=reduction, loss_chunk_tokens=chunk_tokens))
    assert loss == pytest.approx(want_loss, rel=tolerance)
    assert worst_relative(grads, want_grads) <= tolerance


def test_per_document_mask_and_bf16_autocast_are_kept():
    """The mask isotrain passes for families that ignore position restarts, and the step's autocast: the head runs
    in bf16, the loss in fp32, as unchunked."""
    options = StepOptions(document_mask=True, autocast_dtype=torch.bfloat16)
    model = tiny_model(torch.float32).train()
    chunked = copy.deepcopy(model)
    want_loss, want_grads = loss_and_grads(model, options)
    loss, grads = loss_and_grads(chunked, StepOptions(document_mask=True, autocast_dtype=torch.bfloat16,
                                                      loss_chunk_tokens=16))
    assert loss == pytest.approx(want_loss, rel=1e-6)
    # Each chunk's bf16 head gradient is rounded (2^-8 ≈ 4e-3) before the chunks are summed in fp32, where the
    # unchunked matmul rounds once: a few bf16 roundings, far below a missing or doubled term.
    assert worst_relative(grads, want_grads) <= 2e-2


def test_activation_checkpointing_is_kept():
    """Checkpointed decoder layers (train.activation_checkpointing=full) under the chunked loss's hooks."""
    from isotrain.parallel.apply import apply_activation_checkpointing

    model = tiny_model(torch.float64).train()
    chunked = copy.deepcopy(model)
    apply_activation_checkpointing(chunked)
    want_loss, want_grads = loss_and_grads(model, StepOptions())
    loss, grads = loss_and_grads(chunked, StepOptions(loss_chunk_tokens=7))
    assert loss == pytest.approx(want_loss, rel=1e-12)
    assert worst_relative(grads, want_grads) <= 1e-12


@pytest.mark.parametrize("scope", ["global", "micro_batch"])
def test_moe_router_terms_are_unchanged(scope):
    """An MoE model's step (router logits, aux and z-loss, the routing pre-pass of the global scope) with the
    chunked loss: the same objective, router values and update."""
    model = tiny_model(torch.float64, "qwen3_moe").train()
    chunked = copy.deepcopy(model)
    settings = router_settings(MoeConfig(aux_loss_coef=0.5, z_loss_coef=0.01, aux_loss_scope=scope), model.config)
    results = []
    for m, chunk_tokens in ((model, 0), (chunked, 5)):
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
        options = StepOptions(router=settings, loss_chunk_tokens=chunk_tokens)
        results.append(train_step(m, optimizer, micro_batches(), 0.1, options, CPU))
    want, got = results
    assert got.loss == pytest.approx(want.loss, rel=1e-12) and got.router.aux_loss > 0
    assert (got.router.aux_loss, got.router.z_loss) == pytest.approx((want.router.aux_loss, want.router.z_loss),
                                                                     rel=1e-12)
    for (name, p), q in zip(chunked.named_parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14, msg=name)


def peak_bytes(model, batch: list[dict], chunk_tokens: int) -> int:
    """The most CPU memory live at once during one forward_backward, from the profiler's allocation events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        forward_backward(model, batch, StepOptions(loss_chunk_tokens=chunk_tokens), CPU)
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    return peak


def test_no_step_holds_more_than_one_chunk_of_logits():
    """Forward and backward (the recompute included) with a vocabulary of 4099 and 8 rows of up to 20 tokens: the
    chunked step's peak exceeds that of a step with no trained token (whose head runs on 0 tokens) by at most a
    few tensors of one chunk's logits and one gradient of the head (a chunk's, before autograd adds it to the
    sum of the chunks before it); the unchunked step's by several micro-batches of logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", vocab_size=4099, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config).train()
    batch = micro_batches(size=8)[:1]
    untrained = [dict(batch[0], labels=torch.full_like(batch[0]["labels"], -100))]
    logits_bytes = batch[0]["input_ids"].numel() * 4099 * 4  # fp32 logits of every position
    chunk_bytes = 8 * 4099 * 4
    baseline = peak_bytes(model, untrained, 8)
    assert peak_bytes(model, batch, 0) - baseline >= 2 * logits_bytes
    head_grad_bytes = 4099 * 32 * 4
    assert peak_bytes(model, batch, 8) - baseline <= 4 * chunk_bytes + head_grad_bytes


@pytest.mark.slow
def test_compiled_layers_and_compiled_chunks_give_the_same_loss_and_gradients():
    """train.compile with the chunked loss: the decoder layers compiled (parallel/apply.py), each chunk's head and
    loss compiled for any chunk length; within the tolerance of the compiled model's own test (test_options.py).
    One micro-batch of the 16 samples (one compilation of the layers, not a second for varying shapes): its 102
    trained tokens are 14 chunks of 7 and one of 4, two lengths through the one dynamic-shape chunk graph."""
    from isotrain.parallel.apply import decoder_layers

    model = tiny_model(torch.float32).train()
    compiled = copy.deepcopy(model)
    for layer in decoder_layers(compiled):
        layer.compile()
    want_loss, want_grads = loss_and_grads(model, StepOptions(), size=16)
    loss, grads = loss_and_grads(compiled, StepOptions(loss_chunk_tokens=7, compile_loss=True), size=16)
    assert loss == pytest.approx(want_loss, rel=1e-5)
    for name, grad in grads.items():
        assert torch.allclose(grad, want_grads[name], rtol=1e-4, atol=1e-6), name


def test_tensor_parallel_is_refused_with_both_settings_named():
    check_chunked_loss_settings(1024, tp=1)
    check_chunked_loss_settings(0, tp=2)
    with pytest.raises(ConfigError, match=r"train.loss_chunk_tokens=1024 does not work with parallel.tp=2"):
        check_chunked_loss_settings(1024, tp=2)


def test_a_family_whose_logits_are_more_than_its_head_is_refused():
    """Gemma 2 softcaps its logits after the head (tanh); the chunked loss would drop that. Llama passes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    check_head_is_linear(tiny_model(torch.float32), CPU)
    torch.manual_seed(0)
    config = AutoConfig.for_model("gemma2", vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    with pytest.raises(ConfigError, match=r"cannot be used with Gemma2ForCausalLM, whose logits are more than"):
        check_head_is_linear(AutoModelForCausalLM.from_config(config), CPU)


def test_a_run_with_chunks_logs_the_losses_of_a_run_without(tmp_path, monkeypatch):
    """`isotrain train` end to end (the head probe, the step options, packing): the same logged losses, and the
    chunked run did compute its loss in chunks."""
    import json

    import isotrain.train.chunked_loss as chunked
    from isotrain.config import load_config
    from isotrain.recipes.sft import train

    from test_trainer_e2e import SMALL, small_data

    calls = []
    original = chunked.chunked_loss_sum
    monkeypatch.setattr(chunked, "chunked_loss_sum", lambda *args: calls.append(args[4]) or original(*args))
    _, data_args = small_data(tmp_path)
    losses = []
    for chunk_tokens in (0, 16):
        out = tmp_path / f"chunk-{chunk_tokens}"
        cfg = load_config(None, [*SMALL, *data_args, "eval.path=null", "train.max_steps=3", "data.packing=true",
                                 "data.max_seq_len=48", "train.global_batch_size=4", "train.micro_batch_size=2",
                                 f"train.loss_chunk_tokens={chunk_tokens}", f"output_dir={out}"])
        train(cfg)
        losses.append([json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)
    assert calls and set(calls) == {16}
