"""HFEngine: shapes, EOS cuts, greedy equality, exact log-probs, reproducibility, weight updates."""

from __future__ import annotations

import pytest
import torch
import engine_models

from isotrain.rl.rollout import HFEngine, SamplingParams
from isotrain.models.weights import checksums, sync_named_tensors

PROMPTS = [[1, 7, 8], [1, 9, 9, 9, 10, 11], [1, 12]]  # different lengths: left padding is exercised


@pytest.fixture(scope="module")
def tokenizer():
    return engine_models.digits_tokenizer()


def tiny_model(tokenizer, seed: int = 0, tie: bool = False):
    return engine_models.tiny_model(tokenizer, seed, tie).eval()


@pytest.fixture(scope="module")
def model(tokenizer):
    return tiny_model(tokenizer)


def test_shapes_order_eos_and_truncation(model, tokenizer):
    torch.manual_seed(0)
    params = SamplingParams(n=4, max_new_tokens=12)
    rollout = HFEngine(model, tokenizer, batch_size=5).generate(PROMPTS, params)  # batches of 5, 5, 2
    eos = tokenizer.eos_token_id
    assert rollout.prompt_ids == [p for p in PROMPTS for _ in range(4)]  # prompt-major
    assert len(rollout.response_ids) == len(rollout.response_logprobs) == len(rollout.truncated) == 12
    for response, logprobs, truncated in zip(rollout.response_ids, rollout.response_logprobs, rollout.truncated):
        assert len(logprobs) == len(response) and all(lp <= 0 for lp in logprobs)
        assert eos not in response[:-1]  # cut right after the first EOS
        if truncated:
            assert len(response) == 12 and response[-1] != eos
        else:
            assert response[-1] == eos and len(response) <= 12
    # The seed gives both kinds of rows, so both branches above were checked.
    assert any(rollout.truncated) and not all(rollout.truncated)


def _reference_greedy(model, tokenizer, prompt: list[int], max_new_tokens: int) -> list[int]:
    """model.generate on one unpadded prompt, cut after the first EOS."""
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    tokens = out[0, len(prompt) :].tolist()
    eos = tokenizer.eos_token_id
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


@pytest.mark.parametrize("batch_size", [64, 2])
def test_greedy_equals_model_generate(model, tokenizer, batch_size):
    params = SamplingParams(n=2, max_new_tokens=10, greedy=True)
    rollout = HFEngine(model, tokenizer, batch_size).generate(PROMPTS, params)
    expected = [_reference_greedy(model, tokenizer, p, 10) for p in PROMPTS for _ in range(2)]
    assert rollout.response_ids == expected


def _forward_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) at each response token, from one plain forward over prompt + response."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0].float()
    # Position i predicts token i + 1: the response tokens are predicted from len(prompt) - 1 on.
    predicting = logits[len(prompt) - 1 : len(prompt) - 1 + len(response)] / temperature
    return torch.log_softmax(predicting, dim=-1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 1.0), (0.7, 0.9)])
def test_logprobs_equal_forward_of_original_model(model, tokenizer, temperature, top_p):
    torch.manual_seed(1)
    params = SamplingParams(n=3, max_new_tokens=10, temperature=temperature, top_p=top_p)
    rollout = HFEngine(model, tokenizer).generate(PROMPTS, params)
    for prompt, response, logprobs in zip(rollout.prompt_ids, rollout.response_ids, rollout.response_logprobs):
        expected = _forward_logprobs(model, prompt, response, temperature)
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-5, rtol=0)


def test_greedy_logprobs_use_temperature_one(model, tokenizer):
    params = SamplingParams(n=1, max_new_tokens=8, temperature=0.5, greedy=True)
    rollout = HFEngine(model, tokenizer).generate(PROMPTS, params)
    for prompt, response, logprobs in zip(rollout.prompt_ids, rollout.response_ids, rollout.response_logprobs):
        expected = _forward_logprobs(model, prompt, response, 1.0)
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=1e-5, rtol=0)


