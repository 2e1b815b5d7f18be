"""What pipeline parallelism composes with: the chunked cross-entropy on the last stage, LoRA adapters on every
stage, compiled decoder layers, each against one process (3 AdamW steps of a 4-layer Llama, test_equivalence.py's
data: variable lengths, padding, masked prompts, one packed sample).

One launch of 2 gloo processes (PP 2, 1F1B, 4 gradient-accumulation micro-batches; `_interleaved`: interleaved 1F1B,
4 one-layer stages, 2 per rank; `_zbv`, `_izb`: the zero-bubble ZBV and interleaved zero bubble, whose split backward
runs the chunks' recompute and the adapters' weight gradients in its second half) runs every case; the single process (one micro-batch of the global batch of 8) runs in
the test's own process. fp64: the loss of every step, every
first-step gradient and every trained weight after 3 steps within 1e-12; fp32: the losses and first-step gradients
within 1e-6 (measured as test_equivalence.py does: AdamW turns fp32 rounding of near-zero gradients into lr-sized
weight differences, an optimizer sensitivity, not a layout effect).

Compiled layers run with the `aot_eager` backend here: dynamo's capture of each stage's layers and AOT autograd's
backward through the schedule, without inductor's C++ code generation (about 100 s of CPU for the two ranks here,
beyond this file's share of the suite); inductor's own numerics on these layers are test_options.py's and
test_chunked_loss.py's compiled tests.

A `isotrain train` run with LoRA and the chunked loss on PP 2 (the default config's tied embeddings) logs one process's
losses and writes one process's checkpoint, whose adapter, exported, loads in peft on one process with its logits.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest
import torch

from helpers import TINY_RUN
from test_equivalence import RTOL, SCALE_FLOOR, max_rel_diff
from zygote import run_forked_ranks, run_isotrain

from isotrain.config import build_config
from isotrain.parallel.dims import ParallelDims
from isotrain.parallel.mesh import single_process

WORKER = str(Path(__file__).with_name("pipeline_features_worker.py"))
FP64_RTOL = 1e-12
CASES = ["chunk:float64", "chunk:float64:sequence", "chunk:float32", "chunk_moe:float64", "chunk_interleaved:float64",
         "chunk_zbv:float64", "lora:float64", "lora:float32", "lora_interleaved:float64", "lora_izb:float64",
         "compile:float64", "lora_head:float64"]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("pp-features") / "results.pt"
    proc = run_forked_ranks(2, [str(out), ",".join(CASES), "backend=aot_eager"], script=WORKER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out)


@functools.cache
def single(case: str, chunk_tokens: int | None = None) -> dict:
    """One process's run of `case` (the tests only read it)."""
    from pipeline_features_worker import run_case

    torch.use_deterministic_algorithms(True)
    try:
        return run_case(single_process(ParallelDims(1, 1, 1)), case, micro_batch=8, chunk_tokens=chunk_tokens)
    finally:
        torch.use_deterministic_algorithms(False)


def assert_matches(result: dict, reference: dict, dtype: str) -> None:
    assert result["grads"].keys() == reference["grads"].keys() == result["weights"].keys()
    if dtype == "float64":
        assert max_rel_diff(result, reference, keys=("grads", "weights")) <= FP64_RTOL
    else:
        assert max_rel_diff(result, reference, scale_floor=SCALE_FLOOR) <= RTOL


@pytest.mark.slow
@pytest.mark.parametrize("case", ["chunk:float64", "chunk:float64:sequence", "chunk:float32", "chunk_moe:float64",
                                  "chunk_interleaved:float64", "chunk_zbv:float64"])
def test_chunked_loss_on_the_last_stage_matches_one_process(pipeline, case):
    """The last stage computes each micro-batch's Σ w·ℓ in chunks of 7 trained tokens inside its forward (no whole
    logits); the same as one process without chunks, and in fp64 as one process with them. An MoE model's objective
    includes its router terms (each stage's, beside the chunked loss; the routing pre-pass forms no logits)."""
    name, dtype, *reduction = case.split(":")
    dense = name != "chunk_moe"
    assert_matches(pipeline[case], single(":".join(["plain" if dense else name, dtype, *reduction]), 0), dtype)
    if case == "chunk:float64":
        assert_matches(pipeline[case], single(case), dtype)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["lora:float64", "lora:float32", "lora_interleaved:float64", "lora_izb:float64"])
def test_lora_under_pp2_matches_one_process(pipeline, case):
    """Each stage's adapters start as one process's (added as part of the whole model), only they train, and the
    frozen weights stay those of one process."""
    result, reference = pipeline[case], single(re.sub(r"_(interleaved|zbv|izb):", ":", case), 0)
    assert_matches(result, reference, case.split(":")[1])
    assert result["weights"] and all(".lora_A." in name or ".lora_B." in name for name in result["weights"])
    assert result["frozen"].keys() == reference["frozen"].keys()
    assert all(torch.equal(result["frozen"][name], t) for name, t in reference["frozen"].items())


@pytest.mark.slow
def test_compiled_layers_under_pp2_match_one_process_eager(pipeline):
    assert_matches(pipeline["compile:float64"], single("plain:float64", 0), "float64")


