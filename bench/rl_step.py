"""Time per RL step on CPU, side by side: isotrain GRPO and TRL's `GRPOTrainer`, in one run.

Both tools run the same workload: the bundled recipe's tiny Llama (hidden 128, 4 layers, tied
embeddings, the char tokenizer of the addition data: 20 tokens, 0.86M parameters), freshly
initialised with seed 0 and saved once, which both load; prompts of
`isotrain/recipes/data/addition_train.jsonl` (BOS + prompt, identical token ids in both tools);
reward = exact match of the completion with the sum. Per RL step: P prompts, n samples each,
at most `max_new_tokens` new tokens, temperature 1, top-p 1, no top-k; one optimizer step over
all P x n completions (TRL: `per_device_train_batch_size` = P x n, `gradient_accumulation_steps`
1, `num_iterations` 1; isotrain: M = P, micro-batch P x n); no KL and no reference model
(TRL `beta=0`, isotrain `rl.kl_coef=0`); clip 0.2; the same loss aggregation, a token mean per
sequence then a mean over sequences (TRL `loss_type="grpo"`, isotrain `rl.loss_agg=
seq-mean-token-mean`, the `grpo` preset); advantages (r - mean) / std per group; AdamW with lr
1e-4 constant, betas (0.9, 0.95), eps 1e-8, no weight decay, gradient clipping at 1.0; fp32,
no gradient checkpointing (TRL defaults to bf16 and checkpointing: both switched off), one
process, the same torch thread count. isotrain generates with its default in-process engine
(`rollout.engine=hf`) and `rollout.batch_size` = P x n, so both tools generate the P x n rows
of a step in one batch (isotrain with its own KV-cache sampling loop, TRL with `generate`).
`--compile` sets isotrain's train.compile=true; TRL runs as it comes.

isotrain runs twice, as two tools: with padded micro-batches (`rl.pack_sequences=false`, one sequence per
row) and with packed ones (the default: several sequences per row, position ids restarting at 0). Two
workloads: today's `--max-new-tokens 8`, where nearly every response runs to the budget, and a
variable-length one, `--max-new-tokens 56` (the longest prompt, 7 tokens, + 56 fits the model's 64
positions): the freshly initialised model samples nearly uniformly over its 20-token vocabulary, so each
new token is EOS with probability ~1/20 and responses end at geometrically distributed lengths (the real
engines of both tools, no scripted lengths; mean ~17 tokens, a few percent reach the budget). Padding a
micro-batch to its longest sequence then wastes most of it. Run it with the checkout's isotrain on the
path (PYTHONPATH=.), as the script's own folder comes first on sys.path.

Phases of a step, per tool:

    isotrain (the columns of its metrics.jsonl, written by the RL loop itself)
      generation  = generate_s: encode prompts, engine.generate (KV cache, per-token engine
                    log-probs), decode, rewards
      log-prob    = logprob_s: trainer log-probs before the update (none are needed here: one
                    optimizer step per rollout and no reference)
      update      = update_s: the forward/backward with the loss, gradient clipping, AdamW
      weight sync = sync_s: copy the new weights into the engine's own model
      step        = step_s (the phases + advantages and counters)
    TRL (a subclass that only adds timers; a callback from on_step_begin to on_step_end)
      generation  = _generate_and_score_completions minus its log-prob forwards: tokenize,
                    model.generate, decode, rewards, advantages, its metrics
      log-prob    = _get_per_token_logps_and_entropies under no_grad (old / reference
                    log-probs; TRL skips them too here)
      update      = step - rollout: training_step's forward/backward, clipping, AdamW
      weight sync = none: TRL generates with the training model itself
      step        = on_step_begin -> on_step_end

This machine's speed drifts more than the gaps measured, so the tools take turns RL step by RL
step, each running its own real loop in its own thread (only one thread runs at a time;
`run_in_turns` of train_throughput.py); odd rounds reverse the order. The table shows the median over
the timed steps of all rounds of every phase, and the median (min-max) of the ratio isotrain /
TRL of the k-th timed step of each tool in the same round.

    python bench/rl_step.py [--prompts 16] [--group 8] [--max-new-tokens 8] [--steps 20] [--warmup 2]
                            [--rounds 2] [--threads 2]

TRL is needed only here (not a dependency of isotrain): pip install trl.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may download: the model is built locally
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import argparse  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from rich.console import Console  # noqa: E402
from train_throughput import run_in_turns  # noqa: E402  (bench/ is the script's folder, so on sys.path)

from isotrain.config import build_config, load_config  # noqa: E402
from isotrain.models.build import build_plain  # noqa: E402
from isotrain.models.tokenizer import train_tokenizer  # noqa: E402
from isotrain.recipes import RECIPES_DIR  # noqa: E402
from isotrain import session  # noqa: E402
from isotrain.recipes.rl import rl_train  # noqa: E402
from isotrain.rl.prompts import read_prompts  # noqa: E402
from isotrain.rl.rewards import exact_match  # noqa: E402

DATA = RECIPES_DIR / "data" / "addition_train.jsonl"
LR, BETAS, EPS, CLIP, SEED = 1e-4, (0.9, 0.95), 1e-8, 0.2, 0
TARGET = 0.8  # isotrain step time <= 0.8 x TRL's
PHASES = ("step_s", "generate_s", "logprob_s", "update_s", "sync_s")
ISOTRAIN = {"isotrain padded": False, "isotrain packed": True}  # tool -> rl.pack_sequences
TOOLS = ("TRL", *ISOTRAIN)


def build_shared_model(model_dir: Path) -> None:
    """The bundled recipe's tiny Llama, freshly initialised (seed 0), and its char tokenizer, saved for both tools."""
    recipe = load_config(None, [])
    prompts = read_prompts(str(DATA))
    tokenizer = train_tokenizer([p + a for p, a in zip(prompts.prompts, prompts.answers)], "char", 0)
    model = build_plain(recipe.model, tokenizer, SEED)
    model.config.use_cache = True  # generation in both tools uses the KV cache
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)


