"""The schedule of asynchronous RL (rl/ahead.py) on its own: which policy version generates which step's rollout,
when the engine's weights change, what a checkpoint holds in flight, and how a failure on the worker reaches the
trainer. The rollouts are stand-ins recording what the engine held when they were generated; the engine, the
exchange between ranks and the losses are tested end to end in test_async_rl.py."""

from __future__ import annotations

import threading

import pytest

from isotrain.rl.ahead import Generated, RolloutsAhead
from isotrain.rl.experience import RolloutBatch
from isotrain.rl.generate import RoundStats


class Engine:
    """What the trainer's `sync` and the worker's `collect` see: the version the engine holds, and a log of both."""

    def __init__(self, rounds_of=lambda first_round: 1):
        self.version = None
        self.trainer_version = 0
        self.log: list[tuple] = []
        self.rounds_of = rounds_of
        self.threads: set[str] = set()

    def sync(self) -> None:
        self.version = self.trainer_version
        self.log.append(("sync", self.version))

    def collect(self, first_round: int) -> tuple[RolloutBatch, RoundStats]:
        self.threads.add(threading.current_thread().name)
        self.log.append(("generate", first_round, self.version))
        rounds = self.rounds_of(first_round)
        # one sample whose score records the version that generated it, and its first round
        batch = RolloutBatch([first_round], [[1]], [[2, 3]], [[-0.5, -0.25]], [False], [float(self.version)],
                             [float(first_round)])
        return batch, RoundStats(rounds=rounds, num_scored=1)


def train(ahead: RolloutsAhead, engine: Engine, steps: range) -> list[Generated]:
    """The trainer's side of the loop: each step takes its rollout, then its update makes version step + 1."""
    taken = []
    for step in steps:
        generated, _, _ = ahead.rollout(step, engine.sync)
        taken.append(generated)
        engine.trainer_version = step + 1
    return taken


@pytest.mark.parametrize("k", [1, 2, 3])
def test_the_rollout_of_step_s_is_generated_by_version_max_s_minus_k(k):
    engine = Engine()
    engine.sync()
    ahead = RolloutsAhead(engine.collect, k, last_step=9)
    ahead.start(0, 0, engine_version=0, restored=[])
    taken = train(ahead, engine, range(10))
    assert [g.step for g in taken] == list(range(10))
    assert [g.version for g in taken] == [max(s - k, 0) for s in range(10)]
    # what the engine really held when it generated, not only what was recorded
    assert [int(g.batch.scores[0]) for g in taken] == [g.version for g in taken]
    assert [g.first_round for g in taken] == list(range(10))
    assert engine.threads == {"isotrain-rollout-ahead"}  # generated on the worker, never on the trainer's thread
    # the weights change only between rollouts: version v is sent once, before the first rollout it generates
    syncs = [entry[1] for entry in engine.log if entry[0] == "sync"]
    assert syncs == list(range(10 - k))


def test_version_zero_generates_the_first_k_plus_one_rollouts_and_none_is_past_the_last_step():
    engine = Engine()
    engine.sync()
    ahead = RolloutsAhead(engine.collect, 2, last_step=4)
    ahead.start(0, 0, engine_version=0, restored=[])
    train(ahead, engine, range(5))
    generated = [entry for entry in engine.log if entry[0] == "generate"]
    assert [(r, v) for _, r, v in generated] == [(0, 0), (1, 0), (2, 0), (3, 1), (4, 2)]


def test_dynamic_sampling_rounds_number_the_next_rollouts():
    # a rollout may use several generation rounds (DAPO): the next one starts after them, as in the synchronous loop
    engine = Engine(rounds_of=lambda first_round: 1 + first_round % 3)
    engine.sync()
    ahead = RolloutsAhead(engine.collect, 1, last_step=5)
    ahead.start(0, 0, engine_version=0, restored=[])
    taken = train(ahead, engine, range(6))
    expected, first = [], 0
    for _ in range(6):
        expected.append(first)
        first += 1 + first % 3
    assert [g.first_round for g in taken] == expected


