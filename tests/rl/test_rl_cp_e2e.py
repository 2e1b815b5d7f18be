"""`isotrain rl` with parallel.cp=2 (Ulysses) through the real CLI on 2 processes: its metrics rows are the
one-process run's (a tiny Llama from its config, the character tokenizer, 3 steps of GRPO with a KL term against
the frozen reference, so the rollout's log-probs, the reference's and the update all run on pieces of the rows).
Both runs sample the same rollouts (the CP ranks of the one DP rank share the first one's samples); counts match
exactly and every other field within fp32 rounding. Also PPO (the critic's values and update on pieces) and
asynchronous RL (the process engine, rollouts generated ahead and shared over a twin of the CP group; slow: ~45 s)."""

from __future__ import annotations

import re

import pytest

from test_async_rl import TINY_RL, metrics, untimed
from zygote import run_forked_ranks

TINY = [*TINY_RL, "rl.kl_coef=0.05", "train.micro_batch_size=8", "train.max_steps=3", "checkpoint.every_steps=0"]
EXACT = ("step", "samples_seen", "tokens_seen", "trained_tokens", "optimizer_steps", "behaviour_version")


def _rows(nproc: int, run_dir, overrides: list[str], cp: int) -> list[dict]:
    proc = run_forked_ranks(nproc, ["rl", *TINY, f"output_dir={run_dir}", *overrides])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert re.search(rf"│ cp +│ {cp} ", proc.stdout) or cp == 1, proc.stdout[-2000:]  # the run's own size table
    return untimed(metrics(run_dir))


VARIANTS = {
    "grpo": [],
    # PPO: the critic's values of the rollout and its update on pieces too
    "ppo": ["rl.algorithm=ppo"],
    # asynchronous: the rollouts generated ahead on a worker thread, shared over a twin of the CP group
    "async": ["rollout.engine=process", "rl.max_off_policy_steps=1", "rl.rollout_correction=token_tis",
              "rl.rollout_is_cap=2.0"],
}


@pytest.mark.parametrize("variant", [pytest.param(v, marks=pytest.mark.slow) if v == "async" else v for v in VARIANTS])
def test_rl_with_cp2_logs_the_metrics_of_one_process(tmp_path, variant):
    single = _rows(1, tmp_path / "one", VARIANTS[variant], cp=1)
    split = _rows(2, tmp_path / "cp2", [*VARIANTS[variant], "parallel.cp=2", "parallel.dp_replicate=1"], cp=2)
    assert len(single) == len(split) == 3
    assert all(row["kl"] > 0 for row in single[1:]) and all(row["entropy"] > 0 for row in single)
    assert variant != "ppo" or all(row["critic_loss"] > 0 for row in single)
    for one, cp in zip(single, split):
        assert one.keys() == cp.keys()
        for key, value in one.items():
            if key in EXACT or not isinstance(value, float):
                assert cp[key] == value, key
            else:
                assert cp[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
