"""PPO's critic: a value model, the rollout's values, and its update on the shared gradient step.

The critic is the policy's backbone with a one-output token head (transformers'
`AutoModelForTokenClassification`, num_labels=1), built by the same model builder: its backbone starts
from the policy's starting weights (the same files, or the same seeded initialisation), its head is
freshly initialised, and it is parallelised like the policy. V_t, read at the position that predicts response token t, estimates the
return from there. Its loss per token is the clipped value loss

    ½ · max((V − R)², (clip(V, V_old ± rl.value_clip) − R)²)

aggregated exactly like the policy loss (same `rl.loss_agg` weights, same global denominator), so
it too does not depend on the layout. The critic has its own AdamW (`rl.critic_lr`). Under context parallelism
its forwards run on each CP rank's piece of every row like the policy's (rl/pieces.py).
"""

from __future__ import annotations

import torch

from isotrain.config import RLRunConfig
from isotrain.models.build import build
from isotrain.rl.algos import aggregation_weights, value_loss
from isotrain.rl.experience import PADDED, RolloutBatch, RowLayout, forward_logits, per_response_token
from isotrain.rl.pieces import NO_CP, Pieces
from isotrain.train.optim import build_optimizer
from isotrain.train.step import accumulate_gradients, optimizer_step

CRITIC_STATS = ("value_loss", "value_clipped", "value_mean")


def build_critic(cfg: RLRunConfig, tokenizer, device: torch.device, parallel):
    """A value model sharing the policy's initial backbone weights; parallelised; with its own optimizer."""
    from transformers import AutoModelForTokenClassification

    critic = build(cfg.model, tokenizer, cfg.train.seed, parallel, device, model_class=AutoModelForTokenClassification,
                   # No dropout before the value head (transformers' token-classification default is 0.1): the
                   # rollout's values and the regression target would otherwise be noisy (verl sets it to 0 too).
                   config_updates={"num_labels": 1, "classifier_dropout": 0.0}, compile=cfg.train.compile,
                   compute_dtype=torch.bfloat16 if cfg.model.dtype == "bfloat16" else None)
    train = cfg.train.model_copy(update={"lr": cfg.rl.critic_lr or cfg.train.lr})
    return critic, build_optimizer(critic, train)


def _values(critic, mb: dict, device: torch.device) -> torch.Tensor:
    values = forward_logits(critic, mb, device).squeeze(-1)
    return values.to(torch.promote_types(values.dtype, torch.float32))


def token_values(critic, batch: RolloutBatch, pad_id: int, micro_batch_size: int, device: torch.device,
                 autocast_dtype=None, layout: RowLayout = PADDED, pieces: Pieces = NO_CP) -> list[list[float]]:
    """V_t of every response token of every sample (response coordinates), before any update."""
    return per_response_token(batch, pad_id, micro_batch_size, device, autocast_dtype,
                              lambda mb: _values(critic, mb, device), layout, pieces)


def critic_step(critic, optimizer, mbs: list[dict], denominator: float, rl, grad_clip: float, options,
                device: torch.device, lr: float, pieces: Pieces = NO_CP) -> tuple[float, float, torch.Tensor]:
    """One optimizer step of the critic on the policy's micro-batches; (loss, grad norm, CRITIC_STATS token sums
    of this CP rank's pieces under context parallelism). `rl` is the run's rl section, `options` its StepOptions."""
    stats = torch.zeros(len(CRITIC_STATS), dtype=torch.float64, device=device)

    def loss_sum(mb: dict, autocast) -> torch.Tensor:
        whole_weights, _ = aggregation_weights(mb["mask"].to(device), rl.loss_agg, rl.max_new_tokens,
                                               mb["sequence_ids"].to(device))
        mb, cut = pieces.cut(mb, {"weights": whole_weights})  # per sequence: from whole rows, then cut
        weights, mask = cut["weights"], mb["mask"].to(device)
        with autocast:
            values = _values(critic, mb, device)
        old, returns = mb["old_values"].to(device), mb["returns"].to(device)
        losses = value_loss(values, old, returns, rl.value_clip)
        on = mask > 0
        with torch.no_grad():
            clipped = torch.zeros_like(on) if rl.value_clip is None else (values - old).abs() > rl.value_clip
            stats.add_(torch.stack([torch.where(on, losses, 0.0).double().sum(), (clipped & on).sum().double(),
                                    torch.where(on, values, 0.0).double().sum()]))
        return torch.where(on, losses * weights, 0.0).sum()

    loss = accumulate_gradients(critic, mbs, loss_sum, denominator, options, device)
    parameters = [p for p in critic.parameters() if p.requires_grad]
    norm = optimizer_step(optimizer, parameters, lr, grad_clip, loss, of="the critic's ")
    return loss, norm, stats
