"""The RL post-training loop, top to bottom.

set up (every size checked first) -> build the policy, its engine copy and the frozen reference ->
resume -> run_loop with `rl_step` (generate and score a rollout (generate.py) -> trainer log-probs ->
advantages and optimizer steps (update.py) -> sync the new weights to the engine -> metrics row) ->
final model and held-out evaluation.

It shares with SFT the config tree, tokenizer and model set-up, the globally normalised gradient
step, the optimizer step, the run loop (metrics, progress, evaluation, graceful stop, when to save)
and the checkpoint manager.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from rich.console import Console
from rich.markup import escape

from isotrain.checkpoint.files import atomic_write_text
from isotrain.checkpoint.manager import MODEL_DIR, CheckpointContract, CheckpointManager
from isotrain.config import RLRunConfig as Config, dump_config
from isotrain.data.cache import tokenizer_fingerprint
from isotrain.errors import ConfigError, TrainingError
from isotrain.models.build import build
from isotrain.models.loading import check_layout_fits, checked_config, count_parameters, model_config
from isotrain.models.unwrap import hf_model
from isotrain.moe.metrics import router_metrics
from isotrain.moe.settings import check_moe_section, router_settings
from isotrain.parallel.dims import resolve_dims
from isotrain.parallel.dist import DistInfo, barrier, init_distributed, shutdown_distributed
from isotrain.parallel.mesh import build_parallel
from isotrain.parallel.tp import check_replicated
from isotrain.rl.critic import build_critic, token_values
from isotrain.rl.experience import all_gather_lists, response_logprobs
from isotrain.rl.packing import row_layout
from isotrain.rl.generate import collect, evaluate
from isotrain.rl.lora import lora_adapter
from isotrain.rl.prompts import PromptSet, PromptStream, check_rl_lengths, read_prompts
from isotrain.rl.rewards import format_gated, load_reward
from isotrain.rl.update import UpdateTotals, advantages, run_updates
from isotrain.train.step import step_options
from isotrain.models.weights import sync_named_tensors
from isotrain.sizes import plan_rl_batches
from isotrain.train.metrics import MetricsWriter
from isotrain.train.optim import build_optimizer
from isotrain.train.run_loop import RunState, run_loop, stopped_message
from isotrain.train.schedule import lr_at, schedule_settings
from isotrain.train.setup import compute_dtype, prepare_tokenizer, start_run

RL_COUNTERS = ("tokens_seen", "trained_tokens", "samples_seen", "prompt_rounds", "optimizer_steps")


@dataclass
class RLResult:
    output_dir: Path
    model_dir: Path | None
    counters: dict
    accuracy_before: float | None = None
    accuracy_after: float | None = None
    stopped: bool = False
    model: object = None  # the trained module, single-process runs only


def make_engine(cfg: Config, config, tokenizer, output_dir: Path):
    """The rollout engine, holding its own copy of the weights. It starts with none usable: the loop sends
    the policy's weights before the first rollout, and after every update."""
    if cfg.rollout.engine == "process":
        from isotrain.rl.engine_process import ProcessEngine

        # The child process starts from the config and tokenizer files only; weights come by update_weights.
        tokenizer_dir = output_dir / "engine_tokenizer"
        tokenizer.save_pretrained(tokenizer_dir)
        return ProcessEngine(config, tokenizer_dir, seed=cfg.train.seed, batch_size=cfg.rollout.batch_size,
                             num_threads=torch.get_num_threads())
    from isotrain.rl.rollout import HFEngine

    return HFEngine.from_config(config, tokenizer, batch_size=cfg.rollout.batch_size)


def _reward_fn(cfg: Config):
    fn = load_reward(cfg.rl.reward)
    return format_gated(fn, cfg.rl.format_pattern, cfg.rl.format_penalty) if cfg.rl.format_pattern else fn


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _start_fingerprint(cfg: Config) -> str:
    """What the frozen reference is rebuilt from on resume: the starting weights' files, or the seeded config."""
    if cfg.model.name_or_path is None:
        return hashlib.sha256(json.dumps([cfg.model.config, cfg.train.seed], sort_keys=True).encode()).hexdigest()
    files = sorted(Path(cfg.model.name_or_path).glob("model*.safetensors"))
    return hashlib.sha256("".join(_file_sha256(str(f)) for f in files).encode()).hexdigest()


