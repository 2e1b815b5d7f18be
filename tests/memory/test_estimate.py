"""The memory estimate agrees with what real runs hold, term by term, on every layout (real processes, gloo).

Model states must match to the byte; activations, autocast's compute copies, the logits/loss tensors and FSDP2's
all-gather and reduce-scatter buffers within 5 % (they match exactly here too: the estimate runs the same forward
on fake tensors, and follows FSDP2's own order of gathering, reducing and freeing).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import run_concurrently
from zygote import run_forked_ranks, run_isotrain

WORKER = str(Path(__file__).with_name("memory_worker.py"))
EXACT = ("parameters", "gradients", "optimizer moments")
# Every other measured term (activations, compute copies, logits and loss, FSDP2 buffers, MoE router terms):
# within 5 %.
FSDP_TERMS = {"FSDP2 all-gather buffers", "FSDP2 reduce-scatter buffers"}


def _measure(tmp_path, nproc: int, *layouts: str) -> list[dict]:
    out = tmp_path / f"{'_'.join(layouts)}.json"
    proc = run_forked_ranks(nproc, [str(out), *layouts], script=WORKER)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def _check_terms(rows: list[dict]) -> None:
    for row in rows:
        measured, estimated = row["measured"], row["estimated"]
        where = (row["variant"], row["rank"])
        assert set(measured) <= set(estimated), (where, set(measured) - set(estimated))
        assert FSDP_TERMS & set(estimated) <= set(measured), (where, "FSDP2 buffers not measured")
        for term in EXACT:
            assert estimated[term] == measured[term], (where, term, estimated[term], measured[term])
        for term in set(measured) - set(EXACT):
            assert abs(estimated[term] - measured[term]) <= 0.05 * max(measured[term], 1), \
                (where, term, estimated[term], measured[term])


@pytest.mark.slow
def test_estimate_matches_measurement_on_moe_layouts(tmp_path):
    """qwen3_moe, 4 experts, top-2: 1 process, EP 2 (DDP), EP 2 × FSDP2 2 and FSDP2 2 without EP (one
    2-process launch for the three). Under EP the measured run routes every expert the same number of
    (token, slot) pairs (memory_worker.balanced_routing), the routing the estimate assumes."""
    layouts = ("moe-2x1x1-ep2", "moe-1x2x1-ep2", "moe-1x2x1")
    results = run_concurrently({"2": lambda: _measure(tmp_path, 2, *layouts),
                                "1": lambda: _measure(tmp_path, 1, "moe-1x1x1")}, workers=2)
    rows = results["1"] + results["2"]
    assert len(rows) == 4 * (1 + 2 * len(layouts))
    _check_terms(rows)
    by = {(row["variant"], row["rank"]): row["measured"] for row in rows}
    # The router terms are counted, and the layouts really differ: EP halves the experts' states per rank,
    # FSDP2 shards the rest, and EP's dispatch keeps more activations than transformers' grouped_mm path.
    assert by[("moe-1x1x1 float32 ac=none", 0)]["router logits and terms"] > 0
    single = by[("moe-1x1x1 float32 ac=none", 0)]
    ep, ep_fsdp, fsdp = (by[(f"{layout} float32 ac=none", 1)] for layout in layouts)
    assert single["parameters"] > ep["parameters"] > ep_fsdp["parameters"]
    assert ep["activations"] > single["activations"] and ep_fsdp["activations"] > fsdp["activations"]


@pytest.mark.slow
def test_estimate_matches_measurement_on_every_layout(tmp_path):
    """1 process, TP 2, and FSDP2 2 twice: the tiny Llama, where a decoder layer outweighs the root (embedding,
    final norm, head), and with a 512-token vocabulary, where the root outweighs a layer (`-v512`, same launch):
    FSDP2's buffer peaks then come from other moments of the step (estimate.fsdp_terms). The chunked loss
    (`-c8`: train.loss_chunk_tokens=8 of the 32 tokens of a micro-batch) on 1 process and on FSDP2 2 with the
    512-token vocabulary."""
    launches = {"1x2x1": (2, "1x2x1", "1x2x1-v512", "1x2x1-c8-v512"), "1x1x2": (2, "1x1x2"),
                "1x1x1": (1, "1x1x1", "1x1x1-c8")}
    results = run_concurrently({key: (lambda n=n, layouts=layouts: _measure(tmp_path, n, *layouts))
                                for key, (n, *layouts) in launches.items()}, workers=2)
    rows = [row for layout_rows in results.values() for row in layout_rows]
    assert len(rows) == 4 * (3 * 2 + 2 + 2)
    _check_terms(rows)
    # Chunking shrinks the logits term: one chunk's logits (8 tokens) instead of the micro-batch's (32), beside
    # the kept hidden states (which outweigh the logits with the 64-token vocabulary).
    logits = {row["variant"]: row["measured"]["logits and loss"] for row in rows if row["rank"] == 0}
    for variant in ("float32 ac=none", "bfloat16 ac=full"):
        assert logits[f"1x2x1-c8-v512 {variant}"] < 0.5 * logits[f"1x2x1-v512 {variant}"], (variant, logits)
        assert logits[f"1x1x1-c8 {variant}"] < logits[f"1x1x1 {variant}"], (variant, logits)
    results["1x2x1"] = [row for row in rows if row["variant"].startswith("1x2x1 ")]
    # The layouts really differ, so agreement is not one number compared with itself.
    single = {row["variant"].split(" ", 1)[1]: row["measured"] for row in results["1x1x1"]}
    for layout in ("1x2x1", "1x1x2"):
        for row in results[layout]:
            assert row["measured"]["parameters"] < single[row["variant"].split(" ", 1)[1]]["parameters"]
    tp = {row["variant"].split(" ", 1)[1]: row["measured"] for row in results["1x1x2"]}
    assert tp["float32 ac=none"]["activations"] < single["float32 ac=none"]["activations"]
    assert single["float32 ac=full"]["activations"] < single["float32 ac=none"]["activations"]


@pytest.mark.slow
def test_estimate_matches_measurement_under_context_parallelism(tmp_path):
    """CP 2 with Ulysses and with ring attention (one 2-process launch): each rank's piece of the 16-token rows, the
    style's own attention (Ulysses: SDPA over the whole rows for half the heads; ring: the merged output and
    log-sum-exp it saves for its recomputing backward), and the exchange buffers in flight, measured at every
    collective. Ring's rank 0 holds the zig-zag chunks 0 and 3, whose position ids jump: transformers builds a mask
    for them that rank 1 does not have, so the ranks differ and the estimate (of rank 0) meets rank 0."""
    rows = _measure(tmp_path, 2, "1x1x1-ulysses2", "1x1x1-ring2")
    assert len(rows) == 4 * 2 * 2
    _check_terms(rows)
    by = {(row["variant"], row["rank"]): row["measured"] for row in rows}
    for variant in ("float32 ac=none", "bfloat16 ac=none"):
        ulysses, ring = by[(f"1x1x1-ulysses2 {variant}", 0)], by[(f"1x1x1-ring2 {variant}", 0)]
        assert ulysses["context-parallel exchange buffers"] > 0 and ring["context-parallel exchange buffers"] > 0
        assert ring["activations"] > by[(f"1x1x1-ring2 {variant}", 1)]["activations"]
    single = {row["variant"].split(" ", 1)[1]: row for row in _measure(tmp_path, 1, "1x1x1")}
    for variant, row in single.items():
        # half the tokens: the logits and loss half (but for the loss scalar's 4 bytes, counted on both), the
        # activations about half (attention's extras)
        cp = by[(f"1x1x1-ulysses2 {variant}", 0)]
        assert 2 * cp["logits and loss"] - 4 == row["measured"]["logits and loss"], variant
        assert cp["activations"] < 0.6 * row["measured"]["activations"], variant


@pytest.mark.slow
def test_estimate_matches_measurement_on_fsdp2_with_context_parallelism(tmp_path):
    """FSDP2 2 × ring CP 2 (4 processes, fp32 only): FSDP2 shards over dp_shard × cp, so each rank holds a quarter
    of the weights and AdamW state, and FSDP2's buffers are padded to 4 chunks."""
    rows = _measure(tmp_path, 4, "1x2x1-ring2-fp32")
    assert len(rows) == 4
    _check_terms(rows)
    assert "FSDP2 all-gather buffers" in rows[0]["measured"]


