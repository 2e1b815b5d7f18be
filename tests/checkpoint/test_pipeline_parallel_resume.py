"""Pipeline parallelism end to end, through `isotrain train`: a PP 2 run (1F1B, 4 micro-batches through 2 stages)
logs the metrics of one process (the same exact counts, the loss and gradient norm to fp32 rounding), its
checkpoints hold one process's tensors under the same Hugging Face names (each stage wrote its own), `ckpt verify`
passes and plain transformers loads them, and a run resumes across PP 2 <-> 1 process with the same data order.
The same for PP 2 × FSDP2 2 and PP 2 × TP 2 on 4 processes (each stage's tensors written from its two shards), and
their checkpoints resumed on 1 process, on PP 2 and on each other, and one process's and PP 2's on PP 2 × FSDP2 2.
An interleaved PP 2 checkpoint resumes on PP 4, whose two middle stages read no data.
"""

from __future__ import annotations

import json
import re

import pytest

from test_context_parallel_resume import _from_step_4, assert_same_run, assert_same_weights, metrics
from zygote import run_forked_ranks

TINY = [
    "model.config.hidden_size=64",
    "model.config.intermediate_size=128",
    "model.config.num_hidden_layers=2",
    "model.config.num_key_value_heads=2",
    "model.config.tie_word_embeddings=false",  # untied here; the bundled example ties them (the tied tests below)
    "train.global_batch_size=16",
    "train.micro_batch_size=4",
    "train.max_steps=8",
    "train.deterministic=true",
    "checkpoint.every_steps=4",
    "logging.progress=false",
]
PP2 = ["parallel.pp=2"]
PP2_FSDP2 = ["parallel.pp=2", "parallel.dp_shard=-1", "parallel.dp_replicate=1"]
PP2_TP2 = ["parallel.pp=2", "parallel.tp=2", "parallel.dp_replicate=1"]
LAYOUTS = {"single": (1, []), "pp2": (2, PP2), "pp2-fsdp2": (4, PP2_FSDP2), "pp2-tp2": (4, PP2_TP2)}


def train(nproc: int, run_dir, *more: str):
    proc = run_forked_ranks(nproc, ["train", *TINY, f"output_dir={run_dir}", *more])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """8 uninterrupted steps on one process and on PP 2, checkpoints at 4 and 8."""
    root = tmp_path_factory.mktemp("pp-runs")
    train(1, root / "single")
    proc = train(2, root / "pp2", *PP2)
    return root / "single", root / "pp2", proc


@pytest.mark.slow
def test_pp2_run_logs_the_metrics_and_saves_the_weights_of_one_process(runs):
    from transformers import AutoModelForCausalLM

    single, pp2, proc = runs
    assert re.search(r"│ pp +│ 2 +│", proc.stdout), proc.stdout[:2000]  # the start-up table of degrees and sizes
    assert_same_run(metrics(pp2), metrics(single))
    for step in ("step-00000004", "step-00000008"):
        assert_same_weights(pp2 / "checkpoints" / step, single / "checkpoints" / step)
        verified = run_forked_ranks(1, ["ckpt", "verify", str(pp2 / "checkpoints" / step)])
        assert verified.returncode == 0 and verified.stdout.startswith("valid: "), verified.stderr
    model = AutoModelForCausalLM.from_pretrained(pp2 / "checkpoints" / "step-00000008")
    names = {n for n, _ in model.named_parameters()}
    assert names >= {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
                     "model.layers.1.mlp.up_proj.weight", "lm_head.weight"}


@pytest.mark.slow
@pytest.mark.parametrize("saved_on, resumed_on", [("pp2", 1), ("single", 2)], ids=["pp2-to-1", "1-to-pp2"])
def test_resume_across_pp_continues_the_same_run(tmp_path, runs, saved_on, resumed_on):
    single, pp2, _ = runs
    run_dir = tmp_path / "resumed"
    _from_step_4(pp2 if saved_on == "pp2" else single, run_dir)
    proc = train(resumed_on, run_dir, *(PP2 if resumed_on == 2 else []))
    assert "resumed from" in proc.stdout
    assert_same_run(metrics(run_dir)[4:], metrics(single)[4:])
    assert_same_weights(run_dir / "checkpoints" / "step-00000008", single / "checkpoints" / "step-00000008")


@pytest.fixture(scope="module")
def runs_on(tmp_path_factory):
    """runs_on(layout): 8 uninterrupted steps on PP 2 × FSDP2 2 (2 micro-batches per DP rank) or PP 2 × TP 2 (4
    processes each), checkpoints at 4 and 8, run once per module: (run directory, process)."""
    done = {}

    def run(layout: str):
        if layout not in done:
            run_dir = tmp_path_factory.mktemp(layout) / layout
            nproc, flags = LAYOUTS[layout]
            done[layout] = run_dir, train(nproc, run_dir, *flags)
        return done[layout]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("layout, dp_size", [("pp2-fsdp2", 2), ("pp2-tp2", 1)])
