"""Defaults that `rl.algorithm` gives to every RL field the config leaves unset.

An explicit setting always wins over the preset. The config's validation fills the unset fields
from here before it checks them (isotrain/config.py, RLConfig), so a preset value meets every check a
value written by hand does. The values follow each method's paper:

- grpo: group-normalised advantages (mean and std), per-sequence token mean (GRPO paper).
- dapo: clip-higher 0.2/0.28, token-mean over the mini-batch, dynamic sampling, soft overlong
  penalty (DAPO paper).
- dr_grpo: advantages without the std division, token sums normalised by a constant length
  (`rl.max_new_tokens`) instead of each sequence's length (Dr. GRPO paper).
- rloo: leave-one-out baseline, token-mean.
- reinforce_pp: token-level discounted returns whitened over the batch, KL in the reward.
- reinforce_pp_baseline: group-mean baseline whitened over the batch, KL in the reward.
- ppo: a learned critic (value model) and GAE advantages whitened over the batch, token-mean.
"""

from __future__ import annotations

ALGORITHMS = ("grpo", "dapo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "ppo")

_COMMON = {
    "clip_low": 0.2,
    "clip_high": 0.2,
    "kl_coef": 0.0,
    "kl_in_reward": False,
    "loss_agg": "token-mean",
    "norm_adv_by_std": True,
    "dynamic_sampling": False,
    "overlong_buffer": 0,
}

PRESETS: dict[str, dict] = {
    "grpo": {**_COMMON, "advantage": "grpo", "loss_agg": "seq-mean-token-mean"},
    "dapo": {**_COMMON, "advantage": "grpo", "clip_high": 0.28, "dynamic_sampling": True,
             # the last quarter of the response budget is the soft-penalty buffer (`rl`: the settings mapping,
             # explicit over defaults, before validation: int() reads an integer as pydantic would)
             "overlong_buffer": lambda rl: max(1, int(rl["max_new_tokens"]) // 4)},
    "dr_grpo": {**_COMMON, "advantage": "dr_grpo", "norm_adv_by_std": False, "loss_agg": "seq-mean-token-sum-norm"},
    "rloo": {**_COMMON, "advantage": "rloo"},
    "reinforce_pp": {**_COMMON, "advantage": "reinforce_pp", "kl_coef": 0.001, "kl_in_reward": True},
    "reinforce_pp_baseline": {**_COMMON, "advantage": "reinforce_pp_baseline", "kl_coef": 0.001,
                              "kl_in_reward": True},
    "ppo": {**_COMMON, "advantage": "gae"},
}

# Estimators whose baseline comes from the other samples of the group: a group of one has no signal.
GROUP_BASELINES = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline")