@pytest.mark.slow
def test_estimate_matches_measurement_per_pipeline_stage(tmp_path):
    """PP 2 with 1F1B and with GPipe (tied embeddings), 3 micro-batches per step (one 2-process launch): each stage's
    own parameters (embedding on the first, norm and head on the last; a tied embedding's copy on both), the
    micro-batches in flight as the schedule really runs them (1F1B: 2 on the first stage, 1 on the last; GPipe: all
    3 on both), the logits on the last stage only, and torch's receive buffers. Every rank is compared with the
    estimate of its own stage."""
    rows = _measure(tmp_path, 2, "1x1x1-pp2", "1x1x1-pp2-gpipe-tied")
    assert len(rows) == 4 * 2 * 2
    _check_terms(rows)
    by = {(row["variant"], row["rank"]): row for row in rows}
    for variant in ("float32 ac=none", "bfloat16 ac=full"):
        first, last = (by[(f"1x1x1-pp2 {variant}", rank)]["measured"] for rank in (0, 1))
        gpipe_first, gpipe_last = (by[(f"1x1x1-pp2-gpipe-tied {variant}", rank)]["measured"] for rank in (0, 1))
        assert 3 * first["activations"] == 2 * gpipe_first["activations"], variant
        assert first["logits and loss"] == 0 < last["logits and loss"], variant
        assert gpipe_last["activations"] > last["activations"]
        assert gpipe_last["logits and loss"] > last["logits and loss"]
        assert first["pipeline buffers"] > 0 and last["pipeline buffers"] > 0
        # the tied copies: the same stages, the head's weight being the embedding's on the last stage
        assert (gpipe_first["parameters"], gpipe_last["parameters"]) == (first["parameters"], last["parameters"])