def test_pp2_with_fsdp2_or_tp2_logs_the_metrics_and_saves_the_weights_of_one_process(runs, runs_on, layout, dp_size):
    single, _, _ = runs
    run_dir, proc = runs_on(layout)
    assert re.search(r"│ pp +│ 2 +│", proc.stdout) and re.search(rf"│ dp_size +│ {dp_size} +│", proc.stdout), \
        proc.stdout[:2000]
    assert "UserWarning" not in proc.stderr, proc.stderr[-2000:]
    assert_same_run(metrics(run_dir), metrics(single))
    for step in ("step-00000004", "step-00000008"):
        assert_same_weights(run_dir / "checkpoints" / step, single / "checkpoints" / step)
        verified = run_forked_ranks(1, ["ckpt", "verify", str(run_dir / "checkpoints" / step)])
        assert verified.returncode == 0 and verified.stdout.startswith("valid: "), verified.stderr


@pytest.mark.slow
@pytest.mark.parametrize("saved_on, resumed_on", [("pp2-fsdp2", "single"), ("pp2-fsdp2", "pp2"),
                                                  ("pp2", "pp2-fsdp2"), ("single", "pp2-fsdp2"),
                                                  ("pp2-tp2", "single"), ("pp2-fsdp2", "pp2-tp2")])
def test_resume_across_pp_fsdp_and_tp_continues_the_same_run(tmp_path, runs, runs_on, saved_on, resumed_on):
    single, pp2, _ = runs
    sources = {"single": single, "pp2": pp2}
    source = sources[saved_on] if saved_on in sources else runs_on(saved_on)[0]
    run_dir = tmp_path / "resumed"
    _from_step_4(source, run_dir)
    nproc, flags = LAYOUTS[resumed_on]
    proc = train(nproc, run_dir, *flags)
    assert "resumed from" in proc.stdout
    assert_same_run(metrics(run_dir)[4:], metrics(single)[4:])
    assert_same_weights(run_dir / "checkpoints" / "step-00000008", single / "checkpoints" / "step-00000008")


TIED = [arg for arg in TINY if not arg.startswith("model.config.tie_word_embeddings")]  # the bundled recipe ties them