def build_policy(cfg: Config, info: DistInfo, tokenizer, parallel):
    """The policy and, when a KL term needs one, the frozen reference: both built on this rank's layout by the
    one model builder (the reference sharded like the policy, without gradients or optimizer)."""
    # With LoRA the KL reference is the policy with its adapters off: no second model.
    adapt = lora_adapter(cfg, parallel.dims)
    common = dict(compute_dtype=compute_dtype(cfg))
    model = build(cfg.model, tokenizer, cfg.train.seed, parallel, info.device, compile=cfg.train.compile,
                  activation_checkpointing=cfg.train.activation_checkpointing == "full",
                  adapt=adapt, **common)
    reference = None
    if cfg.lora.r == 0 and cfg.rl.kl_coef > 0:
        reference = build(cfg.model, tokenizer, cfg.train.seed, parallel, info.device, trainable=False, **common)
    return model, build_optimizer(model, cfg.train), reference


def rl_train(cfg: Config, console: Console | None = None) -> RLResult:
    info = init_distributed()
    console = console or Console(stderr=False)
    try:
        with ExitStack() as scope:  # the run's hold on output_dir, released however _rl ends
            return _rl(cfg, info, console, scope)
    finally:
        shutdown_distributed()


def _evaluate(cfg, info, engine, tokenizer, held_out: PromptSet | None, reward_fn, log, when: str) -> float | None:
    if held_out is None:
        return None
    value = None
    if info.is_main:
        value = evaluate(engine, tokenizer, held_out, reward_fn, cfg.eval.max_new_tokens)
        what = "exact-match accuracy" if cfg.rl.reward == "exact_match" else "mean greedy reward"
        log(f"{when}: {what} on {len(held_out.prompts)} held-out prompts: {value:.1%}")
    barrier()
    return value


