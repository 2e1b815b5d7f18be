"""PPO's critic computes the same values twice: no dropout sits before its value head."""

from __future__ import annotations

import torch

from helpers import TINY_LLAMA


def test_the_critic_has_no_dropout_before_its_value_head():
    from isotrain.config import build_config
    from isotrain.models.tokenizer import train_tokenizer
    from isotrain.parallel.dims import ParallelDims
    from isotrain.parallel.mesh import single_process
    from isotrain.rl.critic import build_critic

    cfg = build_config({"model": {"config": dict(TINY_LLAMA)}, "rl": {"algorithm": "ppo"}}, recipe="rl")
    tokenizer = train_tokenizer(["12+34=46"] * 4, "char", 0)
    critic, _ = build_critic(cfg, tokenizer, torch.device("cpu"), single_process(ParallelDims(1, 1, 1)))
    assert critic.training
    ids = torch.tensor([[1, 4, 5, 6, 7]])
    assert torch.equal(critic(input_ids=ids).logits, critic(input_ids=ids).logits)
    assert all(module.p == 0 for module in critic.modules() if isinstance(module, torch.nn.Dropout))