@pytest.fixture(scope="module")
def tied_runs(tmp_path_factory):
    """The bundled recipe's tied embeddings: 8 steps on one process, on PP 2 and on PP 2 × FSDP2 2."""
    root = tmp_path_factory.mktemp("pp-tied-runs")
    runs = {}
    for layout in ("single", "pp2", "pp2-fsdp2"):
        nproc, flags = LAYOUTS[layout]
        proc = run_forked_ranks(nproc, ["train", *TIED, f"output_dir={root / layout}", *flags])
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[layout] = root / layout
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2", "pp2-fsdp2"])
def test_tied_pp2_run_saves_the_weight_once_and_matches_one_process(tied_runs, layout):
    """Each end stage holds a copy of the tied weight; the checkpoint holds it once, under the input embedding's name
    as one process saves it, and transformers loads it tied."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    single, run_dir = tied_runs["single"], tied_runs[layout]
    assert_same_run(metrics(run_dir), metrics(single))
    for step in ("step-00000004", "step-00000008"):
        checkpoint = run_dir / "checkpoints" / step
        assert_same_weights(checkpoint, single / "checkpoints" / step)
        keys = [key for path in checkpoint.glob("*.safetensors") for key in safe_open(path, "pt").keys()]
        assert "model.embed_tokens.weight" in keys and "lm_head.weight" not in keys and len(keys) == len(set(keys))
        verified = run_forked_ranks(1, ["ckpt", "verify", str(checkpoint)])
        assert verified.returncode == 0 and verified.stdout.startswith("valid: "), verified.stderr
    model = AutoModelForCausalLM.from_pretrained(run_dir / "checkpoints" / "step-00000008")
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.slow
@pytest.mark.parametrize("saved_on, resumed_on", [("pp2", "single"), ("single", "pp2"), ("pp2-fsdp2", "pp2"),
                                                  ("pp2", "pp2-fsdp2")])
def test_tied_resume_across_pp_continues_the_same_run(tmp_path, tied_runs, saved_on, resumed_on):
    """A tied checkpoint loads into both copies of a PP run and into the one weight of one process."""
    run_dir = tmp_path / "resumed"
    _from_step_4(tied_runs[saved_on], run_dir)
    nproc, flags = LAYOUTS[resumed_on]
    proc = run_forked_ranks(nproc, ["train", *TIED, f"output_dir={run_dir}", *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout
    single = tied_runs["single"]
    assert_same_run(metrics(run_dir)[4:], metrics(single)[4:])
    assert_same_weights(run_dir / "checkpoints" / "step-00000008", single / "checkpoints" / "step-00000008")


FOUR_LAYERS = [*TIED, "model.config.num_hidden_layers=4"]
INTERLEAVED = ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"]


@pytest.fixture(scope="module")
def four_layer_runs(tmp_path_factory):
    """8 steps of the bundled (tied) recipe with 4 decoder layers on one process and on interleaved 1F1B (4 stages
    of one layer, 2 per rank): (single run directory, interleaved run directory)."""
    root = tmp_path_factory.mktemp("pp-four-layers")
    for name, nproc, flags in (("single", 1, []), ("interleaved", 2, INTERLEAVED)):
        proc = run_forked_ranks(nproc, ["train", *FOUR_LAYERS, f"output_dir={root / name}", *flags])
        assert proc.returncode == 0, proc.stderr[-3000:]
    return root / "single", root / "interleaved"


@pytest.mark.slow
def test_interleaved_pp2_run_matches_one_process_and_resumes_on_it(tmp_path, four_layer_runs):
    """isotrain train with interleaved 1F1B (4 stages of one layer, 2 per rank; the recipe's tied embeddings) logs one
    process's metrics and saves its weights, and its checkpoint resumes on one process and continues the same run."""
    single, interleaved = four_layer_runs
    assert_same_run(metrics(interleaved), metrics(single))
    for step in ("step-00000004", "step-00000008"):
        assert_same_weights(interleaved / "checkpoints" / step, single / "checkpoints" / step)
    run_dir = tmp_path / "resumed"
    _from_step_4(interleaved, run_dir)
    proc = run_forked_ranks(1, ["train", *FOUR_LAYERS, f"output_dir={run_dir}"])
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    assert_same_run(metrics(run_dir)[4:], metrics(single)[4:])
    assert_same_weights(run_dir / "checkpoints" / "step-00000008", single / "checkpoints" / "step-00000008")


@pytest.mark.slow
def test_interleaved_checkpoint_resumes_on_pp4_whose_middle_stages_read_nothing(tmp_path, four_layer_runs):
    """Another PP degree: the interleaved PP 2 checkpoint of step 4 resumes on PP 4 (1F1B, one layer per stage) and
    continues with one process's next samples (its metrics, exact counts included, and weights). With
    data.log_samples, the ranks of the first and the last stage log the same 16 samples of each step, and the two
    middle ranks, which read none (train/stage_data.py), log nothing."""
    single, interleaved = four_layer_runs
    run_dir = tmp_path / "pp4"
    _from_step_4(interleaved, run_dir)
    proc = run_forked_ranks(4, ["train", *FOUR_LAYERS, f"output_dir={run_dir}", "parallel.pp=4",
                                "data.log_samples=true"])
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    assert_same_run(metrics(run_dir)[4:], metrics(single)[4:])
    assert_same_weights(run_dir / "checkpoints" / "step-00000008", single / "checkpoints" / "step-00000008")
    lines = [(run_dir / "samples" / f"rank-{rank:05d}.jsonl").read_text().splitlines() for rank in range(4)]
    assert lines[1] == lines[2] == [] and lines[0] == lines[3]
    assert [(row["step"], len(row["samples"])) for row in map(json.loads, lines[0])] == [(s, 16) for s in (5, 6, 7, 8)]


@pytest.mark.slow
def test_interleaved_checkpoint_resumes_on_an_uneven_split(tmp_path, four_layer_runs):
    """parallel.pp_split=[3,1]: the interleaved PP 2 checkpoint of step 4 loads into stages of 3 and 1 decoder layers
    (each rank reading its own layers' tensors by name), continues one process's run, and the uneven stages' step-8
    checkpoint holds one process's weights under the same names."""
    single, interleaved = four_layer_runs
    run_dir = tmp_path / "split"
    _from_step_4(interleaved, run_dir)
    proc = run_forked_ranks(2, ["train", *FOUR_LAYERS, f"output_dir={run_dir}", "parallel.pp=2",
                                "parallel.pp_split=[3,1]"])
    assert proc.returncode == 0 and "resumed from" in proc.stdout, proc.stderr[-3000:]
    assert_same_run(metrics(run_dir)[4:], metrics(single)[4:])
    assert_same_weights(run_dir / "checkpoints" / "step-00000008", single / "checkpoints" / "step-00000008")
