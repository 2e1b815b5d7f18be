"""`isotrain rl` end to end through the real CLI and real processes.

One briefly trained SFT model of the bundled recipe (it gets some sums right, most wrong) is the
start of every run. The tests prove that:
- GRPO and DAPO raise a learnable reward (rl_e2e_rewards.py), sampled and greedy, in 40 steps,
  and DAPO raises its sampled exact-match score on the bundled task (held-out accuracy is reported);
- metrics.jsonl keeps its contract (the fields, counters that only grow, samples = steps × P × n);
- a SIGKILL after checkpoint k, then `checkpoint.resume=auto`, ends with byte-identical weights,
  optimizer state and metrics (invariants 4 and 5), also with PPO mini-batches and epochs and with
  DAPO's variable number of generation rounds;
- 2-process DDP and FSDP2 runs complete and save a model transformers loads; a 2-rank FSDP2
  checkpoint resumes on 1 process with the same prompt stream and counters (invariant 3);
- the separate-process rollout engine gives the same rollouts as the in-process one;
- bad input gets one clear line, a non-zero exit and no traceback (invariant 8);
- the bundled default (`isotrain rl` with no config) is wired to its warm start and data.
"""

from __future__ import annotations

import functools
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import HANG_S, REPO, model_weights, run_concurrently
from zygote import kill_forked_after_commit, run_forked_ranks, run_isotrain

# The start is chosen, not found: the held-out accuracy that N steps of the bundled recipe end at jumps with N and
# the seed (the cosine schedule spans N): the sums are either not learned yet (seed 2 at 360 and 385 steps: 10.5 %,
# 9.0 %; earlier measures, seeds 0, 1, 3 at 400: 5-16.5 %) or learned (seed 2 at 390 and 400: 86.0 %, 85.0 %, the
# fixture's upper bound). Seed 2 at 375 steps ends in between, at 32.0 % (torch 2.14, OMP_NUM_THREADS=1 as the
# tests run): right often enough for a signal, wrong often enough for room, far from both bounds (5-85 %), and
# cheaper than 400 steps. The RL numbers below were measured from it. Its neighbours land in either mode, so a
# change of the library's numerics can move it: then measure again, `isotrain train train.max_steps=N
# train.seed=S` (it prints the held-out accuracy) for a few N and S.
SFT_STEPS = 375
SFT_SEED = 2
# A guard against hangs, not a speed test: on a shared 2-core machine the SFT run took 54-222 s and
# one 40-step learning run 130-370 s, and a loaded machine stretches that further.
LONG_RUN_TIMEOUT_S = 900

# Small rollouts for the resume, layout and engine tests: P=4 prompts × n=4 samples per step.
SMALL = [
    "rl.prompts_per_step=4",
    "rl.group_size=4",
    "train.micro_batch_size=8",
    "eval.path=null",
    "logging.progress=false",
]

RL_FIELDS = ("step", "loss", "lr", "grad_norm", "tokens_seen", "trained_tokens", "samples_seen", "tokens_per_s",
             "reward_mean", "reward_std", "response_len_mean", "kl", "clip_frac", "entropy", "pg_loss",
             "filtered_groups", "behaviour_version", "staleness", "generate_s", "logprob_s", "update_s")
GROWING = ("step", "tokens_seen", "trained_tokens", "samples_seen", "optimizer_steps")


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def untimed(rows: list[dict]) -> list[dict]:
    """Rows without wall-clock columns: what must be identical between equivalent runs."""
    return [{k: v for k, v in row.items() if not k.endswith("_s") and k != "tokens_per_s"} for row in rows]


def tensor_files(directory) -> list[str]:
    return sorted(p.relative_to(directory).as_posix() for p in Path(directory).rglob("*.safetensors"))


