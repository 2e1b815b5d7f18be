"""From prompts to a scored rollout: generation rounds, rewards, overlong shaping, dynamic sampling.

One round: each rank encodes its slice of the round's prompts, the engine samples n responses per
prompt, the reward function scores them (errors counted, never fatal), the DAPO soft overlong
penalty is added, and the ranks exchange samples so that every rank holds the round whole.
Dynamic sampling keeps only groups whose scores differ (a group of equal scores has zero
advantage and teaches nothing) and runs more rounds until P groups are kept or
`rl.max_generation_rounds` is reached; then the last dropped groups fill the remainder, so the
batch sizes stay those of the plan, and the metrics say how many groups were filtered.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from isotrain.config import RLConfig
from isotrain.parallel.dist import all_reduce_sum, broadcast_in_group
from isotrain.rl.algos import overlong_penalty
from isotrain.rl.experience import RolloutBatch, all_gather_rollout
from isotrain.rl.prompts import PromptSet, PromptStream
from isotrain.rl.rewards import score
from isotrain.rl.rollout import SamplingParams


@dataclass
class RoundStats:
    rounds: int = 0
    filtered_groups: int = 0  # groups dropped by dynamic sampling (all scores equal)
    filler_groups: int = 0  # dropped groups used anyway because the round bound was reached
    reward_errors: int = 0  # samples whose reward function failed (scored 0), over all ranks
    num_scored: int = 0  # samples scored, over all ranks
    first_error: str | None = None  # "ValueError: ..." of this rank's first failure


def encode_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Prompt token ids exactly as SFT saw them: BOS (when the tokenizer has one) + the prompt."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    return [bos + tokenizer.encode(text, add_special_tokens=False) for text in texts]


def sampling_seed(seed: int, round_index: int, dp_rank: int) -> int:
    """The engine's sampling seed for one round on one rank: a resumed run redraws exactly the same samples."""
    return random.Random(f"{seed}:{round_index}:{dp_rank}").getrandbits(63)


def generate_round(engine, tokenizer, prompts: PromptSet, stream: PromptStream, round_index: int,
                   rl: RLConfig, reward_fn, seed: int, dp_rank: int, dp_size: int, stats: RoundStats,
                   dp_group=None, cp_group=None) -> RolloutBatch:
    """One round's samples of every DP rank. The CP ranks of a DP rank (`cp_group`, parallel.cp) draw the same
    prompts with the same seed; the first one's samples and scores are then taken by all of them, so they train
    on the very same samples whatever their engines do."""
    indices = stream.round_indices(round_index, dp_rank, dp_size)
    params = SamplingParams(n=rl.group_size, max_new_tokens=rl.max_new_tokens, temperature=rl.temperature,
                            top_p=rl.top_p, seed=sampling_seed(seed, round_index, dp_rank))
    out = engine.generate(encode_prompts(tokenizer, [prompts.prompts[i] for i in indices]), params)
    sample_prompts = [i for i in indices for _ in range(rl.group_size)]
    completions = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    scored = score(reward_fn, [prompts.prompts[i] for i in sample_prompts], completions,
                   [prompts.answers[i] for i in sample_prompts])
    out, scored = broadcast_in_group((out, scored), cp_group)
    rewards = list(scored.rewards)
    if rl.overlong_buffer > 0:
        lengths = torch.tensor([len(r) for r in out.response_ids])
        penalty = overlong_penalty(lengths, rl.max_new_tokens, rl.overlong_buffer)
        rewards = [r + float(p) for r, p in zip(rewards, penalty)]
    errors = int(all_reduce_sum(torch.tensor([scored.num_errors]), dp_group).item())
    stats.reward_errors += errors
    if stats.first_error is None and scored.first_error is not None:
        stats.first_error = scored.first_error
    local = RolloutBatch(sample_prompts, out.prompt_ids, out.response_ids, out.response_logprobs, out.truncated,
                         list(scored.rewards), rewards)
    gathered = all_gather_rollout(local, dp_group)
    stats.num_scored += len(gathered)
    return gathered


def _groups(batch: RolloutBatch, n: int) -> list[RolloutBatch]:
    return [batch.select(range(g * n, (g + 1) * n)) for g in range(len(batch) // n)]


def collect(engine, tokenizer, prompts: PromptSet, stream: PromptStream, first_round: int, rl: RLConfig,
            reward_fn, seed: int, dp_rank: int, dp_size: int, dp_group=None,
            cp_group=None) -> tuple[RolloutBatch, RoundStats]:
    """The rollout of one RL step (P groups), starting at generation round `first_round`."""
    stats = RoundStats()
    kept: list[RolloutBatch] = []
    dropped: list[RolloutBatch] = []
    while True:
        batch = generate_round(engine, tokenizer, prompts, stream, first_round + stats.rounds, rl, reward_fn,
                               seed, dp_rank, dp_size, stats, dp_group, cp_group)
        stats.rounds += 1
        if not rl.dynamic_sampling:
            return batch, stats
        for group in _groups(batch, rl.group_size):
            (kept if len(set(group.scores)) > 1 else dropped).append(group)
        if len(kept) >= rl.prompts_per_step or stats.rounds >= rl.max_generation_rounds:
            break
    stats.filtered_groups = len(dropped)
    missing = max(rl.prompts_per_step - len(kept), 0)
    stats.filler_groups = missing
    groups = kept[: rl.prompts_per_step] + (dropped[len(dropped) - missing :] if missing else [])
    return RolloutBatch.concat(groups), stats


def evaluate(engine, tokenizer, prompts: PromptSet, reward_fn, max_new_tokens: int) -> float:
    """Mean reward of greedy responses to held-out prompts (exact-match accuracy for `exact_match`)."""
    params = SamplingParams(n=1, max_new_tokens=max_new_tokens, greedy=True)
    out = engine.generate(encode_prompts(tokenizer, prompts.prompts), params)
    completions = tokenizer.batch_decode(out.response_ids, skip_special_tokens=True)
    result = score(reward_fn, prompts.prompts, completions, prompts.answers)
    return sum(result.rewards) / max(len(result.rewards), 1)
