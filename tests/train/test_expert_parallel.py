"""Expert parallelism (parallel.ep) against one process: loss, every gradient (router and experts included),
the gradient norm and the weights after 3 AdamW steps, on tiny MoE models (4 experts, top-2).

EP groups are carved out of the data-parallel ranks: (dp_replicate, dp_shard, tp, ep)
    2x1x1x2  EP 2 over 2 DDP ranks (each rank holds 2 experts; dense parameters by DDP)
    1x2x1x2  EP 2 with FSDP2 2 (dense sharded, experts EP-sharded over the same ranks)
    4x1x1x4  EP 4 (one expert per rank)
    2x2x1x2  HSDP 2 × 2 with EP 2 (experts on two copies: their gradients summed over them)
    1x4x1x2  FSDP2 4 with EP 2 (experts on two copies, dense sharded 4 ways)
The comparison is the equivalence machinery's (test_equivalence.py): fp32 within 1e-6 relative, fp64 weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from helpers import COUNTED
from zygote import run_forked_ranks
from test_equivalence import FP32, FP64, RTOL, _multi, _single, assert_equivalent

EP2_LAYOUTS = [(2, 1, 1, 2), (1, 2, 1, 2)]
EP4_LAYOUTS = [(4, 1, 1, 4), (2, 2, 1, 2), (1, 4, 1, 2)]
MOE_FAMILIES = ["qwen3_moe", "mixtral"]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe-ref")
    return {family: _single(path, micro_batch=8, family=family) for family in MOE_FAMILIES}


def assert_ep_equivalent(result: dict, reference: dict, ep: int) -> None:
    assert_equivalent(result, reference)
    for reduction in ("token", "sequence"):
        # Clipping (grad_clip=1) uses the norm: each expert element must be counted once, not once per rank.
        # fp32: the first step's (later steps inherit AdamW's fp32 sensitivity, see test_equivalence); fp64: all.
        for dtype, steps in ((FP32, 1), (FP64, None)):
            got, want = result[(reduction, dtype)]["norms"][:steps], reference[(reduction, dtype)]["norms"][:steps]
            assert all(abs(a - b) <= RTOL * b for a, b in zip(got, want, strict=True)), (reduction, dtype, got, want)
        rows = result[(reduction, FP32)]["local_expert_rows"]
        assert rows and set(rows.values()) == {4 // ep}  # each rank materialised only its own experts


@pytest.mark.slow
def test_expert_parallel_2_matches_one_process(tmp_path, references):
    """EP 2 over DDP and under FSDP2, on Qwen3-MoE and Mixtral, in one launch of 2 processes."""
    results = _multi(tmp_path, 2, EP2_LAYOUTS, 2, "families=" + ",".join(MOE_FAMILIES))
    for family in MOE_FAMILIES:
        for layout in EP2_LAYOUTS:
            assert_ep_equivalent(results[(family, layout)], references[family], layout[3])


@pytest.mark.slow
def test_expert_parallel_4_and_ep_replicas_match_one_process(tmp_path, references):
    """EP 4; EP 2 under HSDP and under FSDP2 4, where two ranks hold the same experts and sum their gradients."""
    results = _multi(tmp_path, 4, EP4_LAYOUTS, 2, "families=qwen3_moe")
    for layout in EP4_LAYOUTS:
        assert_ep_equivalent(results[("qwen3_moe", layout)], references["qwen3_moe"], layout[3])


# A tiny Qwen3-MoE through the whole training path: meta build, fresh init, train loop, checkpoints.
TINY_MOE_RUN = [
    "model.config.model_type=qwen3_moe", "model.config.num_experts=4", "model.config.num_experts_per_tok=2",
    "model.config.moe_intermediate_size=32", "model.config.hidden_size=32", "model.config.intermediate_size=64",
    "model.config.num_hidden_layers=2", "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2",
    "model.config.head_dim=8", "train.global_batch_size=8", "train.micro_batch_size=2", "logging.progress=false",
    "eval.path=null", "checkpoint.every_steps=3",
]


def _metrics(run_dir) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{key: row[key] for key in COUNTED} for row in rows]


def _assert_close(rows: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in rows] == [r["step"] for r in reference]
    for row, ref in zip(rows, reference):
        for key in COUNTED:
            if isinstance(ref[key], float):
                assert math.isclose(row[key], ref[key], rel_tol=RTOL), (row["step"], key, row[key], ref[key])
            else:
                assert row[key] == ref[key], (row["step"], key)


MOE = ["model.config.model_type=qwen3_moe", "model.config.num_experts=4", "train.micro_batch_size=8"]


@pytest.mark.parametrize("argv,sentence", [
    (["parallel.ep=2", *MOE, "--world-size", "3"],
     "parallel.ep=2 does not divide the data-parallel size dp_replicate × dp_shard = 3 × 1 = 3, out of which the "
     "expert-parallel groups are carved; use a parallel.ep that divides 3, or launch a multiple of 2 data-parallel "
     "ranks"),
    (["parallel.ep=4", "model.config.model_type=qwen3_moe", "model.config.num_experts=6", "train.micro_batch_size=8",
      "--world-size", "4"],
     "parallel.ep=4 does not divide the model's 6 experts; use a parallel.ep that divides 6 (and the data-parallel "
     "size)"),
    (["parallel.ep=2", "train.micro_batch_size=8", "--world-size", "2"],
     "parallel.ep=2 splits a mixture-of-experts model's experts, but model type 'llama' is dense (its config has no "
     "num_experts or num_local_experts); set parallel.ep=1"),
    (["parallel.ep=2", "parallel.tp=3", "parallel.dp_replicate=2", *MOE, "model.config.num_attention_heads=4",
      "model.config.num_key_value_heads=2", "--world-size", "6"],
     "parallel.tp=3 does not divide the model's attention heads (num_attention_heads=4); use a parallel.tp that "
     "divides 4, or a model with num_attention_heads a multiple of 3"),
], ids=["ep-not-dividing-dp", "ep-not-dividing-experts", "dense-model", "tp-not-dividing-moe-heads"])
def test_bad_expert_parallel_settings_get_one_sentence(capsys, argv, sentence):
    from test_cli_errors import assert_error_sentence
    from test_early_checks import cli

    assert_error_sentence(cli(capsys, ["config", "show", *argv]), sentence)


def test_config_show_lists_the_ep_degree(capsys):
    from test_early_checks import cli

    proc = cli(capsys, ["config", "show", "parallel.ep=2", *MOE, "--world-size", "2"])
    assert proc.returncode == 0, proc.stderr
    assert "# ep: 2" in proc.stdout.splitlines()


def test_expert_parallel_composes_with_tensor_parallel(capsys):
    """EP 2 × TP 2 on 4 processes is accepted; TP does not split a MoE model's experts, so their width need not
    divide by tp (a Mixtral whose intermediate_size is odd), while a dense MLP layer's must."""
    from test_early_checks import cli

    proc = cli(capsys, ["config", "show", "parallel.ep=2", "parallel.tp=2", "parallel.dp_replicate=2", *MOE,
                        "--world-size", "4"])
    assert proc.returncode == 0, proc.stderr
    assert {"# tp: 2", "# ep: 2"} <= set(proc.stdout.splitlines())
    from transformers import AutoConfig

    from isotrain.errors import ConfigError
    from isotrain.parallel.dims import ParallelDims, check_model_fits

    check_model_fits(ParallelDims(1, 1, 2), AutoConfig.for_model("mixtral", num_local_experts=4, intermediate_size=63))
    dense_layer = AutoConfig.for_model("qwen3_moe", num_experts=4, intermediate_size=63, mlp_only_layers=[1])
    with pytest.raises(ConfigError, match=r"MLP width \(intermediate_size=63\)"):
        check_model_fits(ParallelDims(1, 1, 2), dense_layer)


