"""Every derived batch size, computed in one place and checked before any work (invariant 7).

    DP size   = parallel.dp_replicate × parallel.dp_shard   (parallel/dims.py; TP ranks share their data)
    GA steps  = train.global_batch_size / (train.micro_batch_size × DP size)
    pipeline micro-batches = GA steps         (parallel.pp > 1: the pipeline runs the batch plan's micro-batches)

A remainder is a configuration error whose message suggests valid values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from isotrain.config import EmbedRunConfig, RLRunConfig, TrainRunConfig
from isotrain.errors import ConfigError
from isotrain.parallel.dims import ParallelDims
from isotrain.presets import GROUP_BASELINES


@dataclass(frozen=True)
class BatchPlan:
    world_size: int
    dp_size: int
    global_batch_size: int
    micro_batch_size: int
    grad_accum_steps: int
    samples_per_rank_per_step: int

    def as_rows(self) -> list[tuple[str, int]]:
        return list(asdict(self).items())


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_batches(cfg: TrainRunConfig | EmbedRunConfig, degrees: ParallelDims) -> BatchPlan:
    global_bs = cfg.train.global_batch_size
    micro_bs = cfg.train.micro_batch_size
    dp = degrees.dp_size
    per_pass = micro_bs * dp
    if global_bs % per_pass:
        lower = global_bs // per_pass * per_pass
        options = [v for v in (lower, lower + per_pass) if v > 0]
        micro_options = [m for m in divisors(global_bs // dp) if global_bs % dp == 0]
        hint = f"use train.global_batch_size in {options}"
        if micro_options:
            hint += f" or train.micro_batch_size in {micro_options}"
        elif global_bs % dp:
            hint += f" (it must be a multiple of the DP size {dp})"
        raise ConfigError(
            f"train.global_batch_size={global_bs} is not divisible by train.micro_batch_size ({micro_bs}) "
            f"× DP size ({dp}) = {per_pass}; {hint}"
        )
    if degrees.pp > 1:
        check_pipeline_microbatches(cfg.parallel.pp_microbatches, global_bs // per_pass, global_bs // dp, degrees)
    return BatchPlan(
        world_size=degrees.world_size,
        dp_size=dp,
        global_batch_size=global_bs,
        micro_batch_size=micro_bs,
        grad_accum_steps=global_bs // per_pass,
        samples_per_rank_per_step=global_bs // dp,
    )


def check_pipeline_microbatches(requested: int | None, grad_accum: int, per_rank: int, degrees: ParallelDims) -> None:
    """The pipeline's micro-batches are the batch plan's GA micro-batches, so parallel.pp_microbatches (when set)
    must equal the GA steps; 1F1B also needs at least one micro-batch per stage (torch's Schedule1F1B), DualPipeV one
    per stage of its 2·pp, interleaved 1F1B and interleaved zero bubble a multiple of pp (their rounds of pp
    micro-batches: torch's ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble)."""
    if requested is not None and per_rank % requested:
        raise ConfigError(
            f"parallel.pp_microbatches={requested} does not divide the {per_rank} samples each data-parallel rank "
            f"trains per step (train.global_batch_size / DP size); use one of {divisors(per_rank)}"
        )
    if requested is not None and requested != grad_accum:
        raise ConfigError(
            f"parallel.pp_microbatches={requested} differs from the batch plan's {grad_accum} gradient-accumulation "
            f"micro-batches, which the pipeline runs; set train.micro_batch_size={per_rank // requested} or leave "
            "parallel.pp_microbatches unset"
        )
    if degrees.pp_schedule in ("interleaved_1f1b", "interleaved_zb") and grad_accum % degrees.pp:
        raise ConfigError(
            f"parallel.pp_schedule={degrees.pp_schedule} runs the micro-batches in rounds of parallel.pp={degrees.pp}, but "
            f"the batch plan has {grad_accum}; choose train.micro_batch_size so that train.global_batch_size / "
            f"(train.micro_batch_size × DP size) is a multiple of {degrees.pp}"
        )
    if degrees.pp_schedule == "dualpipev" and grad_accum < 2 * degrees.pp:
        raise ConfigError(
            f"parallel.pp_schedule=dualpipev needs at least one micro-batch per stage, {2 * degrees.pp} for "
            f"parallel.pp={degrees.pp}, but the batch plan has {grad_accum}; lower train.micro_batch_size to at most "
            f"{max(1, per_rank // (2 * degrees.pp))} or use parallel.pp_schedule=zbv"
        )
    if degrees.pp_schedule == "1f1b" and grad_accum < degrees.pp:
        raise ConfigError(
            f"parallel.pp_schedule=1f1b needs at least one micro-batch per stage, but the batch plan has "
            f"{grad_accum} for parallel.pp={degrees.pp}; lower train.micro_batch_size to at most "
            f"{per_rank // degrees.pp} or use parallel.pp_schedule=gpipe"
        )


@dataclass(frozen=True)
class RLBatchPlan:
    """Sizes of one RL step (a rollout and the optimizer steps that learn from it).

        samples per rollout         = P × n
        optimizer steps per rollout = P / M × ppo_epochs
        samples per optimizer step  = M × n               (the RL global batch)
        GA steps per rank           = M × n / (DP × micro)
        max_off_policy_steps        = k: step s trains on the rollout of the policy after step max(s - k, 0)
    """

    world_size: int
    dp_size: int
    prompts_per_step: int
    group_size: int
    samples_per_rollout: int
    prompts_per_rank_per_rollout: int
    mini_batch_prompts: int
    ppo_epochs: int
    optimizer_steps_per_rollout: int
    samples_per_optimizer_step: int
    micro_batch_size: int
    grad_accum_steps: int
    max_off_policy_steps: int = 0

    def as_rows(self) -> list[tuple[str, int]]:
        return list(asdict(self).items())


def _check_rl_global_batch(cfg: RLRunConfig, samples_per_update: int) -> None:
    # In RL the global batch is derived (null in the config, so a saved config.yaml plans the same again);
    # a value set by hand that disagrees would mean something else silently.
    if cfg.train.global_batch_size is not None and cfg.train.global_batch_size != samples_per_update:
        raise ConfigError(
            f"train.global_batch_size={cfg.train.global_batch_size} is not used by RL: the global batch is "
            f"rl.mini_batch_prompts × rl.group_size = {samples_per_update} sequences; remove it or set it to "
            f"{samples_per_update}"
        )


def plan_rl_batches(cfg: RLRunConfig, degrees: ParallelDims) -> RLBatchPlan:
    """Every RL size, or a ConfigError naming the fields and valid values (invariant 7)."""
    rl, dp, micro = cfg.rl, degrees.dp_size, cfg.train.micro_batch_size
    prompts, group = rl.prompts_per_step, rl.group_size
    mini = rl.mini_batch_prompts if rl.mini_batch_prompts is not None else prompts
    if group == 1 and rl.advantage in GROUP_BASELINES:
        raise ConfigError(
            f"rl.group_size=1 gives every sample an advantage of 0 with rl.algorithm={rl.algorithm} (the baseline "
            "is the group's own reward); use rl.group_size of 2 or more"
        )
    if prompts % dp:
        options = [v for v in (prompts // dp * dp, prompts // dp * dp + dp) if v > 0]
        raise ConfigError(
            f"rl.prompts_per_step={prompts} cannot be split over {dp} data-parallel ranks (each rank generates whole "
            f"groups); use rl.prompts_per_step in {options}"
        )
    # Mini-batch sizes that satisfy every later check too, so a suggestion is never rejected next.
    valid_minis = [m for m in divisors(prompts) if (m * group) % (micro * dp) == 0]
    if mini > prompts:
        raise ConfigError(
            f"rl.mini_batch_prompts={mini} is larger than rl.prompts_per_step={prompts}; "
            f"use rl.mini_batch_prompts in {valid_minis or divisors(prompts)}"
        )
    if prompts % mini:
        raise ConfigError(
            f"rl.mini_batch_prompts={mini} does not divide rl.prompts_per_step={prompts} into whole mini-batches; "
            f"use rl.mini_batch_prompts in {valid_minis or divisors(prompts)}"
        )
    samples_per_update = mini * group
    _check_rl_global_batch(cfg, samples_per_update)
    if samples_per_update % (micro * dp):
        micro_options = divisors(samples_per_update // dp) if samples_per_update % dp == 0 else []
        if micro_options:
            hint = f"use train.micro_batch_size in {micro_options}"
        elif valid_minis:
            hint = f"use rl.mini_batch_prompts in {valid_minis}"
        else:
            hint = f"use rl.group_size × rl.mini_batch_prompts divisible by the DP size {dp}"
        raise ConfigError(
            f"rl.mini_batch_prompts × rl.group_size = {mini} × {group} = {samples_per_update} sequences per optimizer "
            f"step do not split into micro-batches of train.micro_batch_size={micro} on {dp} data-parallel ranks; "
            f"{hint}"
        )
    return RLBatchPlan(
        world_size=degrees.world_size,
        dp_size=dp,
        prompts_per_step=prompts,
        group_size=group,
        samples_per_rollout=prompts * group,
        prompts_per_rank_per_rollout=prompts // dp,
        mini_batch_prompts=mini,
        ppo_epochs=rl.ppo_epochs,
        optimizer_steps_per_rollout=prompts // mini * rl.ppo_epochs,
        samples_per_optimizer_step=samples_per_update,
        micro_batch_size=micro,
        grad_accum_steps=samples_per_update // (micro * dp),
        max_off_policy_steps=rl.max_off_policy_steps,
    )