def test_same_seed_same_rollout(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(n=4, max_new_tokens=12, temperature=0.9)
    runs = []
    for seed in (7, 7, 8):
        torch.manual_seed(seed)
        runs.append(engine.generate(PROMPTS, params))
    assert runs[0] == runs[1]
    assert runs[0].response_ids != runs[2].response_ids


def test_engine_holds_its_own_copy(tokenizer):
    model = tiny_model(tokenizer)
    engine = HFEngine(model, tokenizer)
    before = engine.checksums()
    assert before == checksums(sync_named_tensors(model))
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    assert engine.checksums() == before
    assert next(model.parameters()).requires_grad  # the trainer's model is left as it was


def test_update_weights_rejects_unknown_names_and_shapes(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    with pytest.raises(ValueError, match="unknown weight 'model.nonexistent.weight'"):
        engine.update_weights([("model.nonexistent.weight", torch.zeros(3))])
    with pytest.raises(ValueError, match=r"'model.norm.weight' of shape \(16,\), the engine expects \(32,\)"):
        engine.update_weights([("model.norm.weight", torch.zeros(16))])
    # A failed update leaves the engine unusable until a complete update, never half-updated.
    with pytest.raises(RuntimeError, match="call update_weights first"):
        engine.generate(PROMPTS, SamplingParams(n=1, max_new_tokens=2))
    engine.update_weights(sync_named_tensors(model))
    engine.generate(PROMPTS, SamplingParams(n=1, max_new_tokens=2))


def test_tied_head_accepts_either_name_and_stays_tied(tokenizer):
    model = tiny_model(tokenizer, tie=True)
    engine = HFEngine(model, tokenizer)
    names = [name for name, _ in sync_named_tensors(model)]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    new_embedding = torch.randn_like(model.model.embed_tokens.weight)
    engine.update_weights([("lm_head.weight", new_embedding)])
    assert engine.checksums()["model.embed_tokens.weight"] == checksums([("x", new_embedding)])["x"]
    engine.release_memory()
    engine.update_weights(sync_named_tensors(model))  # one name restores both the embedding and the head
    params = SamplingParams(n=1, max_new_tokens=6, greedy=True)
    expected = [_reference_greedy(model, tokenizer, p, 6) for p in PROMPTS]
    assert engine.generate(PROMPTS, params).response_ids == expected


def test_release_memory_then_update_restores(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    expected = checksums(sync_named_tensors(model))
    engine.release_memory()
    assert engine.checksums() == {}
    with pytest.raises(RuntimeError, match="call update_weights first"):
        engine.generate(PROMPTS, SamplingParams(n=1, max_new_tokens=2))
    partial = [(name, t) for name, t in sync_named_tensors(model) if name != "lm_head.weight"]
    engine.update_weights(partial)
    with pytest.raises(RuntimeError, match="1 of .* stale .*lm_head.weight.*call update_weights first"):
        engine.generate(PROMPTS, SamplingParams(n=1, max_new_tokens=2))
    engine.update_weights(sync_named_tensors(model))
    assert engine.checksums() == expected
    greedy = SamplingParams(n=1, max_new_tokens=6, greedy=True)
    assert engine.generate(PROMPTS, greedy).response_ids == [_reference_greedy(model, tokenizer, p, 6) for p in PROMPTS]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"n": 0, "max_new_tokens": 4}, "at least 1"),
        ({"n": 1, "max_new_tokens": 4, "temperature": 0.0}, "use greedy=True"),
        ({"n": 1, "max_new_tokens": 4, "top_p": 0.0}, "top_p"),
    ],
)
def test_sampling_params_are_checked(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_seeded_call_is_reproducible_and_leaves_global_rng(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    params = SamplingParams(n=4, max_new_tokens=12, temperature=0.9, top_p=0.95, seed=3)
    torch.manual_seed(0)
    first = engine.generate(PROMPTS, params)
    after_first = torch.rand(1)
    torch.manual_seed(99)  # a different global state must not matter
    assert engine.generate(PROMPTS, params) == first
    torch.manual_seed(0)
    engine.generate(PROMPTS, params)
    assert torch.equal(torch.rand(1), after_first)


class _ScheduledLM(torch.nn.Module):
    """A stand-in LM whose row r predicts token 5 until step r, then EOS (every row ends by step 2)."""

    def __init__(self, config, eos_id: int):
        super().__init__()
        self.config, self.eos_id, self.num_calls = config, eos_id, 0

    def forward(self, input_ids, past_key_values=None, **kwargs):
        logits = torch.full((input_ids.shape[0], input_ids.shape[1], self.config.vocab_size), -10.0)
        logits[:, -1, 5] = 10.0
        logits[: self.num_calls + 1, -1, self.eos_id] = 20.0  # rows 0..num_calls end now
        self.num_calls += 1
        return type("Output", (), {"logits": logits})


def test_rows_after_eos_emit_pad_and_the_loop_stops_when_all_are_done(model):
    from isotrain.rl.decode import sample

    eos_id, pad_id = 2, 0
    lm = _ScheduledLM(model.config, eos_id)
    tokens, logprobs = sample(
        lm, torch.tensor([[1, 4]] * 3), torch.ones(3, 2, dtype=torch.long),
        max_new_tokens=10, eos_id=eos_id, pad_id=pad_id, greedy=True,
    )
    assert lm.num_calls == 3  # not max_new_tokens: every row had produced EOS after 3 steps
    assert tokens.tolist() == [[eos_id, pad_id, pad_id], [5, eos_id, pad_id], [5, 5, eos_id]]
    assert logprobs.shape == (3, 3)


def test_draw_follows_the_weights_and_never_draws_a_zero_weight():
    from isotrain.rl.decode import _draw

    torch.manual_seed(0)
    weights = torch.tensor([0.0, 1.0, 0.0, 3.0, 6.0, 0.0, 1e-3])
    counts = torch.bincount(_draw(weights.expand(200_000, -1)), minlength=len(weights)).double()
    expected = weights.double() / weights.sum() * 200_000
    assert counts[weights == 0].sum() == 0
    # Binomial counts: within 5 standard deviations of n * p.
    assert ((counts - expected).abs() <= 5 * expected.sqrt() + 1).all(), (counts, expected)


@pytest.mark.parametrize("temperature, top_p", [(1.0, 1.0), (0.7, 0.8), (1.3, 0.5)])
def test_sampling_distribution_equals_transformers_warpers(temperature, top_p):
    """Each row's draws follow softmax(TopPLogitsWarper(logits / T)), the distribution generate samples from."""
    from transformers.generation.logits_process import TopPLogitsWarper

    from isotrain.rl.decode import next_token

    torch.manual_seed(0)
    logits = torch.randn(4, 12) * 2
    num_draws = 50_000
    tokens, logprobs = next_token(logits.repeat_interleave(num_draws, 0), temperature, top_p, greedy=False)
    warped = logits / temperature
    if top_p < 1:
        warped = TopPLogitsWarper(top_p)(None, warped)
    expected = torch.softmax(warped.double(), dim=-1) * num_draws
    counts = torch.stack([torch.bincount(row, minlength=12) for row in tokens.view(4, num_draws)]).double()
    assert counts[expected == 0].sum() == 0  # nothing outside the nucleus
    assert ((counts - expected).abs() <= 5 * expected.sqrt() + 1).all(), (counts, expected)
    # The reported log-prob is that of the untruncated distribution, at temperature T.
    full = torch.log_softmax(logits / temperature, dim=-1).repeat_interleave(num_draws, 0)
    torch.testing.assert_close(logprobs, full.gather(-1, tokens[:, None]).squeeze(-1))