def _rl(cfg: Config, info: DistInfo, console: Console, scope: ExitStack) -> RLResult:
    log = functools.partial(console.print, soft_wrap=True) if info.is_main else (lambda *a, **k: None)
    degrees = resolve_dims(cfg.parallel, info.world_size)
    plan = plan_rl_batches(cfg, degrees)  # invariant 7: every size checked before any work
    if cfg.data.packing:
        raise ConfigError("data.packing=true does not apply to RL, whose rows are one prompt and its sampled "
                          "response each; remove data.packing from the RL config")
    if cfg.train.loss_chunk_tokens:
        raise ConfigError(f"train.loss_chunk_tokens={cfg.train.loss_chunk_tokens} applies to the SFT cross-entropy "
                          "only, and RL's losses are not chunked; remove train.loss_chunk_tokens from the RL config")
    check_moe_section(cfg.moe, checked_config(cfg))  # a dense policy with moe.* set: refused before any work
    check_layout_fits(cfg.model, degrees)
    reward_fn = _reward_fn(cfg)
    prompts = read_prompts(cfg.data.path)
    held_out = read_prompts(cfg.eval.path, cfg.eval.max_samples, "eval.path") if cfg.eval.path else None
    output_dir = start_run(cfg, info, console, plan, degrees, scope)
    tokenizer = prepare_tokenizer(cfg, info, output_dir, log)
    check_rl_lengths(cfg, tokenizer, prompts, held_out)
    stream = PromptStream(len(prompts.prompts), plan.prompts_per_step, cfg.train.seed)
    parallel = build_parallel(degrees, info.device, info.rank)
    model, optimizer, reference = build_policy(cfg, info, tokenizer, parallel)
    critic, critic_optimizer = None, None
    if cfg.rl.advantage == "gae":
        critic, critic_optimizer = build_critic(cfg, tokenizer, info.device, parallel)
    log(f"policy: {count_parameters(model):,} parameters; {len(prompts.prompts)} prompts"
        + (f" ({prompts.num_skipped} malformed rows skipped)" if prompts.num_skipped else "")
        + ("; frozen reference for the KL" if reference is not None else "")
        + (f"; critic: {count_parameters(critic):,} parameters" if critic is not None else ""))
    layout = row_layout(cfg, parallel, info.device, log, model, critic)  # before any step, on these models
    components = (("critic", critic, critic_optimizer),) if critic is not None else ()
    checkpoints = _checkpoint_manager(cfg, info, degrees, model, optimizer, tokenizer, stream, components, log)
    checkpoints.clean_leftovers()
    resumed = checkpoints.resume()
    _check_reference(cfg, resumed, checkpoints.contract.extra_state["start_model_sha256"])
    state = RunState(0, {k: 0 for k in RL_COUNTERS})
    if resumed is not None and not resumed.weights_only:
        state = RunState(resumed.step, dict(resumed.counters))
    if info.is_main:
        atomic_write_text(output_dir / "config.yaml", dump_config(cfg))
    engine = make_engine(cfg, model_config(cfg.model, tokenizer), tokenizer, output_dir)
    try:
        engine.update_weights(sync_named_tensors(model))  # resumed weights (a fresh run sends the same ones)
        before = _evaluate(cfg, info, engine, tokenizer, held_out, reward_fn, log, "before RL")
        ctx = SimpleNamespace(cfg=cfg, plan=plan, rank=parallel.dp_rank, device=info.device, parallel=parallel,
                              options=step_options(cfg, parallel, loss_parallel=False,
                                                   router=router_settings(cfg.moe, hf_model(model).config)),
                              pad_id=tokenizer.pad_token_id,
                              layout=layout,
                              before_update=checkpoints.before_update, reward_fn=reward_fn, tokenizer=tokenizer,
                              prompts=prompts, stream=stream, reference=reference, engine=engine, info=info,
                              held_out=held_out, log=log, critic=critic, critic_optimizer=critic_optimizer,
                              reward_error_shown=False)
        writer = MetricsWriter(output_dir, info.is_main, cfg.logging.tensorboard, start_step=state.step)
        try:
            run_loop(cfg, info, state, functools.partial(rl_step, ctx, model, optimizer), checkpoints, writer,
                     console, functools.partial(_evaluate_at, ctx), cfg.rl.eval_every,
                     after_first_step=lambda: check_replicated(model, parallel.tp_group))
        finally:
            writer.close()
        counters = {"step": state.step, **state.counters}
        if state.stopped_by is not None:
            log(stopped_message(state.stopped_by, state.step, checkpoints.root))
            return RLResult(output_dir, None, counters, before, stopped=True)
        model_dir = checkpoints.save_model(output_dir / MODEL_DIR)
        after = _evaluate(cfg, info, engine, tokenizer, held_out, reward_fn, log, "after RL")
    finally:
        engine.close()
    log(f"wrote {output_dir}: config.yaml, metrics.jsonl ({counters['step']} steps), model/")
    plain = model if not info.is_distributed else None
    return RLResult(output_dir, model_dir, counters, before, after, model=plain)


def _checkpoint_manager(cfg: Config, info: DistInfo, degrees, model, optimizer, tokenizer, stream: PromptStream,
                        components: tuple, log) -> CheckpointManager:
    """The checkpoint manager, told what an RL run counts, what else it trains and what a resume must match."""
    contract = CheckpointContract(
        extra_state={
            "sampler": stream.state_dict(),
            "schedule": schedule_settings(cfg.train),
            "data_fingerprint": _file_sha256(cfg.data.path),
            "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
            "start_model_sha256": _start_fingerprint(cfg),
        },
        counter_keys=RL_COUNTERS,
        batch_field="rl.prompts_per_step",
        components=components,
    )
    layout = {"world_size": info.world_size, **dict(degrees.as_rows())}
    return CheckpointManager(cfg, info.rank, info.world_size, layout, model, optimizer, tokenizer, contract, log)