_thread_local = threading.local()


class TurnTakingWriter(session.MetricsWriter):
    """isotrain's metrics writer; after each RL step's row (log_every=1) it hands the turn on."""

    def write(self, row: dict) -> None:
        super().write(row)
        _thread_local.after_step()


def run_isotrain(args, work: Path, model_dir: Path, after_step, pack: bool) -> list[dict]:
    samples = args.prompts * args.group
    name = "isotrain-packed" if pack else "isotrain-padded"
    cfg = build_config({
        "output_dir": str(work / name),
        "model": {"name_or_path": str(model_dir)},
        "data": {"path": str(DATA), "format": "prompt_completion"},
        "eval": {"path": None},
        "rl": {"algorithm": "grpo", "prompts_per_step": args.prompts, "group_size": args.group,
               "max_new_tokens": args.max_new_tokens, "temperature": 1.0, "kl_coef": 0.0,
               "clip_low": CLIP, "clip_high": CLIP, "loss_agg": "seq-mean-token-mean", "reward": "exact_match",
               "pack_sequences": pack},
        "rollout": {"engine": "hf", "batch_size": samples},
        "train": {"micro_batch_size": samples, "max_steps": args.warmup + args.steps, "lr": LR,
                  "schedule": "constant", "betas": list(BETAS), "eps": EPS, "weight_decay": 0.0,
                  "grad_clip": 1.0, "seed": SEED, "log_every": 1, "compile": args.compile},
        "checkpoint": {"every_steps": 0},
        "logging": {"progress": False},
    }, recipe="rl")
    _thread_local.after_step = after_step
    session.MetricsWriter = TurnTakingWriter  # the only hook the session offers; the step itself is untouched
    rl_train(cfg, console=Console(file=io.StringIO()))
    rows = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    return [{k: row[k] for k in PHASES} | {"response_len": row["response_len_mean"]} for row in rows]


def trl_trainer_class():
    from trl import GRPOTrainer

    class TimedGRPOTrainer(GRPOTrainer):
        """TRL's trainer unchanged, with timers around its rollout and its no-grad log-prob forwards."""

        current: dict

        def _generate_and_score_completions(self, inputs):
            start = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            self.current["rollout_s"] = self.current.get("rollout_s", 0.0) + time.perf_counter() - start
            mask = out["completion_mask"]
            self.current["response_len"] = float(mask.sum() / mask.shape[0])
            return out

        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            start = time.perf_counter()
            out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
            if not torch.is_grad_enabled():  # old / reference log-probs, not the loss forward
                self.current["logprob_s"] = self.current.get("logprob_s", 0.0) + time.perf_counter() - start
            return out

    return TimedGRPOTrainer


def run_trl(args, work: Path, model_dir: Path, after_step) -> list[dict]:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, PrinterCallback, TrainerCallback
    from trl import GRPOConfig

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, local_files_only=True)
    prompts = read_prompts(str(DATA))
    # The bos token as text: TRL tokenizes the prompt as is, isotrain prepends bos; the ids are then identical.
    rows = [{"prompt": tokenizer.bos_token + p, "answer": a} for p, a in zip(prompts.prompts, prompts.answers)]

    def exact_match_reward(prompts, completions, answer, **kwargs):
        return [exact_match(p, c, a) for p, c, a in zip(prompts, completions, answer)]

    steps: list[dict] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args_, state, control, **kwargs):
            trainer.current = {}
            self._start = time.perf_counter()

        def on_step_end(self, args_, state, control, **kwargs):
            row = trainer.current
            row["step_s"] = time.perf_counter() - self._start
            row.setdefault("logprob_s", 0.0)
            row["generate_s"] = row["rollout_s"] - row["logprob_s"]
            row["update_s"] = row["step_s"] - row["rollout_s"]
            row["sync_s"] = None
            steps.append(row)
            after_step()

    config = GRPOConfig(
        output_dir=str(work / "trl"), per_device_train_batch_size=args.prompts * args.group,
        gradient_accumulation_steps=1, num_generations=args.group, num_iterations=1,
        max_completion_length=args.max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
        loss_type="grpo", scale_rewards="group", epsilon=CLIP, learning_rate=LR, lr_scheduler_type="constant",
        adam_beta1=BETAS[0], adam_beta2=BETAS[1], adam_epsilon=EPS, weight_decay=0.0, max_grad_norm=1.0,
        max_steps=args.warmup + args.steps, bf16=False, gradient_checkpointing=False, use_cpu=True, seed=SEED,
        report_to=[], logging_steps=10**6, save_strategy="no", disable_tqdm=True, dataloader_num_workers=0,
    )
    trainer = trl_trainer_class()(
        model=model, reward_funcs=[exact_match_reward], args=config,
        train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer, callbacks=[StepTimer()],
    )
    trainer.remove_callback(PrinterCallback)
    if trainer.model.is_gradient_checkpointing:  # TRL's default; recomputation would slow its update
        raise SystemExit("TRL's model still uses gradient checkpointing; the comparison would not be fair")
    trainer.train()
    return steps


