"""Asynchronous RL (`rl.max_off_policy_steps=1`, the process engine) killed and resumed: SIGKILL during a generation
(DAPO: several rounds per rollout), during a weight sync (PPO's critic), during a save (FSDP2 2), then
`checkpoint.resume=auto`: final weights, final checkpoint and metrics identical to an uninterrupted run. The kill
comes from the run's own progress (a hook in its processes), never from a timer. Without the rollouts in flight in the
checkpoint, the resumed run differs (tried).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from helpers import HANG_S, model_weights, run_concurrently, subprocess_env
from test_async_rl import ASYNC, checkpoint, metrics, run, untimed
from zygote import PORT_TAKEN, fork_ranks, shared_zygote

# ----- SIGKILL at chosen moments, then resume -------------------------------------------------------------------

# Loaded by every process of the killed run: its ranks, forked from the zygote, import it before they run isotrain
# (so the functions are replaced wherever an already-imported module holds them by name), and the processes they
# spawn (the engine) import it from sitecustomize. Once checkpoint 2 is committed, rank 0 SIGKILLs itself at the
# first moment of the chosen kind: a generation round begun on the rollout worker, a weight sync to the engine half
# sent, or a save with its state (the rollouts in flight included) gathered but not yet committed. A marker says
# where it died.
KILLER = """
import os
import sys

def replace(module, name, new):
    original = getattr(module, name)
    for other in list(sys.modules.values()):
        if getattr(other, "__name__", "").startswith("isotrain") and getattr(other, name, None) is original:
            setattr(other, name, new)

if os.environ.get("RANK", "0") == "0":
    import signal
    from pathlib import Path

    where = os.environ["ISOTRAIN_TEST_KILL"]
    committed = Path(os.environ["ISOTRAIN_TEST_KILL_AFTER"])

    def die(what):
        Path(os.environ["ISOTRAIN_TEST_KILL_MARK"]).write_text(what)
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "generate":
        import isotrain.rl.generate as generate

        original_round = generate.generate_round

        def generate_round(*args, **kwargs):
            if committed.is_dir():
                die(f"generation round {args[4]}")
            return original_round(*args, **kwargs)

        replace(generate, "generate_round", generate_round)
    elif where == "sync":
        import isotrain.models.weights as weights

        original_sync = weights.saved_named_tensors

        def saved_named_tensors(*args, **kwargs):
            for i, item in enumerate(original_sync(*args, **kwargs)):
                if i == 3 and committed.is_dir():
                    die("weight sync, 3 tensors sent")
                yield item

        replace(weights, "saved_named_tensors", saved_named_tensors)  # isotrain.recipes.rl holds it by name
    elif where == "save":
        import isotrain.checkpoint.save as save

        original_save = save.save

        def save_(root, request, *args, **kwargs):
            if request.step == 4:
                die("save of step 4, before its commit")
            return original_save(root, request, *args, **kwargs)

        replace(save, "save", save_)  # isotrain.checkpoint.manager holds it by name
"""
# A rank: the hook, then `isotrain ARGV`.
RANK = """
import sys
import killer
if __name__ == "__main__":
    import isotrain.cli
    isotrain.cli.main(sys.argv[1:])
"""

KILLS = {
    # name: (where, processes, overrides)
    "generate, dapo": ("generate", 1, ["rl.algorithm=dapo"]),
    "sync, ppo": ("sync", 1, ["rl.algorithm=ppo", "rl.mini_batch_prompts=2", "rl.ppo_epochs=2"]),
    "save, fsdp2 2": ("save", 2, ["parallel.dp_replicate=1", "parallel.dp_shard=2"]),
}
RESUME = ["train.max_steps=5", "checkpoint.every_steps=2"]


def killed_run(tmp_path: Path, run_dir: Path, where: str, nproc: int, overrides: list[str]) -> str:
    """The run on ranks forked from the zygote, SIGKILLed at the chosen moment; where it died. Rank 0 dies; the
    other ranks are then SIGKILLed, as torchrun would."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "killer.py").write_text(KILLER)
    (hook / "sitecustomize.py").write_text("import killer\n")
    (hook / "rank.py").write_text(RANK)
    env = subprocess_env()
    env["PYTHONPATH"] = os.pathsep.join([str(hook), env["PYTHONPATH"]])
    env.update(ISOTRAIN_TEST_KILL=where, ISOTRAIN_TEST_KILL_AFTER=str(checkpoint(run_dir, 2)),
               ISOTRAIN_TEST_KILL_MARK=str(tmp_path / "killed"))
    argv = ["rl", *ASYNC, f"output_dir={run_dir}", *overrides]
    for attempt in range(3):
        logs = [tmp_path / f"killed-{attempt}-rank{rank}.txt" for rank in range(nproc)]
        forked = fork_ranks(shared_zygote(), nproc, argv, logs, script=hook / "rank.py", env=env)
        try:
            forked.wait_rank(0, HANG_S)
        finally:
            forked.close()  # SIGKILLs the ranks still running
        output = forked.output()
        if (tmp_path / "killed").is_file() or nproc == 1 or PORT_TAKEN not in output:
            break
    assert forked.exit_codes()[0] != 0, output[-3000:]
    assert (tmp_path / "killed").is_file(), output[-3000:]
    return (tmp_path / "killed").read_text()


@pytest.mark.slow
@pytest.mark.parametrize("kill", list(KILLS))
def test_sigkill_during_generation_sync_or_save_then_resume_is_identical(tmp_path, kill):
    from isotrain.checkpoint.manifest import verify_checkpoint

    where, nproc, overrides = KILLS[kill]
    overrides = [*RESUME, *overrides]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    outcome = run_concurrently({"straight": lambda: run(nproc, straight, overrides),
                                "killed": lambda: killed_run(tmp_path, resumed, where, nproc, overrides)})
    assert outcome["killed"].startswith({"generate": "generation round", "sync": "weight sync",
                                         "save": "save of step 4"}[where]), outcome["killed"]
    assert not checkpoint(resumed, 4).exists()
    proc = run(nproc, resumed, [*overrides, "checkpoint.resume=auto"])
    assert "step-00000002 at step 2" in proc.stdout, proc.stdout[-2000:]

    weights_a, weights_b = model_weights(straight / "model"), model_weights(resumed / "model")
    assert weights_a.keys() == weights_b.keys() and weights_a
    for name in weights_a:
        assert torch.equal(weights_a[name], weights_b[name]), name
    final_a, final_b = checkpoint(straight, 5), checkpoint(resumed, 5)
    assert verify_checkpoint(final_b) == []
    # tensors, RNG states and the (empty: no step is left) rollouts in flight; config.yaml names the output_dir
    files = sorted(p.relative_to(final_a).as_posix() for p in final_a.rglob("*")
                   if p.suffix == ".safetensors" or p.name.startswith("rng-") or p.name == "rollouts_in_flight.json")
    assert any("optimizer" in f for f in files)
    for name in files:
        assert (final_a / name).read_bytes() == (final_b / name).read_bytes(), name
    rows_a, rows_b = metrics(straight), metrics(resumed)
    assert [r["step"] for r in rows_b] == [1, 2, 3, 4, 5]
    assert untimed(rows_a) == untimed(rows_b)
    assert [r["staleness"] for r in rows_a] == [0, 1, 1, 1, 1]
