"""A rank that hangs: the ranks still alive stop with one sentence naming the step and the silent rank (issue #32).

Rank 1 of a 2-process FSDP2 run stops itself with SIGSTOP at the start of step HANG_AT (a start-up hook in its own
process, signal_worker.py), after checkpoints 2 and 4 are committed. Rank 0 waits in that step's first collective
for parallel.timeout_s, then must stop: the sentence (step, the rank that did not arrive, its progress file), exit
code 2, no traceback, both committed checkpoints verified by `isotrain ckpt verify`. Nothing here measures time,
but the timeout bounds every collective of the run, so a healthy rank that lagged its peer by more than TIMEOUT_S
in steps 1-4 (a save on a loaded machine) would be taken for a hang: TIMEOUT_S is far above any such lag seen
here, at the price of that many seconds of waiting. The stopped rank is continued and killed at the end,
whatever happened.
"""

from __future__ import annotations

import json
import select
import signal
from pathlib import Path

from helpers import HANG_S, TINY_RUN
from isotrain.checkpoint.layout import committed
from zygote import fork_ranks, run_isotrain, shared_zygote

WORKER = Path(__file__).with_name("signal_worker.py")
TIMEOUT_S = 20
HANG_AT = 5


def test_a_rank_that_hangs_is_named_and_the_others_stop_with_one_sentence(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv("ISOTRAIN_TEST_SIGNAL", "SIGSTOP")
    monkeypatch.setenv("ISOTRAIN_TEST_SIGNAL_STEP", str(HANG_AT))
    monkeypatch.setenv("ISOTRAIN_TEST_SIGNAL_RANKS", "1")
    args = ["train", *TINY_RUN, "train.deterministic=true", "parallel.dp_replicate=1", "parallel.dp_shard=2",
            "checkpoint.every_steps=2", "train.max_steps=8", f"parallel.timeout_s={TIMEOUT_S}",
            f"output_dir={run_dir}", f"data.cache_dir={tmp_path / 'cache'}"]
    logs = [tmp_path / f"rank{rank}.out" for rank in range(2)]
    errs = [tmp_path / f"rank{rank}.err" for rank in range(2)]
    forked = fork_ranks(shared_zygote(), 2, args, logs, errs=errs, script=WORKER)
    try:
        ready, _, _ = select.select([forked.pidfds[0]], [], [], HANG_S)
        assert ready, "rank 0 did not stop although its peer hangs"
        assert forked.running(), "rank 1 should still be stopped (SIGSTOP), not ended"
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):  # nothing is left behind, stopped or not
            try:
                signal.pidfd_send_signal(forked.pidfds[1], sig)
            except ProcessLookupError:
                pass
        forked.finish(HANG_S)
    out, err = logs[0].read_text(), errs[0].read_text()
    assert forked.exit_codes() == [2, None], out[-3000:] + err[-3000:]
    progress = run_dir / "progress" / "rank-00001.json"
    sentence = (f"error: step {HANG_AT}: rank 1 did not arrive at a collective within parallel.timeout_s={TIMEOUT_S} "
                f"s (its progress file {progress} last says step {HANG_AT - 1} done); committed checkpoints are "
                "intact; find out why that rank stopped (a hung process, a dead node or network link), or raise "
                "parallel.timeout_s if its work legitimately takes longer, then run again to resume")
    assert sentence in err, err[-3000:]
    assert err.count("error:") == 1
    assert "Traceback" not in out + err
    assert json.loads(progress.read_text())["step"] == HANG_AT - 1
    survivor = json.loads((run_dir / "progress" / "rank-00000.json").read_text())
    assert (survivor["step"], survivor["state"]) == (HANG_AT - 1, f"stopped in step {HANG_AT}: a collective timed out")
    checkpoints = [path for _, path in committed(run_dir / "checkpoints")]
    assert [path.name for path in checkpoints] == ["step-00000002", "step-00000004"]
    for path in checkpoints:
        verified = run_isotrain(["ckpt", "verify", str(path)])
        assert verified.returncode == 0, verified.stdout + verified.stderr