def _check_reference(cfg: Config, resumed, fingerprint: str) -> None:
    """The frozen reference (and, with LoRA, the base weights) is rebuilt from the starting model: refuse a
    resume whose start has changed."""
    if resumed is None or resumed.weights_only or (cfg.rl.kl_coef == 0 and cfg.lora.r == 0):
        return
    state = json.loads((resumed.path / "train_state" / "state.json").read_text())
    saved = state.get("start_model_sha256")
    if saved is not None and saved != fingerprint:
        raise ConfigError(
            f"the starting model {cfg.model.name_or_path or 'model.config'} differs from the one checkpoint "
            f"{resumed.path} started from, so the KL reference or LoRA base would change; restore it or start a new "
            "output_dir"
        )


def _trainer_logprobs(ctx, model, batch) -> tuple[list | None, list | None, list | None, float]:
    """Old (pre-update) and reference log-probs, and PPO's values, of every sample: each rank scores its own
    slice, then all share."""
    rl, plan = ctx.cfg.rl, ctx.plan
    start = time.perf_counter()
    per_rank = len(batch) // plan.dp_size
    mine = batch.select(range(ctx.rank * per_rank, (ctx.rank + 1) * per_rank))
    # On-policy shortcut: with one optimizer step per rollout the old policy is the current one.
    need_old = plan.optimizer_steps_per_rollout > 1 or (rl.kl_coef > 0 and rl.kl_in_reward)
    score = functools.partial(response_logprobs, batch=mine, pad_id=ctx.pad_id,
                              micro_batch_size=plan.micro_batch_size, temperature=rl.temperature,
                              device=ctx.device, autocast_dtype=ctx.options.autocast_dtype, layout=ctx.layout)
    group = ctx.options.dp_group
    old = all_gather_lists(score(model), group) if need_old else None
    ref = None
    if ctx.reference is not None:
        ref = all_gather_lists(score(ctx.reference), group)
    elif rl.kl_coef > 0:  # LoRA: the reference is the policy with its adapters disabled
        from isotrain.rl.lora import reference_logits_context

        with reference_logits_context(model):
            ref = all_gather_lists(score(model), group)
    values = None
    if ctx.critic is not None:
        values = all_gather_lists(token_values(ctx.critic, mine, ctx.pad_id, plan.micro_batch_size, ctx.device,
                                               ctx.options.autocast_dtype, ctx.layout), group)
    return old, ref, values, time.perf_counter() - start


def rl_step(ctx, model, optimizer, state: RunState) -> dict:
    """RL step `state.step`: rollout, log-probs, advantages, updates, weight sync; returns its metrics row."""
    cfg, rl, plan, counters = ctx.cfg, ctx.cfg.rl, ctx.plan, state.counters
    start = time.perf_counter()
    batch, rounds = collect(ctx.engine, ctx.tokenizer, ctx.prompts, ctx.stream, counters["prompt_rounds"], rl,
                            ctx.reward_fn, cfg.train.seed, ctx.rank, plan.dp_size, ctx.options.dp_group)
    generate_s = time.perf_counter() - start
    _refuse_failed_rewards(ctx.cfg.rl.reward, rounds)
    old, ref, values, logprob_s = _trainer_logprobs(ctx, model, batch)
    token_advantages, returns = advantages(batch, rl, old, ref, values)
    per_token = {"advantages": token_advantages, "old_logprobs": old, "ref_logprobs": ref,
                 "engine_logprobs": batch.engine_logprobs, "old_values": values, "returns": returns}
    total_updates = cfg.train.max_steps * plan.optimizer_steps_per_rollout
    first = counters["optimizer_steps"]

    def lr_of(k: int) -> float:
        return lr_at(first + k, lr=cfg.train.lr, schedule=cfg.train.schedule, warmup_steps=cfg.train.warmup_steps,
                     max_steps=total_updates, min_lr_ratio=cfg.train.min_lr_ratio)

    update_start = time.perf_counter()
    totals = run_updates(model, optimizer, batch, per_token, ctx, state.step, lr_of)
    update_s = time.perf_counter() - update_start
    sync_start = time.perf_counter()
    ctx.engine.update_weights(sync_named_tensors(model))
    sync_s = time.perf_counter() - sync_start
    counters["prompt_rounds"] += rounds.rounds
    counters["optimizer_steps"] += totals.num_updates
    counters["tokens_seen"] += totals.input_tokens
    counters["trained_tokens"] += int(totals.stats[0])
    counters["samples_seen"] += totals.samples
    _report_reward_errors(ctx, state.step + 1, rounds)
    return _metrics_row(counters, batch, rounds, totals, ctx.critic is not None, time.perf_counter() - start,
                        {"generate_s": generate_s, "logprob_s": logprob_s, "update_s": update_s, "sync_s": sync_s})