def test_the_builder_refuses_ep_on_a_dense_model():
    """The same check guards `build` (RL, benchmarks) when no `config show` ran first."""
    from transformers import AutoConfig

    from isotrain.errors import ConfigError
    from isotrain.parallel.dims import ParallelDims, check_model_fits

    dense = AutoConfig.for_model("llama", hidden_size=32, num_attention_heads=4)
    with pytest.raises(ConfigError, match="model type 'llama' is dense"):
        check_model_fits(ParallelDims(2, 1, 1, ep=2), dense)
    mixtral = AutoConfig.for_model("mixtral", num_local_experts=6)
    with pytest.raises(ConfigError, match="does not divide the model's 6 experts"):
        check_model_fits(ParallelDims(4, 1, 1, ep=4), mixtral)
    check_model_fits(ParallelDims(2, 1, 1, ep=2), mixtral)


@pytest.mark.slow
def test_bf16_under_fsdp2_casts_the_experts_too(tmp_path):
    """FSDP2 casts the parameters it manages to bf16 and leaves the experts out: the expert-parallel forward
    casts them itself (without that, the first matmul fails on mixed dtypes). Same losses as FSDP2 alone, to
    bf16 rounding."""
    train = ["train", *TINY_MOE_RUN, "model.dtype=bfloat16", "train.max_steps=2",
             "parallel.dp_shard=2", "parallel.dp_replicate=1"]
    runs = {}
    for name, extra in (("fsdp2", []), ("fsdp2_ep2", ["parallel.ep=2"])):
        proc = run_forked_ranks(2, [*train, *extra, f"output_dir={tmp_path / name}"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = _metrics(tmp_path / name)
    for row, ref in zip(runs["fsdp2_ep2"], runs["fsdp2"], strict=True):
        assert math.isclose(row["loss"], ref["loss"], rel_tol=1e-3), (row, ref)


@pytest.mark.slow
def test_dispatch_matches_transformers_experts_under_skewed_routing(tmp_path):
    """One MoE layer on 2 ranks (two experts each) against transformers' experts forward on all tokens, in fp64:
    random routing, every token routed to experts 0 and 1 (rank 0 receives every row, rank 1 none: its
    experts get zero gradients), and ranks with different token counts. Outputs, input and routing-weight
    gradients, expert gradients."""
    out = tmp_path / "dispatch.json"
    proc = run_forked_ranks(2, [str(out)], script=str(Path(__file__).with_name("ep_dispatch_worker.py")))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in json.loads(out.read_text()):
        for scenario in ("random", "skewed", "uneven"):
            assert rank[scenario] <= 1e-12, (scenario, rank)
            assert rank[f"{scenario}_local_experts"] == 2