@pytest.fixture(scope="module")
def sft(tmp_path_factory):
    """The starting model: the bundled SFT recipe stopped early, with one checkpoint at its last step."""
    run_dir = tmp_path_factory.mktemp("sft") / "sft"
    proc = run_isotrain(["train", f"train.max_steps={SFT_STEPS}", f"train.seed={SFT_SEED}", f"output_dir={run_dir}",
                         "logging.progress=false", f"checkpoint.every_steps={SFT_STEPS}"],
                        timeout=LONG_RUN_TIMEOUT_S, cwd=run_dir.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    accuracy = float(re.search(r"exact-match accuracy on 200 held-out prompts: ([\d.]+)%", proc.stdout)[1]) / 100
    # RL needs a start that is sometimes right (a signal) and often wrong (room to improve).
    assert 0.05 <= accuracy <= 0.85, accuracy
    return run_dir


def rl_cli(sft_dir, run_dir, *overrides, timeout: float = HANG_S) -> subprocess.CompletedProcess:
    """`isotrain rl` (bundled RL recipe) from the SFT model, in the run's parent directory, forked from a process
    that has done the imports (tests/zygote.py)."""
    args = ["rl", f"model.name_or_path={sft_dir / 'model'}", f"output_dir={run_dir}", "logging.progress=false",
            "checkpoint.every_steps=0", *overrides]
    Path(run_dir).parent.mkdir(parents=True, exist_ok=True)
    return run_isotrain(args, timeout=timeout, cwd=Path(run_dir).parent)


def rl_arguments(sft_dir, run_dir, overrides: list[str]) -> list[str]:
    return ["rl", f"model.name_or_path={sft_dir / 'model'}", f"output_dir={run_dir}", *overrides]


def rl_command(sft_dir, run_dir, overrides: list[str], nproc: int = 1) -> list[str]:
    """The ordinary launch (`python -m isotrain`, torchrun): the vLLM tests find and kill its engine process."""
    args = ["-m", "isotrain", *rl_arguments(sft_dir, run_dir, overrides)]
    if nproc == 1:
        return [sys.executable, *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]


# ----- 1 and 2: the reward rises; the metrics contract ---------------------------------------------------------

REWARD = f"rl.reward={Path(__file__).with_name('rl_e2e_rewards.py')}:leading_one"
RISE = ["rl.prompts_per_step=16", "rl.group_size=8", "train.micro_batch_size=64", "train.max_steps=40",
        "train.lr=2e-4", "train.warmup_steps=0", "train.seed=1", "eval.max_samples=100", REWARD]
WINDOW = 10  # steps averaged at the start and at the end


def greedy_rewards(stdout: str) -> tuple[float, float]:
    """Mean greedy reward on the held-out prompts, printed before and after RL."""
    found = dict(re.findall(r"(before|after) RL: mean greedy reward on \d+ held-out prompts: ([\d.]+)%", stdout))
    assert set(found) == {"before", "after"}, stdout[-2000:]
    return float(found["before"]) / 100, float(found["after"]) / 100


# The bundled task itself: exact match with the sum, the bundled RL recipe's sizes (P=64, n=8, lr 3e-4).
EXACT = ["train.max_steps=40", "train.warmup_steps=5", "eval.max_samples=200", "rl.max_generation_rounds=2"]
HELD_OUT = REPO / "isotrain" / "recipes" / "data" / "addition_eval.jsonl"  # the bundled RL recipe's eval.path


def answer_probability(model_dir) -> float:
    """Mean over the 200 held-out prompts of p(answer + EOS | prompt) at temperature 1.

    This is the exact-match reward that one sampled response expects (whitespace variants of the
    answer aside), computed exactly: no sampling noise, and it moves with every shift of
    probability, where greedy accuracy moves only when an argmax flips.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from isotrain.rl.experience import RolloutBatch, response_logprobs
    from isotrain.rl.generate import encode_prompts
    from isotrain.rl.prompts import read_prompts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    held_out = read_prompts(str(HELD_OUT))
    answers = [tokenizer.encode(a, add_special_tokens=False) + [tokenizer.eos_token_id] for a in held_out.answers]
    n = len(answers)
    batch = RolloutBatch(list(range(n)), encode_prompts(tokenizer, held_out.prompts), answers, [[]] * n,
                         [False] * n, [0.0] * n, [0.0] * n)
    logprobs = response_logprobs(model, batch, tokenizer.pad_token_id, 64, 1.0, torch.device("cpu"))
    return sum(math.exp(sum(row)) for row in logprobs) / n


@pytest.fixture(scope="module")
def learning_runs(sft, tmp_path_factory):
    """The three learning runs from the SFT model, (stdout, run directory) per (reward, algorithm):
    40 GRPO and 40 DAPO steps on the learnable reward ("rise"), 40 DAPO steps on the bundled task ("exact").

    They are independent single-process runs, so they run side by side, one per CPU core (longest first)."""
    root = tmp_path_factory.mktemp("learning")
    commands = {("exact", "dapo"): [*EXACT, "rl.algorithm=dapo"]}
    for algorithm in ("dapo", "grpo"):
        # DAPO: at most 2 prompt rounds per step (of the default 4), to halve its generation time.
        extra = ["rl.max_generation_rounds=2"] if algorithm == "dapo" else []
        commands[("rise", algorithm)] = [*RISE, f"rl.algorithm={algorithm}", *extra]
    dirs = {key: root / "-".join(key) for key in commands}
    procs = run_concurrently({key: functools.partial(rl_cli, sft, dirs[key], *overrides, timeout=LONG_RUN_TIMEOUT_S)
                              for key, overrides in commands.items()})
    for key, proc in procs.items():
        assert proc.returncode == 0, (key, proc.stderr[-3000:])
    return {key: (proc.stdout, dirs[key]) for key, proc in procs.items()}


@pytest.fixture(scope="module")
def rise_runs(learning_runs):
    """40 GRPO and 40 DAPO steps from the SFT model on the learnable reward: (stdout, run directory) per algorithm."""
    return {algorithm: learning_runs[("rise", algorithm)] for algorithm in ("grpo", "dapo")}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "dapo"])
def test_reward_rises(rise_runs, algorithm):
    stdout, run_dir = rise_runs[algorithm]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 41))
    first = sum(r["score_mean"] for r in rows[:WINDOW]) / WINDOW
    last = sum(r["score_mean"] for r in rows[-WINDOW:]) / WINDOW
    before, after = greedy_rewards(stdout)
    summary = f"sampled score {first:.3f} -> {last:.3f}, held-out greedy reward {before:.3f} -> {after:.3f}"
    # The policy, sampled and greedy, shows the rewarded behaviour far more often after 40 steps (from the
    # fixture's start, seed 1: GRPO sampled 0.574 -> 0.841, greedy 0.57 -> 0.87; DAPO 0.512 -> 0.919, 0.57 -> 0.96;
    # from an earlier start of greedy accuracy 72-81 %, seeds 1 and 2: sampled 0.54-0.61 -> 0.94-0.96, greedy
    # 0.55 -> 0.98-1.0).
    assert last >= first + 0.15, summary
    assert after >= before + 0.2, summary
    if algorithm == "dapo":
        # Dynamic sampling really ran: groups of equal scores were dropped and more rounds drawn.
        # (With this reward most groups are all-equal, so the round bound is reached and dropped
        # groups fill the batch; its mean score still follows the policy.)
        assert all(r["filtered_groups"] > 0 and r["generation_rounds"] > 1 for r in rows), summary


@pytest.mark.slow
def test_sampled_score_rises_on_the_bundled_task(sft, learning_runs):
    stdout, run_dir = learning_runs[("exact", "dapo")]
    found = dict(re.findall(r"(before|after) RL: exact-match accuracy on 200 held-out prompts: ([\d.]+)%",
                            stdout))
    greedy_before, greedy_after = float(found["before"]), float(found["after"])
    expected_before, expected_after = answer_probability(sft / "model"), answer_probability(run_dir / "model")
    rows = metrics(run_dir)
    first = sum(r["score_mean"] for r in rows[:WINDOW]) / WINDOW
    last = sum(r["score_mean"] for r in rows[-WINDOW:]) / WINDOW
    summary = (f"held-out expected accuracy {expected_before:.4f} -> {expected_after:.4f}, greedy accuracy "
               f"{greedy_before}% -> {greedy_after}%, sampled score {first:.3f} -> {last:.3f}")
    # Measured from an SFT start at held-out expected accuracy 0.469 (greedy 72%), train.seed 0, 1, 2, torch
    # 2.14.1 (2.13.0 gave bit-identical weights and curves on the seeds run with it: DAPO 0, GRPO 0 and 1):
    #   DAPO  expected accuracy +0.042, +0.036, +0.044; sampled score +0.058, +0.062, +0.067;
    #         greedy accuracy +1, -3, -0.5 points;
    #   GRPO  expected accuracy +0.049, -0.001, +0.063; sampled score +0.071, -0.001, +0.082;
    #         greedy accuracy 0, -9, +1.5 points.
    # From the start of greedy accuracy 81 % (expected 0.595), DAPO seed 0: expected accuracy -0.023, greedy
    # -7.5 points, sampled score +0.055. From the start this fixture trains now (375 steps: greedy 32.0 %,
    # expected 0.228), DAPO seed 0: expected accuracy +0.024, greedy +0.5 points, sampled score 0.356 -> 0.410
    # (+0.054). So 40 steps on the bundled task reliably raise the reward the policy is trained on (DAPO's
    # sampled score: +0.054 to +0.067 on every start and seed measured), but not the held-out accuracy, whose
    # change depends on the start; it is reported in the message, not asserted. Held-out learning is asserted
    # on the learnable reward (test_reward_rises), and GRPO's rise, absent at seed 1, is checked there too.
    assert last >= first + 0.025, summary


@pytest.mark.slow
def test_metrics_rows_keep_the_contract(rise_runs):
    for algorithm, (_, run_dir) in rise_runs.items():
        rows = metrics(run_dir)
        for row in rows:
            missing = [k for k in RL_FIELDS if k not in row]
            assert not missing, (algorithm, row["step"], missing)
            assert all(isinstance(row[k], (int, float)) for k in RL_FIELDS), (algorithm, row)
        for key in GROWING:
            values = [r[key] for r in rows]
            assert all(a < b for a, b in zip(values, values[1:])), (algorithm, key, values)
        # One optimizer step per rollout of P=16 prompts × n=8 samples.
        assert [r["samples_seen"] for r in rows] == [r["step"] * 16 * 8 for r in rows], algorithm
        assert [r["optimizer_steps"] for r in rows] == [r["step"] for r in rows], algorithm
        # Synchronous: each step trains on samples of the policy it starts with.
        assert [(r["behaviour_version"], r["staleness"]) for r in rows] == [(r["step"] - 1, 0) for r in rows]
        assert all(r["lr"] == 2e-4 for r in rows)  # the bundled recipe's constant schedule
        assert all(0 <= r["score_mean"] <= 1 for r in rows)
        assert all(0 < r["response_len_mean"] <= 5 for r in rows)  # rl.max_new_tokens of the recipe
        # Exact token accounting: a step trains every response token of its P × n samples, and sees
        # those plus the prompt tokens.
        previous = {"trained_tokens": 0, "tokens_seen": 0}
        for r in rows:
            trained = r["trained_tokens"] - previous["trained_tokens"]
            assert trained == pytest.approx(r["response_len_mean"] * 16 * 8, abs=1e-6), (algorithm, r["step"])
            assert r["tokens_seen"] - previous["tokens_seen"] > trained + 16 * 8 * 3, (algorithm, r["step"])
            previous = r
    dapo = metrics(rise_runs["dapo"][1])
    # DAPO draws more prompt rounds while groups are filtered; GRPO draws exactly one per step.
    assert sum(r["generation_rounds"] for r in dapo) > len(dapo)
    assert all(r["generation_rounds"] == 1 and r["filtered_groups"] == 0 for r in metrics(rise_runs["grpo"][1]))


# ----- 3: exact resume after SIGKILL -------------------------------------------------------------------------------

RESUME_VARIANTS = {
    "grpo": [],
    # PPO's critic, 2 mini-batches × 2 epochs: 4 optimizer steps per rollout, old log-probs recomputed,
    # ratios clipped; the critic and its optimizer state resume too.
    "ppo": ["rl.algorithm=ppo", "rl.mini_batch_prompts=2", "rl.ppo_epochs=2", "train.lr=1e-3"],
    # LoRA with a KL to the adapters-off reference: adapters and their AdamW state resume, base from the start model
    "lora": ["lora.r=4", "rl.kl_coef=0.05"],
    # dynamic sampling consumes a variable number of prompt rounds per step
    "dapo": ["rl.algorithm=dapo"],
}
RESUME = [*SMALL, "train.max_steps=8", "checkpoint.every_steps=2", "train.deterministic=true"]


def run_to_end(sft_dir, run_dir, overrides: list[str], nproc: int = 1) -> subprocess.CompletedProcess:
    proc = run_forked_ranks(nproc, rl_arguments(sft_dir, run_dir, overrides))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def kill_after_checkpoint(sft_dir, run_dir, overrides: list[str], step: int) -> None:
    """Start a run (forked) and SIGKILL it as soon as checkpoint `step` is committed."""
    kill_forked_after_commit(1, rl_arguments(sft_dir, run_dir, overrides), run_dir, step)
    assert not (run_dir / "model").exists()


@pytest.mark.slow
@pytest.mark.parametrize("variant", list(RESUME_VARIANTS))
def test_sigkill_then_resume_is_byte_identical(sft, tmp_path, variant):
    from isotrain.checkpoint.manifest import verify_checkpoint

    overrides = [*RESUME, *RESUME_VARIANTS[variant]]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    # The straight run and the run to kill are independent: side by side, one per core.
    run_concurrently({"straight": lambda: run_to_end(sft, straight, overrides),
                      "killed": lambda: kill_after_checkpoint(sft, resumed, overrides, 4)})
    proc = run_to_end(sft, resumed, [*overrides, "checkpoint.resume=auto"])
    assert "resumed from" in proc.stdout and "step-00000004 at step 4" in proc.stdout, proc.stdout[-2000:]

    weights_a, weights_b = model_weights(straight / "model"), model_weights(resumed / "model")
    assert weights_a.keys() == weights_b.keys() and weights_a
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name
    final_a, final_b = straight / "checkpoints" / "step-00000008", resumed / "checkpoints" / "step-00000008"
    assert verify_checkpoint(final_b) == []
    files = tensor_files(final_a)
    assert files == tensor_files(final_b) and any("optimizer" in f for f in files)
    for name in files:
        assert (final_a / name).read_bytes() == (final_b / name).read_bytes(), name
    state_a = json.loads((final_a / "train_state" / "state.json").read_text())
    state_b = json.loads((final_b / "train_state" / "state.json").read_text())
    for key in ("step", "tokens_seen", "trained_tokens", "samples_seen", "prompt_rounds", "optimizer_steps"):
        assert state_a[key] == state_b[key], key

    rows_a, rows_b = metrics(straight), metrics(resumed)
    assert [r["step"] for r in rows_b] == list(range(1, 9))
    assert untimed(rows_a) == untimed(rows_b)
    if variant == "ppo":
        assert all(r["optimizer_steps"] == 4 * r["step"] for r in rows_a)
        assert any(r["clip_frac"] > 0 for r in rows_a[4:]), "the resumed steps never clipped a ratio"
        assert all(r["value_loss"] > 0 for r in rows_a)  # the critic trained
    if variant == "lora":
        assert all(r["kl"] > 0 for r in rows_a[1:])  # the reference (adapters off) differs from the policy
    if variant == "dapo":
        # Steps 5-8 drew their prompts from the restored round counter, after extra rounds before it.
        assert sum(r["generation_rounds"] for r in rows_a[:4]) > 4
        assert state_a["prompt_rounds"] == sum(r["generation_rounds"] for r in rows_a)


# ----- 4: two processes: DDP and FSDP2; a 2-rank checkpoint resumed on 1 process ------------------------------------

LAYOUTS = {
    "ddp": ["parallel.dp_replicate=2", "parallel.dp_shard=1"],
    "fsdp2": ["parallel.dp_replicate=1", "parallel.dp_shard=2"],
}
TWO_RANKS = [*SMALL, "train.micro_batch_size=4", "train.max_steps=4", "checkpoint.every_steps=2"]


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_two_process_run_completes_and_fsdp2_resumes_on_one(sft, tmp_path, layout):
    from transformers import AutoModelForCausalLM

    from isotrain.checkpoint.layout import write_latest

    run_dir = tmp_path / "two"
    proc = run_forked_ranks(2, ["rl", f"model.name_or_path={sft / 'model'}", f"output_dir={run_dir}", *TWO_RANKS,
                                *LAYOUTS[layout]])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["samples_seen"] for r in rows] == [16, 32, 48, 64]
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    saved = model_weights(run_dir / "model")
    for name, tensor in model.state_dict().items():
        if name in saved:
            assert torch.equal(tensor, saved[name]), name
    assert (run_dir / "checkpoints" / "step-00000004").is_dir()
    if layout == "ddp":
        return  # one cross-layout resume is enough, and FSDP2's sharded state is the harder one

    # Step 2 of the 2-rank run, continued on 1 process: the same prompt stream and counters.
    single = tmp_path / "one"
    shutil.copytree(run_dir / "checkpoints", single / "checkpoints")
    shutil.rmtree(single / "checkpoints" / "step-00000004")
    write_latest(single / "checkpoints", "step-00000002")
    proc = run_to_end(sft, single, [*TWO_RANKS, "train.micro_batch_size=8"])
    assert "resumed from" in proc.stdout and "saved on 2 rank(s), now 1" in proc.stdout, proc.stdout[-2000:]
    resumed_rows = metrics(single)
    assert [r["step"] for r in resumed_rows] == [3, 4]
    for key in ("samples_seen", "optimizer_steps", "lr"):
        assert [r[key] for r in resumed_rows] == [r[key] for r in rows[2:]], key
    state_two = json.loads((run_dir / "checkpoints" / "step-00000004" / "train_state" / "state.json").read_text())
    state_one = json.loads((single / "checkpoints" / "step-00000004" / "train_state" / "state.json").read_text())
    assert state_one["prompt_rounds"] == state_two["prompt_rounds"] == 4


# ----- 5: the separate-process rollout engine -----------------------------------------------------------------------


@pytest.mark.slow
def test_process_engine_gives_the_rollouts_of_the_in_process_engine(sft, tmp_path):
    overrides = [*SMALL, "train.max_steps=3", "train.deterministic=true"]
    run_concurrently({"process": lambda: run_to_end(sft, tmp_path / "process", [*overrides, "rollout.engine=process"]),
                      "hf": lambda: run_to_end(sft, tmp_path / "hf", overrides)})
    rows_hf, rows_process = metrics(tmp_path / "hf"), metrics(tmp_path / "process")
    assert [r["step"] for r in rows_process] == [1, 2, 3]
    assert set(rows_process[0]) == set(rows_hf[0])
    # Same weights, same call seeds, same generate code: the same samples, hence the same counts and rewards.
    assert untimed(rows_process) == untimed(rows_hf)
    assert (tmp_path / "process" / "model" / "model.safetensors").is_file()


# ----- 6: bad input -------------------------------------------------------------------------------------------------


def assert_clean_error(proc, expected: str) -> None:
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and expected in " ".join(lines[0].split()), proc.stderr


# The commands below are independent processes: they run side by side, one per CPU core, once per
# module (cli_runs without the SFT model, sft_cli_runs from it), and each test checks its own process.


@pytest.fixture(scope="module")
def cli_runs(tmp_path_factory):
    from isotrain.recipes import default_rl_recipe_path

    root = tmp_path_factory.mktemp("cli")
    commands = {
        "not divisible": ["config", "show", "rl.prompts_per_step=5", "rl.group_size=4", "parallel.dp_replicate=2",
                          "--world-size", "2"],
        "config show": ["config", "show", str(default_rl_recipe_path()), "rl.prompts_per_step=8", "rl.group_size=4",
                        "rl.mini_batch_prompts=4", "train.micro_batch_size=4", "parallel.dp_replicate=2",
                        "rl.max_off_policy_steps=2", "rollout.engine=process", "rl.rollout_correction=bypass",
                        "--world-size", "2"],
        "unknown key": ["rl", "rl.grup_size=4", f"output_dir={root / 'run'}"],
    }
    cwd = {"unknown key": root}
    return run_concurrently({name: functools.partial(run_isotrain, args, cwd=cwd.get(name) or REPO)
                             for name, args in commands.items()})


@pytest.fixture(scope="module")
def sft_cli_runs(sft, tmp_path_factory):
    """{name: (CompletedProcess, run directory)}"""
    root = tmp_path_factory.mktemp("sft-cli")
    commands = {
        "global batch": ["rl.prompts_per_step=4", "rl.group_size=4", "train.micro_batch_size=8",
                         "train.global_batch_size=32"],
        "reward module": ["rl.reward=nosuchmodule:f"],
        "prompt file": [f"data.path={root / 'nope.jsonl'}"],
    }
    dirs = {name: root / name.replace(" ", "-") / "run" for name in commands}
    procs = run_concurrently({name: functools.partial(rl_cli, sft, dirs[name], *overrides)
                              for name, overrides in commands.items()})
    return {name: (proc, dirs[name]) for name, proc in procs.items()}


def test_prompts_not_divisible_by_the_dp_size_are_refused_before_any_work(cli_runs):
    assert_clean_error(cli_runs["not divisible"], "rl.prompts_per_step=5 cannot be split over 2 data-parallel ranks "
                                                  "(each rank generates whole groups); use rl.prompts_per_step in [4, 6]")


def test_config_show_prints_the_rl_sizes(cli_runs):
    proc = cli_runs["config show"]
    assert proc.returncode == 0, proc.stderr
    for line in ("# samples_per_rollout: 32", "# optimizer_steps_per_rollout: 2", "# grad_accum_steps: 2",
                 "global_batch_size: 16", "# max_off_policy_steps: 2"):
        assert line in proc.stdout, (line, proc.stdout)


def test_unknown_rl_key_gets_a_did_you_mean(cli_runs):
    assert_clean_error(cli_runs["unknown key"], "unknown config key 'rl.grup_size'; did you mean rl.group_size?")


def test_wrong_global_batch_size_is_refused(sft_cli_runs):
    proc, _ = sft_cli_runs["global batch"]
    assert_clean_error(proc, "train.global_batch_size=32 is not used by RL: the global batch is "
                             "rl.mini_batch_prompts × rl.group_size = 16 sequences; remove it or set it to 16")


def test_unknown_reward_module_is_refused(sft_cli_runs):
    proc, run_dir = sft_cli_runs["reward module"]
    assert_clean_error(proc, "rl.reward 'nosuchmodule:f': module 'nosuchmodule' cannot be imported; check "
                             "PYTHONPATH or give the file as 'path/to/file.py:function'")
    assert not run_dir.exists()  # refused before any work


def test_missing_prompt_file_is_refused(sft_cli_runs):
    proc, run_dir = sft_cli_runs["prompt file"]
    missing = run_dir.parent.parent / "nope.jsonl"
    assert_clean_error(proc, f"data.path '{missing}' does not exist; point data.path at a .jsonl, "
                             ".jsonl.gz, .json or .parquet file, a glob or directory of such shards, or a "
                             "directory saved with datasets.save_to_disk")


def test_resuming_from_an_sft_checkpoint_needs_load_only(sft, tmp_path):
    checkpoint = sft / "checkpoints" / f"step-{SFT_STEPS:08d}"
    resume = [*SMALL, "train.max_steps=1", f"checkpoint.resume={checkpoint}"]
    # The refused run and the same run with load_only=model are independent: side by side, one per core.
    procs = run_concurrently({"load_only": lambda: rl_cli(sft, tmp_path / "run", *resume, "checkpoint.load_only=model"),
                              "refused": lambda: rl_cli(sft, tmp_path / "refused", *resume)})
    assert_clean_error(procs["refused"], f"checkpoint {checkpoint} was saved by another kind of run (no "
                                         "prompt_rounds counter); set checkpoint.load_only=model to start from its "
                                         "weights only")
    # With load_only=model the same checkpoint starts a new RL run from its weights.
    proc = procs["load_only"]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "started from the weights of" in proc.stdout
    assert [r["step"] for r in metrics(tmp_path / "run")] == [1]


# ----- 7: the bundled default wiring --------------------------------------------------------------------------------


def test_bundled_rl_recipe_runs_from_its_warm_start(sft, tmp_path):
    """`isotrain rl` with no config, in a directory where the warm-start model already exists."""
    from isotrain.recipes import RL_WARM_START

    shutil.copytree(sft / "model", tmp_path / RL_WARM_START[0])
    proc = run_isotrain(["rl", "train.max_steps=2", "rl.prompts_per_step=4", "rl.group_size=4",
                         "train.micro_batch_size=16", "logging.progress=false", "eval.max_samples=20"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is absent" not in proc.stdout  # the warm start was found, not retrained
    assert "before RL: exact-match accuracy on 20 held-out prompts" in proc.stdout
    assert "after RL: exact-match accuracy on 20 held-out prompts" in proc.stdout
    run_dir = tmp_path / "runs" / "rl-default"
    assert [r["step"] for r in metrics(run_dir)] == [1, 2]
    assert (run_dir / "model" / "model.safetensors").is_file()
    assert (run_dir / "checkpoints" / "step-00000002" / "manifest.json").is_file()  # saved at the last step


def test_warm_start_trains_the_missing_sft_model_with_the_bundled_recipe(tmp_path, monkeypatch):
    import isotrain.recipes.sft
    from isotrain.cli import _warm_start
    from isotrain.config import load_config
    from isotrain.errors import ConfigError
    from isotrain.recipes import RL_WARM_START, default_rl_recipe_path

    monkeypatch.chdir(tmp_path)
    trained = []
    monkeypatch.setattr(isotrain.recipes.sft, "train", trained.append)
    cfg = load_config(None, [], default=default_rl_recipe_path(), recipe="rl")
    assert cfg.model.name_or_path == RL_WARM_START[0]
    _warm_start(cfg)
    assert len(trained) == 1
    sft_cfg = trained[0]
    assert (sft_cfg.output_dir, sft_cfg.train.max_steps, sft_cfg.checkpoint.every_steps) == \
        ("runs/rl-default/sft", 400, 0)
    assert Path(sft_cfg.output_dir) / "model" == Path(RL_WARM_START[0])  # it writes where the RL recipe reads
    assert sft_cfg.data.path == cfg.data.path and Path(sft_cfg.data.path).is_file()

    # Present already, or another model chosen: nothing is trained.
    (tmp_path / RL_WARM_START[0]).mkdir(parents=True)
    (tmp_path / RL_WARM_START[0] / "config.json").write_text("{}")
    _warm_start(cfg)
    other = load_config(None, ["model.name_or_path=elsewhere"], default=default_rl_recipe_path(), recipe="rl")
    shutil.rmtree(tmp_path / "runs")
    _warm_start(other)
    assert len(trained) == 1

    # Several processes would all train it: refused with a sentence.
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="does not exist yet; run `isotrain rl` once on one process"):
        _warm_start(cfg)
