"""RL post-training (`isotrain rl`): what the recipe adds to the run session (session.py).

    sizes      prompts, samples, mini-batches and GA of a step (sizes.py plan_rl_batches); MoE and layout checks;
               the reward function, the prompts and the held-out prompts read
    build      tokenizer -> the policy, its frozen reference (a KL term without LoRA) and PPO's critic on the
               mesh -> packed or padded rows, probed on these models -> the rollout engine with its own copy
    start      the policy's weights sent to the engine; the held-out score before RL
    step k     generate and score a rollout (generate.py) -> the trainer's log-probs -> advantages and
               optimizer steps (update.py) -> the new weights sent to the engine -> the metrics row;
               with rl.max_off_policy_steps >= 1 the rollout was generated ahead, while earlier steps trained,
               and the weights are sent when the engine is next idle (ahead.py)
    finish     the held-out score after RL

A resume must find the same starting model: the frozen reference (and a LoRA base) is rebuilt from it.
"""

from __future__ import annotations

import functools
import time

from rich.console import Console
from rich.markup import escape

from isotrain.config import RLRunConfig
from isotrain.errors import ConfigError, TrainingError
from isotrain.models.checks import check_prompt_room
from isotrain.models.loading import check_layout_fits, checked_config, count_parameters, model_config
from isotrain.models.unwrap import hf_model
from isotrain.models.weights import saved_named_tensors
from isotrain.moe.settings import check_moe_section, router_settings
from isotrain.parallel.dist import barrier, twin_group
from isotrain.rl.ahead import IN_FLIGHT_FILE, RolloutsAhead, read_in_flight
from isotrain.rl.critic import build_critic, token_values
from isotrain.rl.experience import all_gather_lists, response_logprobs
from isotrain.rl.generate import collect, evaluate
from isotrain.rl.metrics import rl_metrics_row
from isotrain.rl.packing import row_layout
from isotrain.rl.pieces import Pieces
from isotrain.rl.policy import build_policy, make_engine, start_fingerprint
from isotrain.rl.prompts import PromptStream, prompts_fingerprint, read_prompt_sources, read_prompts
from isotrain.rl.rewards import format_gated, load_reward
from isotrain.rl.sync_check import check_checksums, recording_checksums, sync_adapter_and_verify, sync_and_verify
from isotrain.rl.update import UpdateContext, advantages, recomputes_old_logprobs, run_updates
from isotrain.session import Recipe, RunResult, Session, run_session
from isotrain.sizes import plan_rl_batches
from isotrain.train.run_loop import RunState
from isotrain.train.schedule import lr_of_step
from isotrain.train.setup import prepare_tokenizer, step_options

RL_COUNTERS = ("tokens_seen", "trained_tokens", "samples_seen", "prompt_rounds", "optimizer_steps")


def rl_train(cfg: RLRunConfig, console: Console | None = None) -> RunResult:
    """RL post-training of `cfg.model` on the prompts of `cfg.data.path`; held-out scores before and after."""
    return run_session(cfg, RL, console)