def _refuse_failed_rewards(reward: str, rounds) -> None:
    """A rollout whose every reward failed has no signal to learn from: stop before updating on it.
    Both counts are global, so every rank stops at the same step."""
    if rounds.num_scored and rounds.reward_errors == rounds.num_scored:
        raise TrainingError(f"the reward function failed on all {rounds.num_scored} samples of this step, first "
                            f"with {rounds.first_error}; fix rl.reward={reward!r} and run again")


def _report_reward_errors(ctx, step: int, rounds) -> None:
    """Some samples' rewards failed (scored 0): show the first exception once per run, then only counts."""
    if not rounds.reward_errors:
        return
    if rounds.first_error is not None and not ctx.reward_error_shown:
        ctx.reward_error_shown = True
        ctx.log(f"[yellow]step {step}: the reward function raised {escape(rounds.first_error)} on a sample; such "
                "samples are scored 0 and counted in the metric reward_errors[/]")
    else:
        ctx.log(f"[yellow]step {step}: the reward function failed on {rounds.reward_errors} sample(s), scored 0[/]")


def _metrics_row(counters: dict, batch, rounds, totals: UpdateTotals, with_critic: bool, step_s: float,
                 timings: dict) -> dict:
    rewards = torch.tensor(batch.rewards, dtype=torch.float64)
    return {
        "loss": totals.loss_sum / totals.num_updates,
        "lr": totals.lr,
        "grad_norm": totals.grad_norm_sum / totals.num_updates,
        **{k: counters[k] for k in ("tokens_seen", "trained_tokens", "samples_seen")},
        "tokens_per_s": totals.input_tokens / step_s,
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
        "score_mean": sum(batch.scores) / len(batch.scores),
        "response_len_mean": sum(len(r) for r in batch.response_ids) / len(batch),
        "truncated_frac": sum(batch.truncated) / len(batch),
        "kl": totals.stat("kl"),
        "clip_frac": totals.stat("clipped"),
        "entropy": totals.stat("entropy"),
        "pg_loss": totals.stat("pg_loss"),
        "logprob_diff": totals.stat("logprob_diff"),
        **({"critic_loss": totals.critic_loss_sum / totals.num_updates, "value_loss": totals.stat("value_loss"),
            "value_clip_frac": totals.stat("value_clipped"), "value_mean": totals.stat("value_mean")}
           if with_critic else {}),
        **(router_metrics(totals.router_means()) if totals.router is not None else {}),
        "filtered_groups": rounds.filtered_groups,
        "filler_groups": rounds.filler_groups,
        "generation_rounds": rounds.rounds,
        "reward_errors": rounds.reward_errors,
        "optimizer_steps": counters["optimizer_steps"],
        "step_s": step_s,
        **timings,
    }


def _evaluate_at(ctx, step: int) -> dict:
    """rl.eval_every: the held-out score after `step` RL steps, as the metrics field eval_reward."""
    return {"eval_reward": _evaluate(ctx.cfg, ctx.info, ctx.engine, ctx.tokenizer, ctx.held_out, ctx.reward_fn,
                                     ctx.log, f"step {step}")}
