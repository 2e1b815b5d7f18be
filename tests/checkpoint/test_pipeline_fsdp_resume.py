"""Interleaved 1F1B beside FSDP2 end to end, through `isotrain train`: PP 2 × FSDP2 2 on 4 processes, 2 stages of one
decoder layer per rank, each stage an FSDP2 root of its own (parallel/apply.py `shard_stages`), its model built on
meta and its stage roots materialised and filled as every layout's (models/build.py), with the bundled recipe's tied
embeddings (a copy on stage 0 of rank 0 and on stage 3 of rank 1, the last stage's root holding both of the weight's
slots: the head's and the embedding module's, parallel/pp.py `stage_view`). It logs one process's metrics
(exact counts, loss and gradient norm to fp32 rounding), its checkpoint holds one process's tensors under the same
Hugging Face names and passes `ckpt verify`, and one process resumes from it and ends the run on one process's
weights. (The layout-free math in fp32 and fp64: tests/train/test_pipeline_fsdp.py.)
"""

from __future__ import annotations

import shutil

import pytest

from isotrain.checkpoint.layout import write_latest
from test_context_parallel_resume import assert_same_run, assert_same_weights, metrics
from zygote import run_forked_ranks


TINY = ["model.config.hidden_size=64", "model.config.intermediate_size=128", "model.config.num_hidden_layers=4",
        "model.config.num_key_value_heads=2", "train.global_batch_size=16",
        "train.micro_batch_size=4", "train.max_steps=4", "train.deterministic=true", "checkpoint.every_steps=2",
        "logging.progress=false"]
INTERLEAVED_FSDP2 = ["parallel.pp=2", "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2",
                     "parallel.dp_shard=-1", "parallel.dp_replicate=1"]  # 2 micro-batches per DP rank


def _from_step_2(source, run_dir):
    shutil.copytree(source, run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-00000004")
    shutil.rmtree(run_dir / "model")
    write_latest(run_dir / "checkpoints", "step-00000002")


def train(nproc: int, run_dir, *flags: str):
    proc = run_forked_ranks(nproc, ["train", *TINY, f"output_dir={run_dir}", *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.mark.slow
def test_interleaved_pp2_fsdp2_checkpoint_holds_one_process_weights_and_resumes_on_one_process(tmp_path):
    single, interleaved, resumed = tmp_path / "single", tmp_path / "interleaved", tmp_path / "resumed"
    train(1, single)
    proc = train(4, interleaved, *INTERLEAVED_FSDP2)
    assert "UserWarning" not in proc.stderr, proc.stderr[-2000:]
    assert_same_run(metrics(interleaved), metrics(single))
    for step in ("step-00000002", "step-00000004"):
        assert_same_weights(interleaved / "checkpoints" / step, single / "checkpoints" / step)
    verified = run_forked_ranks(1, ["ckpt", "verify", str(interleaved / "checkpoints" / "step-00000002")])
    assert verified.returncode == 0 and verified.stdout.startswith("valid: "), verified.stderr
    _from_step_2(interleaved, resumed)
    assert "resumed from" in train(1, resumed).stdout
    assert_same_run(metrics(resumed)[2:], metrics(single)[2:])
    assert_same_weights(resumed / "checkpoints" / "step-00000004", single / "checkpoints" / "step-00000004")