class RL(Recipe):
    counter_keys = RL_COUNTERS
    batch_field = "rl.prompts_per_step"

    def __init__(self, cfg: RLRunConfig, degrees):
        self.cfg = cfg
        self.plan = plan_rl_batches(cfg, degrees)
        hf_config = checked_config(cfg)
        check_moe_section(cfg.moe, hf_config)  # a dense policy with moe.* set: refused before any work
        check_layout_fits(cfg.model, degrees)
        self.eval_every = cfg.rl.eval_every
        self.reward_fn = load_reward(cfg.rl.reward)
        if cfg.rl.format_pattern:
            self.reward_fn = format_gated(self.reward_fn, cfg.rl.format_pattern, cfg.rl.format_penalty)
        self.mixture = None  # data.sources: which prompts each round draws (rl/prompts.py)
        if cfg.data.sources:
            self.prompts, self.mixture = read_prompt_sources(cfg.data.sources, cfg.train.seed,
                                                                 self.plan.prompts_per_step)
        else:
            self.prompts = read_prompts(cfg.data.path)
        self.held_out = read_prompts(cfg.eval.path, cfg.eval.max_samples, "eval.path") if cfg.eval.path else None
        if cfg.rollout.engine == "vllm" and cfg.rollout.vllm.url is not None:
            from isotrain.rl.engine_vllm import logprobs_mode_for, vllm_lora_rank

            logprobs_mode_for(cfg.rl.temperature, cfg.rl.top_p)
            vllm_lora_rank(cfg.lora.r)
        elif cfg.rollout.engine == "vllm":  # the engine's interpreter and settings, refused before any work
            from isotrain.rl.engine_vllm import check_moe_lora, check_settings, vllm_lora_rank

            check_settings(cfg.rollout.vllm.python, cfg.rl.temperature, cfg.rl.top_p, cfg.rollout.vllm.engine_args)
            vllm_lora_rank(cfg.lora.r)
            check_moe_lora(cfg.rollout.vllm.python, cfg.lora.r, hf_config)
        self.engine = None
        self.ahead: RolloutsAhead | None = None  # rl.max_off_policy_steps >= 1: rollouts generated ahead
        self.in_flight = []  # a resumed asynchronous run's rollouts, read from its checkpoint
        self.reward_error_shown = False

    def build(self, session: Session) -> None:
        cfg, info, parallel, plan = self.cfg, session.info, session.parallel, self.plan
        self.session = session
        self.tokenizer = prepare_tokenizer(cfg, info, session.output_dir, session.log)
        self._check_lengths()
        self.stream = PromptStream(len(self.prompts.prompts), plan.prompts_per_step, cfg.train.seed, self.mixture)
        self.model, self.optimizer, self.reference = build_policy(cfg, info.device, self.tokenizer, parallel)
        critic, critic_optimizer = None, None
        if cfg.rl.advantage == "gae":
            critic, critic_optimizer = build_critic(cfg, self.tokenizer, info.device, parallel)
        skipped = self.prompts.num_skipped
        session.log(f"policy: {count_parameters(self.model):,} parameters; {len(self.prompts.prompts)} prompts"
                    + (f" ({skipped} malformed rows skipped)" if skipped else "")
                    + ("; frozen reference for the KL" if self.reference is not None else "")
                    + (f"; critic: {count_parameters(critic):,} parameters" if critic is not None else ""))
        if self.mixture is not None:
            session.log("prompt mixture, per mixture epoch of {} prompts: {}".format(self.mixture.epoch_samples, ", ".join(
                f"{name} (weight {weight:g}) {count} of its {size}" for name, weight, count, size in zip(
                    self.mixture.names, self.mixture.weights, self.mixture.counts, self.mixture.sizes))))
        layout = row_layout(cfg.rl.pack_sequences, cfg.model.dtype, parallel, info.device, session.log, self.model,
                            critic)  # probed on these models
        options = step_options(cfg, parallel, loss_parallel=False,
                               router=router_settings(cfg.moe, hf_model(self.model).config))
        # before_update is looked up at each step: the checkpoint manager exists only after build.
        self.ctx = UpdateContext(cfg, plan, parallel.dp_rank, info.device, options, self.tokenizer.pad_token_id,
                                 layout, lambda: session.checkpoints.before_update(), critic, critic_optimizer,
                                 Pieces.of(parallel))
        self.engine = make_engine(cfg, model_config(cfg.model, self.tokenizer), self.tokenizer, session.output_dir,
                                  info.rank)
        if cfg.rollout.engine == "vllm" and cfg.rollout.vllm.url is not None:
            info = self.engine.info
            session.log(f"rollout engine: the vLLM {info['vllm']} server at {cfg.rollout.vllm.url} on "
                        f"{info['platform']} (torch {info['torch']}), weights through {cfg.rollout.vllm.weights_dir}")
        elif cfg.rollout.engine == "vllm":
            info = self.engine.info
            session.log(f"rollout engine: vLLM {info['vllm']} on {info['platform']} (torch {info['torch']}), started "
                        f"in {info['start_s']:.1f} s, log in {self.engine.log_path.name}"
                        + ("; sleep mode (freeing the engine's memory while training) is unavailable on CPU"
                           if info["platform"] == "cpu" else ""))
        if cfg.rl.max_off_policy_steps:
            self.ahead = self._rollouts_ahead()

    def _rollouts_ahead(self) -> RolloutsAhead:
        """The worker thread's rollouts: the synchronous loop's `collect`, its exchanges on a twin of the DP group."""
        cfg, plan, ctx = self.cfg, self.plan, self.ctx
        group = twin_group(ctx.options.dp_group, cfg.parallel.timeout_s)
        cp_group = twin_group(ctx.pieces.group, cfg.parallel.timeout_s) if ctx.pieces.group is not None else None

        def collect_from(first_round: int):
            return collect(self.engine, self.tokenizer, self.prompts, self.stream, first_round, cfg.rl, self.reward_fn,
                           cfg.train.seed, ctx.dp_rank, plan.dp_size, group, cp_group)

        return RolloutsAhead(collect_from, cfg.rl.max_off_policy_steps, cfg.train.max_steps - 1)

    def _check_lengths(self) -> None:
        """A rollout sequence is a prompt and up to rl.max_new_tokens (eval.max_new_tokens when scoring held-out
        prompts) of response; `data.max_seq_len` (already within the model's positions) bounds it, checked before
        the first rollout rather than met halfway through the run."""
        cfg, tokenizer = self.cfg, self.tokenizer
        if tokenizer.eos_token_id is None:
            source = cfg.tokenizer.path or cfg.model.name_or_path
            raise ConfigError(f"the tokenizer in {source!r} has no eos token, so a response could not end; set its "
                              "eos_token and save it with save_pretrained")
        limit = cfg.data.max_seq_len
        check_prompt_room(tokenizer, self.prompts.prompts, cfg.rl.max_new_tokens, "rl.max_new_tokens", limit,
                          f"data.max_seq_len={limit}",
                          "data.sources" if cfg.data.sources else f"data.path={cfg.data.path!r}")
        if self.held_out is not None:
            check_prompt_room(tokenizer, self.held_out.prompts, cfg.eval.max_new_tokens, "eval.max_new_tokens", limit,
                              f"data.max_seq_len={limit}", f"eval.path={cfg.eval.path!r}")

    def extra_state(self) -> dict:
        data = self.cfg.data
        sources = [(source.path, source.weight) for source in data.sources or ()]
        return {"sampler": self.stream.state_dict(), "data_fingerprint": prompts_fingerprint(data.path, sources),
                "start_model_sha256": start_fingerprint(self.cfg),
                "max_off_policy_steps": self.cfg.rl.max_off_policy_steps}

    def state_files(self) -> dict[str, bytes]:
        """Asynchronous RL: the rollouts generated for the steps after this checkpoint's (ahead.py)."""
        return {IN_FLIGHT_FILE: self.ahead.in_flight_json()} if self.ahead is not None else {}

    def components(self) -> tuple:
        ctx = self.ctx
        return (("critic", ctx.critic, ctx.critic_optimizer),) if ctx.critic is not None else ()

    def check_resumed(self, resumed) -> None:
        """The frozen reference (and, with LoRA, the base weights) is rebuilt from the starting model: refuse a
        resume whose start has changed; and one whose rl.max_off_policy_steps has (the rollouts in flight, read
        back here, were generated on its schedule)."""
        cfg = self.cfg
        if resumed is None or resumed.weights_only:
            return
        self._check_off_policy(resumed)
        if cfg.rl.kl_coef == 0 and cfg.lora.r == 0:
            return
        saved = resumed.extra_state.get("start_model_sha256")
        if saved is not None and saved != start_fingerprint(cfg):
            raise ConfigError(
                f"the starting model {cfg.model.name_or_path or 'model.config'} differs from the one checkpoint "
                f"{resumed.path} started from, so the KL reference or LoRA base would change; restore it or start a "
                "new output_dir"
            )

    def _check_off_policy(self, resumed) -> None:
        """The rollouts in flight were generated by the schedule of the checkpoint's rl.max_off_policy_steps: another
        value would train them at other steps; read them back."""
        saved, now = resumed.extra_state.get("max_off_policy_steps", 0), self.cfg.rl.max_off_policy_steps
        if saved != now:
            raise ConfigError(
                f"rl.max_off_policy_steps={now} differs from checkpoint {resumed.path} ({saved}), whose rollouts "
                f"were generated on that schedule; set rl.max_off_policy_steps={saved} or start a new output_dir")
        self.in_flight = read_in_flight(resumed.path)

    def start(self, state: RunState) -> None:
        self._sync_weights("at the start")  # resumed weights (a fresh run sends the same)
        if self.ahead is not None:
            self.ahead.start(state.step, state.counters["prompt_rounds"], state.step, self.in_flight)
        self.eval_before = self._evaluate("before RL", state.step)

    def step(self, state: RunState) -> dict:
        """RL step `state.step`: rollout, log-probs, advantages, updates, weight sync; returns its metrics row."""
        cfg, rl, plan, ctx, counters = self.cfg, self.cfg.rl, self.plan, self.ctx, state.counters
        start = time.perf_counter()
        if self.ahead is None:
            batch, rounds = collect(self.engine, self.tokenizer, self.prompts, self.stream, counters["prompt_rounds"],
                                    rl, self.reward_fn, cfg.train.seed, ctx.dp_rank, plan.dp_size, ctx.options.dp_group,
                                    ctx.pieces.group)
            timings, version = {"generate_s": time.perf_counter() - start}, state.step
        else:
            generated, wait_s, sync_s = self.ahead.rollout(
                state.step, lambda: self._sync_weights(f"before step {state.step + 1}"))
            batch, rounds, version = generated.batch, generated.stats, generated.version
            # generate_s ran on the worker, beside earlier steps; wait_s is what this step waited for it.
            timings = {"generate_s": generated.generate_s, "wait_s": wait_s, "sync_s": sync_s}
        # The policy version that sampled every sample of this step (invariant 9), and how many updates old it is.
        timings.update(behaviour_version=version, staleness=state.step - version)
        _refuse_failed_rewards(rl.reward, rounds)
        old, ref, values, logprob_s = self._trainer_logprobs(batch)
        token_advantages, returns = advantages(batch, rl, old, ref, values)
        per_token = {"advantages": token_advantages, "old_logprobs": old, "ref_logprobs": ref,
                     "engine_logprobs": batch.engine_logprobs, "old_values": values, "returns": returns}
        # The schedule runs over optimizer steps: several per RL step.
        first, total_updates = counters["optimizer_steps"], cfg.train.max_steps * plan.optimizer_steps_per_rollout
        update_start = time.perf_counter()
        totals = run_updates(self.model, self.optimizer, batch, per_token, ctx, state.step,
                             lambda k: lr_of_step(cfg.train, first + k, total_updates))
        timings.update(logprob_s=logprob_s, update_s=time.perf_counter() - update_start)
        if self.ahead is None:
            sync_start = time.perf_counter()
            self._sync_weights(f"after the update of step {state.step + 1}")
            timings["sync_s"] = time.perf_counter() - sync_start
        counters["prompt_rounds"] += rounds.rounds
        counters["optimizer_steps"] += totals.num_updates
        counters["tokens_seen"] += totals.input_tokens
        counters["trained_tokens"] += int(totals.stats[0])
        counters["samples_seen"] += totals.samples
        self._report_reward_errors(state.step + 1, rounds)
        return rl_metrics_row(counters, batch, rounds, totals, ctx.critic is not None, time.perf_counter() - start,
                              timings, rl.correction)

    def _sync_weights(self, when: str) -> None:
        """The policy's weights to the engine, verified (rl/sync_check.py) before any sample of them is trained on:
        the checksums of what the engine holds equal those of what was sent (invariant 9), else the run stops here.
        isotrain's own engines sample with exactly the tensors they hold; an external engine (vLLM) also passes a
        probe of its log-probs against the trainer's, which shows the weights are used as the trainer uses them."""
        if self.cfg.rollout.engine != "vllm":
            sent: dict[str, str] = {}
            # Under save_pretrained's keys: a MoE model's experts one expert at a time, never a layer's gathered whole.
            self.engine.update_weights(recording_checksums(saved_named_tensors(self.model), sent))
            check_checksums(sent, self.engine.checksums(), when)
            return
        from isotrain.rl.generate import encode_prompts

        prompt = encode_prompts(self.tokenizer, self.prompts.prompts[:1])[0]
        common = (prompt, self.cfg.rl.max_new_tokens, self.cfg.rollout.vllm.probe_max_diff, self.ctx.device, when,
                  self.ctx.options.autocast_dtype, self.ctx.layout)
        if self.cfg.lora.r:  # LoRA as adapters: the base once, then only the adapter's tensors travel
            sync_adapter_and_verify(self.engine, self.model, self.engine.adapter_version == 0, *common)
        else:
            sync_and_verify(self.engine, self.model, *common)

    def _trainer_logprobs(self, batch) -> tuple[list | None, list | None, list | None, float]:
        """Old (pre-update) and reference log-probs, and PPO's values, of every sample: each DP rank scores its own
        slice (its CP ranks each a piece of every row, gathered back), then all share."""
        rl, plan, ctx = self.cfg.rl, self.plan, self.ctx
        start = time.perf_counter()
        per_rank = len(batch) // plan.dp_size
        mine = batch.select(range(ctx.dp_rank * per_rank, (ctx.dp_rank + 1) * per_rank))
        need_old = recomputes_old_logprobs(rl, plan.optimizer_steps_per_rollout)
        score = functools.partial(response_logprobs, batch=mine, pad_id=ctx.pad_id,
                                  micro_batch_size=plan.micro_batch_size, temperature=rl.temperature,
                                  device=ctx.device, autocast_dtype=ctx.options.autocast_dtype, layout=ctx.layout,
                                  pieces=ctx.pieces)
        group = ctx.options.dp_group
        old = all_gather_lists(score(self.model), group) if need_old else None
        ref = None
        if self.reference is not None:
            ref = all_gather_lists(score(self.reference), group)
        elif rl.kl_coef > 0:  # LoRA: the reference is the policy with its adapters disabled
            from isotrain.models.lora import reference_logits_context

            with reference_logits_context(self.model):
                ref = all_gather_lists(score(self.model), group)
        values = None
        if ctx.critic is not None:
            values = all_gather_lists(token_values(ctx.critic, mine, ctx.pad_id, plan.micro_batch_size, ctx.device,
                                                   ctx.options.autocast_dtype, ctx.layout, ctx.pieces), group)
        return old, ref, values, time.perf_counter() - start

    def _report_reward_errors(self, step: int, rounds) -> None:
        """Some samples' rewards failed (scored 0): show the first exception once per run, then only counts."""
        if not rounds.reward_errors:
            return
        if rounds.first_error is not None and not self.reward_error_shown:
            self.reward_error_shown = True
            self.session.log(f"[yellow]step {step}: the reward function raised {escape(rounds.first_error)} on a "
                             "sample; such samples are scored 0 and counted in the metric reward_errors[/]")
        else:
            self.session.log(f"[yellow]step {step}: the reward function failed on {rounds.reward_errors} "
                             "sample(s), scored 0[/]")

    def evaluate(self, step: int) -> dict:
        """rl.eval_every: the held-out score after `step` RL steps, as the metrics field eval_reward."""
        return {"eval_reward": self._evaluate(f"step {step}", step)}

    def finish(self, state: RunState, model_dir) -> None:
        self.eval_after = self._evaluate("after RL", state.step)

    def _evaluate(self, when: str, version: int) -> float | None:
        """The held-out score of the policy after `version` steps (the trainer's current weights)."""
        if self.held_out is None:
            return None
        if self.ahead is not None:  # the engine may still be generating with, or holding, an older version
            self.ahead.hold_version(version, lambda: self._sync_weights(f"for the held-out score {when}"))
        value = None
        if self.session.info.is_main:
            value = evaluate(self.engine, self.tokenizer, self.held_out, self.reward_fn, self.cfg.eval.max_new_tokens)
            what = "exact-match accuracy" if self.cfg.rl.reward == "exact_match" else "mean greedy reward"
            self.session.log(f"{when}: {what} on {len(self.held_out.prompts)} held-out prompts: {value:.1%}")
        barrier()
        return value

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.close()
        if self.engine is not None:
            self.engine.close()


def _refuse_failed_rewards(reward: str, rounds) -> None:
    """A rollout whose every reward failed has no signal to learn from: stop before updating on it.
    Both counts are global, so every rank stops at the same step."""
    if rounds.num_scored and rounds.reward_errors == rounds.num_scored:
        raise TrainingError(f"the reward function failed on all {rounds.num_scored} samples of this step, first "
                            f"with {rounds.first_error}; fix rl.reward={reward!r} and run again")