@pytest.mark.parametrize("stop_after", [1, 3, 4])
def test_a_resume_from_the_rollouts_in_flight_continues_as_the_uninterrupted_schedule(stop_after):
    k, last = 2, 7
    straight_engine = Engine(rounds_of=lambda first_round: 1 + first_round % 2)
    straight_engine.sync()
    straight = RolloutsAhead(straight_engine.collect, k, last_step=last)
    straight.start(0, 0, engine_version=0, restored=[])
    expected = train(straight, straight_engine, range(last + 1))

    # the first run, saved after `stop_after` steps: its rollouts in flight go through the checkpoint's JSON
    engine = Engine(rounds_of=straight_engine.rounds_of)
    engine.sync()
    first = RolloutsAhead(engine.collect, k, last_step=last)
    first.start(0, 0, engine_version=0, restored=[])
    taken = train(first, engine, range(stop_after))
    saved = first.in_flight_json()
    rounds_trained = sum(g.stats.rounds for g in taken)

    import json

    restored = [Generated.from_json(item) for item in json.loads(saved)["rollouts"]]
    assert [g.step for g in restored] == list(range(stop_after, stop_after + k))
    resumed_engine = Engine(rounds_of=engine.rounds_of)
    resumed_engine.trainer_version = stop_after
    resumed_engine.sync()  # a resume sends the checkpoint's weights first
    resumed = RolloutsAhead(resumed_engine.collect, k, last_step=last)
    resumed.start(stop_after, rounds_trained, engine_version=stop_after, restored=restored)
    taken += train(resumed, resumed_engine, range(stop_after, last + 1))
    assert [g.to_json() | {"generate_s": 0} for g in taken] == [g.to_json() | {"generate_s": 0} for g in expected]


def test_holding_a_version_for_evaluation_waits_for_the_worker_and_then_syncs_once():
    engine = Engine()
    engine.sync()
    ahead = RolloutsAhead(engine.collect, 1, last_step=5)
    ahead.start(0, 0, engine_version=0, restored=[])
    train(ahead, engine, range(2))  # rollout 2 (version 1) is queued
    ahead.hold_version(2, engine.sync)  # the held-out score after 2 steps
    assert engine.log[-2:] == [("generate", 2, 1), ("sync", 2)]
    ahead.hold_version(2, engine.sync)
    assert engine.log[-1] == ("sync", 2)  # held already: no second sync
    generated, _, sync_s = ahead.rollout(2, engine.sync)
    assert generated.version == 1 and sync_s == 0.0


def test_a_failed_rollout_is_raised_in_the_trainer_and_no_later_rollout_is_generated():
    engine = Engine()
    calls = []

    def collect(first_round):
        calls.append(first_round)
        if first_round == 2:
            raise RuntimeError("rollout engine process (pid 1) is dead")
        return engine.collect(first_round)

    engine.sync()
    ahead = RolloutsAhead(collect, 1, last_step=9)
    ahead.start(0, 0, engine_version=0, restored=[])
    train(ahead, engine, range(2))  # rollout 2 was queued at step 1, and failed while step 1 trained
    with pytest.raises(RuntimeError, match="is dead"):
        ahead.rollout(2, engine.sync)
    with pytest.raises(RuntimeError, match="is dead"):
        ahead.drain()
    assert calls == [0, 1, 2]
    ahead.close()


def test_a_rollout_older_than_the_bound_is_never_trained_on():
    engine = Engine()
    engine.sync()
    stale = Generated(3, 0, 3, *engine.collect(3), 0.0)  # version 0 for step 3: 3 versions old
    ahead = RolloutsAhead(engine.collect, 1, last_step=5)
    ahead.start(3, 3, engine_version=3, restored=[stale])
    with pytest.raises(RuntimeError, match="generated by policy version 0, outside rl.max_off_policy_steps=1"):
        ahead.rollout(3, engine.sync)
