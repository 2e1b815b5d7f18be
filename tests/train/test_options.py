"""Options that must not change the math: torch.compile, bf16 mixed precision, packing; and TensorBoard."""

from __future__ import annotations

import json

import pytest
import torch

from equivalence_worker import make_samples, tiny_model
from isotrain.data.collate import collate
from isotrain.train.step import StepOptions, forward_backward


def loss_and_grads(model, options=StepOptions()):
    micro_batches = [collate(make_samples()[:8], pad_id=0)]
    loss, _ = forward_backward(model, micro_batches, options, torch.device("cpu"))
    return loss, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.slow
def test_compiled_model_gives_the_same_loss_and_gradients():
    eager_loss, eager_grads = loss_and_grads(tiny_model(torch.float32))
    compiled = tiny_model(torch.float32)
    compiled.compile()
    loss, grads = loss_and_grads(compiled)
    assert loss == pytest.approx(eager_loss, rel=1e-5)
    for name, grad in grads.items():
        assert torch.allclose(grad, eager_grads[name], rtol=1e-4, atol=1e-6), name


def test_bf16_autocast_keeps_fp32_master_weights_and_close_loss():
    ref_loss, _ = loss_and_grads(tiny_model(torch.float32))
    model = tiny_model(torch.float32)
    loss, grads = loss_and_grads(model, StepOptions(autocast_dtype=torch.bfloat16))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(g.dtype == torch.float32 for g in grads.values())
    assert loss == pytest.approx(ref_loss, rel=2e-2) and loss != ref_loss


def _run(tmp_path, name, *overrides):
    from isotrain.config import load_config
    from isotrain.recipes.sft import train

    from test_trainer_e2e import SMALL, small_data

    _, data_args = small_data(tmp_path)
    cfg = load_config(None, [*SMALL, *data_args, "eval.path=null", "train.max_steps=4",
                             f"output_dir={tmp_path / name}", *overrides])
    return train(cfg)


def test_packing_counts_every_token_once_and_trains(tmp_path):
    packing = ["data.packing=true", "data.max_seq_len=32", "train.global_batch_size=1", "train.micro_batch_size=1"]
    num_packed = _run(tmp_path, "probe", *packing, "train.max_steps=1").data_stats.num_samples
    packed = _run(tmp_path, "packed", *packing, f"train.max_steps={num_packed}")
    unpacked = _run(tmp_path, "unpacked", "train.max_steps=4")  # 64 rows, global batch 16: one epoch
    assert num_packed < 64 // 2  # several documents share each 32-token sample
    # One epoch of packed samples holds every document exactly once.
    assert packed.counters["trained_tokens"] == unpacked.counters["trained_tokens"] == packed.data_stats.total_trained_tokens
    assert packed.counters["tokens_seen"] == unpacked.counters["tokens_seen"]
    rows = [json.loads(line) for line in (tmp_path / "packed" / "metrics.jsonl").read_text().splitlines()]
    assert sum(r["loss"] for r in rows[-5:]) < sum(r["loss"] for r in rows[:5])


def test_tensorboard_events_are_written(tmp_path):
    pytest.importorskip("tensorboard")
    result = _run(tmp_path, "tb", "logging.tensorboard=true")
    assert list((result.output_dir / "tensorboard").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_a_compiled_model_attends_causally_without_a_mask():
    """train.compile compiles each decoder layer, not the root: traced by dynamo, transformers' mask code in the
    root materialises a [B, 1, S, S] mask for full causal rows, and attention then runs masked with the grouped
    KV heads repeated (3.1 x slower attention on an H200)."""
    from torch.profiler import ProfilerActivity, profile

    from isotrain.parallel.apply import apply_compile

    model = tiny_model(torch.float32)
    apply_compile(model)
    input_ids = torch.randint(0, 50, (2, 16))
    model(input_ids=input_ids).logits.sum().backward()  # compiles: tracing's fake-tensor calls carry no shapes
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        model(input_ids=input_ids).logits.sum().backward()
    calls = [e for e in prof.events() if e.name.startswith("aten::_scaled_dot_product") and "backward" not in e.name]
    assert len(calls) == model.config.num_hidden_layers  # one attention kernel per layer, its shapes recorded
    for call in calls:
        q, k, v, *rest = [shape for shape in call.input_shapes if len(shape) == 4]
        assert rest == [], f"attention got a mask {rest}"
        assert k[1] == model.config.num_key_value_heads, f"KV heads repeated: {k}"
