"""Context parallelism end to end, through `isotrain train`, Ulysses and ring attention: a CP 2 run logs the metrics
of one process (the same exact counts, the loss and gradient norm to fp32 rounding), its checkpoints hold the one
process's weights, and a run resumes across CP 2 <-> 1 process with the same data order.

Packed rows (data.packing=true) of the bundled addition example: the packing probe runs on whole rows, every step's
documents are cut by the CP pieces (contiguous for Ulysses, zig-zag for ring) and masked per document over the
whole rows (parallel/cp.py). The same packed single-process run resumes on pipeline parallelism (PP 2): the
packing probe runs through the two stages and the run continues with one process's metrics and weights.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest

from helpers import model_weights
from zygote import run_forked_ranks
from isotrain.checkpoint.layout import write_latest

TINY = [
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.num_hidden_layers=2",
    "model.config.num_key_value_heads=2",
    "data.packing=true",
    "train.global_batch_size=16",
    "train.micro_batch_size=4",
    "train.max_steps=8",
    "train.deterministic=true",
    "checkpoint.every_steps=4",
    "logging.progress=false",
]
CP2 = ["parallel.cp=2", "parallel.dp_replicate=1"]
STYLES = ("ulysses", "ring")


def cp2(style: str) -> list[str]:
    return [*CP2, f"parallel.cp_style={style}"]
EXACT = ("tokens_seen", "trained_tokens", "samples_seen", "lr")


def train(nproc: int, run_dir, *more: str):
    proc = run_forked_ranks(nproc, ["train", *TINY, f"output_dir={run_dir}", *more])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def metrics(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(got: list[dict], expected: list[dict]) -> None:
    assert [r["step"] for r in got] == [r["step"] for r in expected]
    for a, b in zip(expected, got):
        assert [b.get(k) for k in EXACT] == [a.get(k) for k in EXACT], b["step"]
        for key in ("loss", "grad_norm", "eval_loss"):
            if key in a:
                assert b[key] == pytest.approx(a[key], rel=1e-5), (key, b["step"])


# fp32 weights after 4-8 AdamW steps from a start that differs in the last bits of the gradients (CP sums each
# gradient over two ranks in another order): AdamW's first updates are about lr·sign(g), so rounding moves a weight
# by ~1e-7 (measured: 1.1e-6 of down_proj's largest entry after 4 steps). The layout-free math itself is proven
# in fp64 by tests/train/test_context_parallel.py at 1e-6; here the files and the resume are checked.
WEIGHT_RTOL = 1e-5


def assert_same_weights(got_dir, expected_dir) -> None:
    expected, got = model_weights(expected_dir), model_weights(got_dir)
    assert expected.keys() == got.keys()
    for name in expected:
        scale = expected[name].abs().max().clamp_min(1e-12)
        assert ((got[name] - expected[name]).abs().max() / scale) <= WEIGHT_RTOL, name


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """8 uninterrupted steps on one process and on CP 2 of each style, checkpoints at 4 and 8:
    (single run dir, {style: (run dir, process)})."""
    root = tmp_path_factory.mktemp("cp-runs")
    train(1, root / "single")
    return root / "single", {style: (root / style, train(2, root / style, *cp2(style))) for style in STYLES}


def _from_step_4(source, run_dir):
    shutil.copytree(source, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000008")
    shutil.rmtree(run_dir / "model")
    write_latest(run_dir / "checkpoints", "step-00000004")


@pytest.mark.slow
@pytest.mark.parametrize("style", STYLES)
def test_cp2_run_logs_the_metrics_and_saves_the_weights_of_one_process(runs, style):
    single, styles = runs
    cp2, proc = styles[style]
    assert re.search(r"│ cp +│ 2 +│", proc.stdout), proc.stdout[:2000]  # the start-up table of degrees and sizes
    assert_same_run(metrics(cp2), metrics(single))
    for step in ("step-00000004", "step-00000008"):
        assert_same_weights(cp2 / "checkpoints" / step, single / "checkpoints" / step)


@pytest.mark.slow
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("saved_on, resumed_on", [("cp2", 1), ("single", 2)], ids=["cp2-to-1", "1-to-cp2"])
def test_resume_across_cp_continues_the_same_run(tmp_path, runs, saved_on, resumed_on, style):
    single, styles = runs
    run_dir = tmp_path / "resumed"
    _from_step_4(styles[style][0] if saved_on == "cp2" else single, run_dir)
    proc = train(resumed_on, run_dir, *(cp2(style) if resumed_on == 2 else []))
    assert "resumed from" in proc.stdout
    assert_same_run(metrics(run_dir)[4:], metrics(single)[4:])
    assert_same_weights(run_dir / "checkpoints" / "step-00000008", single / "checkpoints" / "step-00000008")


@pytest.mark.slow
def test_tp2_x_ring_cp2_run_logs_the_metrics_and_saves_the_weights_of_one_process(tmp_path, runs):
    """4 ranks, TP 2 × ring CP 2: each TP rank's heads attend around the CP ring (the vocabulary-parallel loss on
    each piece); the same metrics rows and checkpoint weights as one process."""
    single, _ = runs
    train(4, tmp_path / "tp2-cp2", *cp2("ring"), "parallel.tp=2")
    assert_same_run(metrics(tmp_path / "tp2-cp2"), metrics(single))
    for step in ("step-00000004", "step-00000008"):
        assert_same_weights(tmp_path / "tp2-cp2" / "checkpoints" / step, single / "checkpoints" / step)


@pytest.mark.slow
def test_packed_run_resumes_on_pp2_and_continues_the_same_run(tmp_path, runs):
    """data.packing under parallel.pp=2 (1F1B) through `isotrain train`: the probe, run through the stages, finds the
    documents kept apart by their position ids, and steps 5-8 log one process's metrics and end on its weights."""
    single, _ = runs
    run_dir = tmp_path / "pp2"
    _from_step_4(single, run_dir)
    proc = train(2, run_dir, "parallel.pp=2")
    assert "resumed from" in proc.stdout
    assert "packing: LlamaForCausalLM keeps packed documents apart by their position ids" in proc.stdout
    assert_same_run(metrics(run_dir)[4:], metrics(single)[4:])
    assert_same_weights(run_dir / "checkpoints" / "step-00000008", single / "checkpoints" / "step-00000008")