@pytest.mark.slow
def test_estimate_matches_measurement_on_interleaved_pipeline_ranks(tmp_path):
    """Interleaved 1F1B on PP 2, 2 stages of one layer per rank, 4 micro-batches: the estimate walks torch's own
    order of each rank's forwards and backwards (memory/pipeline.py), and each rank is compared with the estimate of
    its two stages together (a micro-batch's position ids, the same tensor on both, counted once)."""
    rows = _measure(tmp_path, 2, "1x1x1-pp2-interleaved")
    assert len(rows) == 4 * 2
    _check_terms(rows)
    by = {(row["variant"], row["rank"]): row["measured"] for row in rows}
    first, last = by[("1x1x1-pp2-interleaved float32 ac=none", 0)], by[("1x1x1-pp2-interleaved float32 ac=none", 1)]
    assert first["logits and loss"] == 0 < last["logits and loss"] and first["activations"] > last["activations"]


def test_float8_parameters_are_one_byte_plus_a_scale_per_tensor():
    """float8 sizing against real float8 tensors' bytes, and the fp32 masters beside them."""
    from isotrain.config import build_config
    from isotrain.memory.estimate import estimate_memory

    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "vocab_size": 64}
    cfg = build_config({"model": {"config": config}, "data": {"max_seq_len": 16},
                        "train": {"micro_batch_size": 2, "global_batch_size": 2}})
    fp8 = estimate_memory(cfg, 1, "float8", vocab_size=64)
    fp32 = estimate_memory(cfg, 1, "float32", vocab_size=64)
    from transformers import AutoConfig, AutoModelForCausalLM

    mapping = dict(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(mapping.pop("model_type"), **mapping))
    real = sum(torch.empty(p.shape, dtype=torch.float8_e4m3fn).nbytes + torch.empty((), dtype=torch.float32).nbytes
               for p in model.parameters())
    masters = sum(torch.empty(p.shape, dtype=torch.float32).nbytes for p in model.parameters())
    assert fp8.term("parameters") == real
    assert fp8.term("fp32 master weights") == masters == fp32.term("parameters")
    assert fp32.term("fp32 master weights") == 0
    assert torch.empty(3, dtype=torch.float8_e5m2).nbytes == 3