@pytest.mark.slow
def test_the_chunked_loss_and_lora_beside_fsdp2_and_ddp_match_one_process(tmp_path):
    """4 processes: PP 2 × FSDP2 2 (the last stage's head gathered by FSDP2 inside its forward, where the chunks run)
    and PP 2 × DDP 2 with the chunked loss, PP 2 × DDP 2 with LoRA (each stage's adapters summed over its replicas)."""
    cases = ["chunk:float64@1x2x1", "chunk:float64@2x1x1", "lora:float64@2x1x1"]
    out = tmp_path / "results.pt"
    proc = run_forked_ranks(4, [str(out), ",".join(cases)], script=WORKER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = torch.load(out)
    for case in cases:
        name = case.partition(":")[0]
        assert_matches(results[case], single("plain:float64" if name == "chunk" else "lora:float64", 0), "float64")


@pytest.mark.slow
def test_a_stage_without_adapters_is_refused_on_every_rank(pipeline):
    """lora.target_modules=[lm_head] gives the first stage nothing to train: every rank refuses with one sentence."""
    assert pipeline["lora_head:float64"] == {
        "error": ["lora.target_modules=['lm_head'] leaves a pipeline stage without adapters (parallel.pp=2: each "
                  "stage trains its own); add a decoder layer's linear module, e.g. q_proj"] * 2}


def test_the_chunked_loss_lora_and_compile_are_built_with_pp():
    tree = {"model": {"config": {"model_type": "llama"}}, "data": {"path": "x.jsonl"}, "parallel": {"pp": 2},
            "train": {"loss_chunk_tokens": 64, "compile": True}, "lora": {"r": 4}}
    cfg = build_config(tree, "train")
    assert (cfg.train.loss_chunk_tokens, cfg.train.compile, cfg.lora.r, cfg.parallel.pp) == (64, True, 4, 2)


def test_estimate_memory_estimates_the_chunked_loss_beside_a_pipeline(capsys):
    """The CLI path only (tests/memory/test_estimate_pipeline_moe_chunked.py checks the bytes against live stages):
    the last stage's logits term is one chunk's, so it is smaller than with the whole logits."""
    from test_early_checks import cli

    def logits_mib(chunk: int) -> float:
        proc = cli(capsys, ["estimate-memory", "model.config.hidden_size=32", "model.config.num_hidden_layers=2",
                            "model.config.intermediate_size=64", "parallel.pp=2", "train.global_batch_size=8",
                            "train.micro_batch_size=2", f"train.loss_chunk_tokens={chunk}", "--world-size", "2"])
        assert proc.returncode == 0, proc.stderr
        row = next(line for line in proc.stdout.splitlines() if "logits and loss" in line)
        return float(row.split("\u2502")[3])  # the last stage's column

    assert 0 < logits_mib(16) < logits_mib(0)


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_a_pp2_lora_run_logs_saves_and_exports_what_one_process_does(tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    base = tmp_path / "base"
    proc = run_isotrain(["train", *TINY_RUN, "train.max_steps=1", f"output_dir={base}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    lora = [*TINY_RUN, "model.config=null", f"model.name_or_path={base / 'model'}", "lora.r=4", "lora.alpha=8",
            "train.lr=1e-2", "train.max_steps=3", "checkpoint.every_steps=3", "train.loss_chunk_tokens=16"]
    proc = run_isotrain(["train", *lora, f"output_dir={tmp_path / 'one'}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = run_forked_ranks(2, ["train", *lora, "parallel.pp=2", f"output_dir={tmp_path / 'pp'}"])
    assert proc.returncode == 0, proc.stderr[-3000:]

    def logged(run: str) -> list[float]:
        lines = (tmp_path / run / "metrics.jsonl").read_text().splitlines()
        return [row[key] for row in map(json.loads, lines) for key in ("loss", "grad_norm", "trained_tokens")]

    assert len(logged("pp")) == 9 and logged("pp") == pytest.approx(logged("one"), rel=1e-6)
    one, pp = (tmp_path / run / "checkpoints" / "step-00000003" for run in ("one", "pp"))
    for files in ("model*.safetensors", "train_state/optimizer*.safetensors"):  # (each stage writes a file)
        want, got = ({k: v for path in run.glob(files) for k, v in load_file(path).items()} for run in (one, pp))
        assert got.keys() == want.keys()  # one process's names: merged weights, `adapter.<peft name>`, moments
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, rtol=1e-5, atol=1e-7, msg=name)

    out = tmp_path / "adapter"
    proc = run_isotrain(["ckpt", "export", "--adapter", str(pp), str(out)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    ids = torch.tensor([[1, 5, 9, 12, 7, 3]])
    with torch.no_grad():
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base / "model"), out).eval()
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "one" / "model").eval()
        plain = AutoModelForCausalLM.from_pretrained(base / "model").eval()
        logits = adapted(input_ids=ids).logits
    assert torch.allclose(logits, merged(input_ids=ids).logits, atol=1e-5, rtol=0)
    assert not torch.allclose(logits, plain(input_ids=ids).logits, atol=1e-3)