def run_interleaved(args, work: Path, model_dir: Path, order: list[str]) -> dict[str, list[dict]]:
    """Per-step timings of each tool, both trained at once in turns of one RL step."""
    def run_one(tool: str, pass_on) -> list[dict]:
        if tool == "TRL":
            return run_trl(args, work, model_dir, pass_on)
        return run_isotrain(args, work, model_dir, pass_on, ISOTRAIN[tool])

    return run_in_turns(order, args.threads, run_one)


def median(rows: list[dict], key: str) -> float | None:
    values = [row[key] for row in rows if row.get(key) is not None]
    return statistics.median(values) if values else None


def _ratio(rounds: list[dict[str, list[dict]]], warmup: int, tool: str, base: str, key: str) -> list[float]:
    """`key` of `tool` / of `base`, k-th timed step of each in the same round."""
    return [a[key] / b[key] for result in rounds for a, b in zip(result[tool][warmup:], result[base][warmup:])]


def _spread(ratios: list[float]) -> str:
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def print_table(rounds: list[dict[str, list[dict]]], warmup: int) -> None:
    timed = {tool: [row for result in rounds for row in result[tool][warmup:]] for tool in TOOLS}
    vs_trl = {tool: _ratio(rounds, warmup, tool, "TRL", "step_s") for tool in ISOTRAIN}
    print(f"\nmedian over {len(vs_trl['isotrain packed'])} timed RL steps; ratios: median (min-max) of the per-step "
          "ratio")
    print("| tool | step s | generation s | log-prob s | update s | weight sync s | response tokens | "
          "step vs TRL |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for tool in TOOLS:
        cells = [median(timed[tool], key) for key in PHASES]
        text = [f"{c:.3f}" if c is not None else "-" for c in cells]
        print(f"| {tool} | {' | '.join(text)} | {median(timed[tool], 'response_len'):.2f} | "
              f"{_spread(vs_trl[tool]) if tool in ISOTRAIN else '1.00'} |")
    update = _ratio(rounds, warmup, "isotrain packed", "isotrain padded", "update_s")
    print(f"isotrain update s, packed / padded: {_spread(update)}")
    met = statistics.median(vs_trl["isotrain packed"]) <= TARGET
    print(f"target: isotrain (packed) step time <= {TARGET} x TRL's: {'met' if met else 'MISSED'}")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=16, help="P: prompts per RL step.")
    parser.add_argument("--group", type=int, default=8, help="n: samples per prompt.")
    parser.add_argument("--max-new-tokens", type=int, default=8, help="Response budget per sample.")
    parser.add_argument("--steps", type=int, default=20, help="Timed RL steps per tool and round.")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed RL steps at the start of each tool's run.")
    parser.add_argument("--rounds", type=int, default=2, help="Repetitions, each a fresh run of both tools.")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads for both tools.")
    parser.add_argument("--compile", action="store_true", help="isotrain with train.compile=true (TRL as it comes).")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    try:
        import trl
    except ImportError:
        print("bench/rl_step.py compares with TRL's GRPOTrainer, which is not installed: pip install trl")
        sys.exit(1)
    import transformers

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"{args.threads} threads; P={args.prompts} prompts x n={args.group} samples, "
          f"max_new_tokens={args.max_new_tokens}; isotrain compile={args.compile}; "
          f"{args.warmup} warm-up + {args.steps} timed RL steps per tool")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers 5 renames TRL's gradient_checkpointing
    torch.set_num_threads(args.threads)
    rounds = []
    with tempfile.TemporaryDirectory(prefix="isotrain-bench-rl-") as tmp:
        build_shared_model(Path(tmp) / "model")
        for index in range(args.rounds):
            work = Path(tmp) / f"round{index}"
            order = list(TOOLS) if index % 2 == 0 else list(reversed(TOOLS))
            rounds.append(run_interleaved(args, work, Path(tmp) / "model", order))
            step_s = {tool: median(rows[args.warmup:], "step_s") for tool, rows in rounds[-1].items()}
            print(f"round {index + 1}: median step s: " + ", ".join(f"{t} {step_s[t]:.3f}" for t in TOOLS), flush=True)
    print_table(rounds, args.warmup)


if __name__ == "__main__":
    main()