def test_estimate_memory_command_shows_every_pipeline_stage_and_refuses_what_it_cannot_estimate():
    args = ["estimate-memory", "model.config.hidden_size=64", "model.config.intermediate_size=128",
            "model.config.num_hidden_layers=4", "model.config.vocab_size=128", "data.max_seq_len=32",
            "train.global_batch_size=8", "train.micro_batch_size=2", "parallel.pp=2", "parallel.dp_replicate=1",
            "--world-size", "2"]
    table = run_isotrain(args)
    assert table.returncode == 0, table.stderr[-3000:]
    assert "stage 0 MiB" in table.stdout and "stage 1 MiB" in table.stdout and "pipeline buffers" in table.stdout
    report = json.loads(run_isotrain([*args, "--json"]).stdout)
    assert [stage["stage"] for stage in report["stages"]] == [0, 1]
    assert report["settings"]["pp_microbatches"] == 4
    logits = [next(t["bytes"] for t in stage["terms"] if t["name"] == "logits and loss") for stage in report["stages"]]
    assert logits[0] == 0 < logits[1]
    gpipe = json.loads(run_isotrain([*args, "parallel.pp_schedule=gpipe", "--json"]).stdout)
    first = [next(t["bytes"] for t in r["stages"][0]["terms"] if t["name"] == "activations") for r in (report, gpipe)]
    assert 4 * first[0] == 2 * first[1]  # 1F1B: min(2 - 0, 4) in flight on the first stage; GPipe: all 4
    interleaved = run_isotrain([*args, "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2"])
    assert interleaved.returncode == 0 and "rank 0 MiB" in interleaved.stdout, interleaved.stderr[-2000:]
    proc = run_isotrain([*args, "parallel.pp_schedule=interleaved_1f1b", "parallel.pp_stages_per_rank=2",
                         "parallel.dp_shard=2", "--world-size", "4"])
    assert proc.returncode == 2 and "parallel.dp_shard=2" in proc.stderr and "Traceback" not in proc.stderr


def test_estimate_memory_command_prints_json_and_refuses_bad_sizes():
    args = ["estimate-memory", "model.config.hidden_size=64", "model.config.intermediate_size=128",
            "model.config.num_hidden_layers=2", "model.config.vocab_size=128", "data.max_seq_len=32",
            "train.global_batch_size=4", "train.micro_batch_size=2", "parallel.dp_shard=2",
            "parallel.dp_replicate=1", "--world-size", "2", "--json"]
    proc = run_isotrain(args)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    names = [term["name"] for term in report["terms"]]
    assert names[:4] == ["parameters", "fp32 master weights", "gradients", "optimizer moments"]
    assert "FSDP2 all-gather buffers" in names and report["settings"]["dp_shard"] == 2
    assert report["total_bytes"] == sum(term["bytes"] for term in report["terms"])
    bad = run_isotrain([*args[:-3], "--world-size", "3"])
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_train_dry_run_does_no_work(tmp_path):
    out = tmp_path / "run"
    proc = run_isotrain(["train", "--dry-run", f"output_dir={out}", "data.path=/nonexistent.jsonl",
                         "model.config.hidden_size=64", "model.config.intermediate_size=128"])
    assert proc.returncode == 0, proc.stderr
    assert "optimizer moments" in proc.stdout and "total" in proc.stdout
    assert not out.exists()


MOE_ARGS = ["model.config.model_type=qwen3_moe", "model.config.hidden_size=64", "model.config.intermediate_size=128",
            "model.config.num_hidden_layers=2", "model.config.num_attention_heads=4",
            "model.config.num_key_value_heads=2", "model.config.num_experts=4", "model.config.num_experts_per_tok=2",
            "model.config.moe_intermediate_size=32", "data.max_seq_len=32", "train.micro_batch_size=2"]


def test_estimate_memory_command_on_moe_models():
    """The CLI estimates an MoE model (transformers' grouped_mm experts on fake fp32 tensors) on 1 process and
    under expert parallelism, where each rank holds half of the experts and FSDP2 leaves them alone."""
    single = run_isotrain(["estimate-memory", *MOE_ARGS, "--json"])
    assert single.returncode == 0 and "Traceback" not in single.stderr, single.stderr[-3000:]
    sharded = run_isotrain(["estimate-memory", *MOE_ARGS, "parallel.dp_shard=2", "parallel.dp_replicate=1",
                            "parallel.ep=2", "train.global_batch_size=4", "--world-size", "2", "--json"])
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    one, two = (json.loads(proc.stdout) for proc in (single, sharded))
    terms = {report["settings"]["world_size"]: {t["name"]: t["bytes"] for t in report["terms"]}
             for report in (one, two)}
    assert two["settings"]["ep"] == 2 and terms[1]["router logits and terms"] > 0
    assert "balanced routing" in next(t["note"] for t in two["terms"] if t["name"] == "activations")
    # Expert weights: 2 layers × (gate_up [4, 64, 64] + down [4, 64, 32]); EP 2 keeps half of them whole, FSDP2
    # halves the rest (every dense tensor here has an even first dim).
    experts = 2 * 4 * (64 * 64 + 64 * 32) * 4
    assert terms[2]["parameters"] == experts // 2 + (terms[1]["parameters"] - experts) // 2
    dry = run_isotrain(["train", "--dry-run", "data.path=/nonexistent.jsonl", *MOE_ARGS])
    assert dry.returncode == 0 and "router logits" in dry.stdout, dry.stderr[-3000:]


@pytest.mark.slow
def test_estimate_matches_measurement_on_tensor_parallel_moe(tmp_path):
    """TP 2 on qwen3_moe and on Mixtral (one 2-process launch): the router and the experts are replicated over TP,
    so each rank holds, computes and saves them whole. Mixtral's experts are `intermediate_size` wide: a fake
    forward that narrowed them as TP narrows a dense MLP would miss a quarter of the activations here."""
    rows = _measure(tmp_path, 2, "moe-1x1x2", "mixtral-1x1x2")
    assert len(rows) == 4 * 2 * 2
    _check_terms(rows)


def test_estimate_memory_counts_experts_replicated_over_tp():
    """TP 2 keeps every expert on every rank; EP 2 × TP 2 keeps half of them, the same half on both TP ranks of
    an EP group (experts are split by EP, never by TP)."""
    def parameters(*more: str) -> int:
        proc = run_isotrain(["estimate-memory", *MOE_ARGS, "train.global_batch_size=4", *more, "--json"])
        assert proc.returncode == 0, proc.stderr[-3000:]
        return next(t["bytes"] for t in json.loads(proc.stdout)["terms"] if t["name"] == "parameters")

    experts = 2 * 4 * (64 * 64 + 64 * 32) * 4  # 2 layers × (gate_up [4, 64, 64] + down [4, 64, 32]), fp32
    single = parameters()
    tp = parameters("parallel.tp=2", "parallel.dp_replicate=1", "--world-size", "2")
    ep_tp = parameters("parallel.tp=2", "parallel.dp_replicate=2", "parallel.ep=2", "--world-size", "4")
    assert experts < tp < single
    assert tp - ep_tp == experts // 2


# Measured on an NVIDIA H200 (torch 2.11, bench/gpu_check.py's memory part): what a forward of Llama hidden 1024,
# 8 layers, 16 heads / 8 KV heads, vocabulary 32000, on 4 × 1024 tokens, saved for backward, by setting.
H200_ACTIVATIONS = {("float32", "none"): 5_002_051_584, ("bfloat16", "none"): 1_850_032_256,
                    ("bfloat16", "full"): 169_951_232}


@pytest.mark.parametrize("dtype,checkpointing", sorted(H200_ACTIVATIONS))
def test_the_cuda_estimate_follows_cudas_attention_kernel(dtype, checkpointing):
    """On CUDA, fp32 with grouped-query heads runs SDPA's math kernel (flash takes only 16-bit inputs, memory-efficient
    attention no `enable_gqa`), which saves the [B, H, L, L] attention weights; bf16 runs flash. The estimate for
    device cuda, made here without a GPU, gives the bytes measured on the GPU; for device cpu it gives the CPU's."""
    from isotrain.config import build_config
    from isotrain.memory.estimate import estimate_memory

    model = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
             "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 1024}
    cfg = build_config({"model": {"config": model, "dtype": dtype}, "data": {"max_seq_len": 1024},
                        "train": {"micro_batch_size": 4, "global_batch_size": 4,
                                  "activation_checkpointing": checkpointing}})
    cuda = estimate_memory(cfg, 1, vocab_size=32000, device="cuda").term("activations")
    # To the byte, but for CUDA flash's RNG seed and offset (two 8-byte tensors per layer), which the CPU kernel
    # standing in for it does not keep: 128 bytes of 1.85 GB in bf16.
    rng_state = 16 * 8 if (dtype, checkpointing) == ("bfloat16", "none") else 0
    assert cuda + rng_state == H200_ACTIVATIONS[(dtype, checkpointing)]
    cpu = estimate_memory(cfg, 1, vocab_size=32000, device="cpu").term("activations")
    weights = 8 * 4 * 16 * 1024 * 1024 * 4  # fp32 attention weights of every layer
    assert cuda - cpu >= weights if (dtype, checkpointing) == ("float32", "none") else cuda == cpu
