"""Run 3 optimizer steps of a tiny Llama on a fixed dataset in one layout; rank 0 saves the results.

Launched by test_equivalence.py with torchrun (real processes, gloo) or in-process for 1 rank:
    equivalence_worker.py OUT.pt LAYOUTS MICRO_BATCH [naive|ac] [chunk=N]
LAYOUTS: e.g. 2x1x1,1x2x1,1x1x2 = DDP, FSDP2, TP (dp_replicate x dp_shard x tp), with an optional 4th degree
for expert parallelism (1x2x1x2 = FSDP2 2 with EP 2, for the MoE families) and an optional 5th for context
parallelism (1x1x1x1x2 = CP 2 alone, 1x2x1x1x2 = FSDP2 2 × CP 2: ParallelDims' field order; Ulysses, or ring attention
with `:ring`, 1x1x1x1x2:ring keyed (1, 1, 1, 1, 2, "ring")), and a pipeline-parallel
degree and schedule after a colon (1x1x1:pp2-gpipe = PP 2 with GPipe, keyed ("pp", 2, "gpipe"); 1x2x1:pp2-1f1b = PP 2 ×
FSDP2 2, keyed ("pp", 2, "1f1b", (1, 2, 1))); `ac` checkpoints every
decoder layer's activations. One launch covers every given layout (a mesh and a model each), both loss
reductions, in fp32 and in fp64: results[(dp_replicate, dp_shard, tp)][(reduction, dtype)]; run() is one
layout in this process. `chunk=N` also runs every layout without TP with the chunked cross-entropy
(train.loss_chunk_tokens=N): results[("chunked", layout)].
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from isotrain.data.collate import collate
from isotrain.data.packing import Sample, pack_examples
from isotrain.data.tokenize import Example
from isotrain.data.sampler import GlobalBatchSampler
from isotrain.models.packing_check import check_packing
from isotrain.models.unwrap import unwrap
from isotrain.parallel.apply import parallelize, wrap_replicas
from isotrain.parallel.dims import MULTI_STAGE, ParallelDims
from isotrain.parallel.dist import all_reduce_max, init_distributed, shutdown_distributed
from isotrain.parallel.mesh import build_parallel
from isotrain.parallel.pp import Pipeline
from isotrain.parallel.tp import check_replicated
from isotrain.train.loss import token_losses
from isotrain.train.optim import build_optimizer
from isotrain.config import TrainConfig
from isotrain.train.setup import step_options
from isotrain.train.stage_data import stage_micro_batches
from isotrain.train.step import forward_backward, optimizer_step, shared_parameters

VOCAB = 64
GLOBAL_BATCH = 8
NUM_STEPS = 3


def make_samples(num: int = 16, seed: int = 0) -> list[Sample]:
    """Variable lengths (3..20), masked 'prompts', and one packed sample of two documents."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(num):
        lengths = [int(rng.integers(3, 21))] if i != 5 else [7, 9]
        ids, labels, positions, segments = [], [], [], []
        for seg, length in enumerate(lengths):
            doc = rng.integers(4, VOCAB, size=length)
            prompt_len = int(rng.integers(0, length - 1))
            target = np.concatenate([doc[1:], [-100]])
            target[: max(prompt_len - 1, 0)] = -100
            ids.append(doc), labels.append(target)
            positions.append(np.arange(length)), segments.append(np.full(length, seg))
        samples.append(Sample(np.concatenate(ids), np.concatenate(labels), np.concatenate(positions),
                              np.concatenate(segments), (i,)))
    return samples


def make_packed_samples(num: int = 16, max_seq_len: int = 32) -> list[Sample]:
    """data.packing: single documents of make_samples' kind (3..20 tokens, masked prompts) packed whole by the
    library's best-fit packing into samples of at most 32 tokens, 2 to 5 documents each (10 to 32 tokens)."""
    documents = [Example(s.input_ids, s.labels, i) for i, s in enumerate(make_samples(40, seed=1)) if i != 5]
    samples = pack_examples(documents, max_seq_len)[:num]
    assert len(samples) == num and all(len(s.row_ids) > 1 for s in samples)
    return samples


class CountedSamples:
    """The samples, counting every read (under pipeline parallelism only the first and last stages may read)."""

    def __init__(self, samples: list[Sample]):
        self.samples, self.num_reads = samples, 0

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Sample:
        self.num_reads += 1
        return self.samples[index]


# Tiny models of every family with a tensor-parallel plan that isotrain claims; 4 heads and 2 KV heads so
# that TP 2 splits both. Qwen2 has biases on q/k/v (split with their columns); Qwen3 has per-head q/k norms
# (replicated, gradients summed over TP); llama_tied ties its embeddings (one parameter under TP too).
FAMILIES = {
    "llama": {},
    "llama_tied": {"model_type": "llama", "tie_word_embeddings": True},
    # Four decoder layers: two per stage under pipeline parallelism 2.
    "llama_4layers": {"num_hidden_layers": 4},
    "llama_tied_4layers": {"model_type": "llama", "tie_word_embeddings": True, "num_hidden_layers": 4},
    # One KV head: fewer than any context-parallel degree, so Ulysses repeats it (multi-query attention).
    "llama_mqa": {"num_key_value_heads": 1},
    # Two heads and one KV head: fewer than a ring of 4 context-parallel ranks (Ulysses could not split them).
    "llama_2heads": {"num_attention_heads": 2, "num_key_value_heads": 1},
    "qwen2": {"model_type": "qwen2"},
    "qwen3": {"model_type": "qwen3", "head_dim": 8},
    "mistral": {"model_type": "mistral", "sliding_window": None},
    # Mixture-of-experts: 4 experts, top-2, every layer sparse (expert parallelism splits the experts).
    "qwen3_moe": {"model_type": "qwen3_moe", "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": []},
    "mixtral": {"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
}


def tiny_model(dtype: torch.dtype, family: str = "llama"):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    extra = dict(FAMILIES[family])
    model_type = extra.pop("model_type", "llama")
    sizes = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64)
    config = AutoConfig.for_model(model_type, **{**sizes, **extra})
    config.use_cache = False
    # MoE: transformers' per-expert loop, the reference math (its default grouped_mm kernel has no fp64 on CPU).
    kwargs = {"experts_implementation": "eager"} if model_type in ("qwen3_moe", "mixtral") else {}
    return AutoModelForCausalLM.from_config(config, **kwargs).to(dtype)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def naive_forward_backward(model, micro_batches) -> float:
    """The classic bug: mean per micro-batch, then averaged over micro-batches (single process only)."""
    total = 0.0
    for mb in micro_batches:
        logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False).logits
        losses = token_losses(logits, mb["labels"])
        loss = losses.sum() / max(mb["num_trained_tokens"], 1) / len(micro_batches)
        loss.backward()
        total += loss.item()
    return total


def run_layout(info, parallel, micro_batch: int, reduction: str, dtype: torch.dtype, naive: bool,
               checkpointing: bool = False, family: str = "llama", chunk_tokens: int = 0,
               packed: bool = False) -> dict:
    model = parallelize(tiny_model(dtype, family), parallel, activation_checkpointing=checkpointing,
                        loss_parallel=True).train()
    model = wrap_replicas(model, parallel)
    optimizer = build_optimizer(model, TrainConfig(weight_decay=0.1))
    samples = CountedSamples(make_packed_samples() if packed else make_samples())
    sampler = GlobalBatchSampler(len(samples), GLOBAL_BATCH, seed=0)
    cfg = SimpleNamespace(model=SimpleNamespace(dtype="float32"),
                          train=SimpleNamespace(loss_reduction=reduction, grad_clip=1.0, loss_chunk_tokens=chunk_tokens,
                                              compile=False))
    options = step_options(cfg, parallel)
    # data.packing: the run's packing probe (under PP through the stages): whether the step needs isotrain's mask.
    probe = check_packing(model, info.device, torch.float32, Pipeline.of(parallel)) if packed else None
    params = [p for p in model.parameters()]
    losses, first_grads, counts, norms, shapes = [], None, [], [], []
    copies = []  # under PP with tied embeddings: whether the two stages' copies were equal (grads, then weights)
    for step in range(NUM_STEPS):
        index_lists = sampler.micro_batches(step, parallel.dp_rank, parallel.dp_size, micro_batch)
        # As the SFT recipe reads: the first and last pipeline stages alone (train/stage_data.py).
        micro_batches = stage_micro_batches(lambda idx: collate([samples[i] for i in idx], pad_id=0), index_lists,
                                            parallel, reduction, info.device)
        length = max(mb["position_ids"].shape[1] for mb in micro_batches)  # the pipeline pads to the DP ranks' longest
        shapes.append((len(micro_batches), all_reduce_max(length, parallel.dp_group, info.device)))
        if naive:
            loss, step_counts = naive_forward_backward(model, micro_batches), None
        else:
            loss, step_counts = forward_backward(model, micro_batches, options, info.device)
        if step == 0:
            first_grads = _all_stages({n: full(p.grad) for n, p in unwrap(model).named_parameters()}, parallel, copies)
        losses.append(loss)
        counts.append(step_counts)
        norms.append(optimizer_step(optimizer, params, lr=1e-2, grad_clip=1.0, loss=loss, stages=parallel.dims.pp,
                                    shared=shared_parameters(model, options)))
        if step == 0:
            check_replicated(model, parallel.tp_group)
    weights = _all_stages({n: full(p) for n, p in unwrap(model).named_parameters()}, parallel, copies)
    # Expert parallelism: how many experts this rank holds of each expert tensor (E / ep, not E).
    local_rows = {n: p.to_local().shape[0] for n, p in unwrap(model).named_parameters()
                  if ".experts." in n and isinstance(p, DTensor)}
    # Under PP: the stages and schedules this rank built, and the padded micro-batch shapes of the 3 steps.
    pipeline = {"builds": options.pipeline.num_builds, "shapes": len(set(shapes))} if options.pipeline else None
    if options.pipeline:  # every stage's sample reads and counts, stage by stage
        pipeline["reads"], pipeline["counts"] = _by_stage((samples.num_reads, counts), parallel)
        pipeline["rank_stages"], pipeline["stage_layers"] = _stage_layers(options.pipeline, parallel)
    return {"local_expert_rows": local_rows, "losses": losses, "grads": first_grads, "weights": weights, "counts": counts,
            "norms": norms, "pipeline": pipeline, "tied_copies_equal": copies, "probe_needs_mask": probe}


def _stage_layers(pipeline: Pipeline, parallel) -> tuple[list[list[int]], dict[int, list[int]]]:
    """([the stages of each rank], {stage: the decoder layers its module runs}) of the pipeline, as torch's stages
    hold them."""
    from isotrain.parallel.apply import decoder_layers
    from isotrain.parallel.pp import PassThrough

    runner = next(iter(pipeline._kept.values()))
    local = {stage.stage_index: [i for i, layer in enumerate(decoder_layers(stage.submod.model))
                                 if not isinstance(layer, PassThrough)]
             for stage in getattr(runner, "_stages", None) or [runner._stage]}
    ranks = _by_stage(local, parallel)
    return [list(rank) for rank in ranks], {stage: layers for rank in ranks for stage, layers in rank.items()}


def _by_stage(value, parallel) -> list:
    """[value of stage 0, value of stage 1, ...] of this rank's pipeline, on every rank; transposed when `value` is a
    tuple."""
    gathered = [None] * parallel.dims.pp
    torch.distributed.all_gather_object(gathered, value, group=parallel.pp_group)
    return [list(column) for column in zip(*gathered)] if isinstance(value, tuple) else gathered


def _all_stages(tensors: dict, parallel, copies: list) -> dict:
    """Under pipeline parallelism each rank holds its stage's tensors: every stage's, by name (one process's set). A
    tied embedding is held by the first and the last stage: the first stage's copy is kept, and whether the two are
    bitwise equal is appended to `copies`."""
    if parallel.dims.pp == 1:
        return tensors
    gathered = [None] * parallel.dims.pp
    torch.distributed.all_gather_object(gathered, tensors, group=parallel.pp_group)
    merged = {}
    for stage in gathered:
        for name, t in stage.items():
            if name in merged:
                assert name == "model.embed_tokens.weight", f"two stages hold {name}"
                copies.append(torch.equal(merged[name], t))
            else:
                merged[name] = t
    return merged


def _parse_layout(text: str):
    """'1x1x1' -> (1, 1, 1); '1x1x1:pp2-gpipe' -> ((1, 1, 1), 2, 'gpipe');
    '1x1x1x1x2:ring' -> (1, 1, 1, 1, 2, 'ring')."""
    layout, _, pipeline = text.partition(":")
    degrees = tuple(int(x) for x in layout.split("x"))
    if not pipeline:
        return degrees
    if pipeline == "ring":
        return (*degrees, "ring")
    pp, schedule, *split = pipeline.removeprefix("pp").split("-")  # 1x1x1:pp2-1f1b-3+1: parallel.pp_split=[3,1]
    return degrees, int(pp), schedule, tuple(int(n) for n in split[0].split("+")) if split else None


def _dims(layout) -> tuple[ParallelDims, tuple]:
    """The ParallelDims of a parsed layout and its key in the results."""
    if isinstance(layout[0], tuple):
        degrees, pp, schedule, split = layout
        key = ("pp", pp, schedule) if degrees == (1, 1, 1) else ("pp", pp, schedule, degrees)
        key += (split,) if split else ()  # (an uneven split's key ends with it)
        per_rank = 2 if schedule in MULTI_STAGE else 1  # 2 stages per rank
        return ParallelDims(*degrees, pp=pp, pp_schedule=schedule, pp_stages_per_rank=per_rank, pp_split=split), key
    if layout[-1] == "ring":
        return ParallelDims(*layout[:-1], cp_style="ring"), layout
    return ParallelDims(*layout), layout


def run(out: str, micro_batch: int, naive: bool = False, checkpointing: bool = False, family: str = "llama",
        packed: bool = False) -> None:
    """The single-process layout in this process: results[(reduction, dtype)]."""
    results = run_layouts([(1, 1, 1)], micro_batch, naive, checkpointing, [family], packed=packed)
    torch.save(results[(1, 1, 1)] if family == "llama" else results[(family, (1, 1, 1))], out)


def run_layouts(layouts: list[tuple[int, int, int]], micro_batch: int, naive: bool = False,
                checkpointing: bool = False, families: list[str] = ("llama",), chunk_tokens: int = 0,
                packed: bool = False) -> dict | None:
    """Every (dp_replicate, dp_shard, tp) layout in turn, each with its own mesh and models, in one launch
    (the processes start once): results[layout][(reduction, dtype)] on rank 0, else None; with other
    families than llama, results[(family, layout)]."""
    torch.use_deterministic_algorithms(True)
    info = init_distributed()
    results = {}
    for family in families:
        for layout in layouts:
            dims, layout = _dims(layout)
            parallel = build_parallel(dims, info.device, info.rank)
            key = layout if list(families) == ["llama"] else (family, layout)
            results[key] = {
                (reduction, str(dtype)): run_layout(info, parallel, micro_batch, reduction, dtype, naive,
                                                    checkpointing, family, packed=packed)
                for reduction in ("token", "sequence")
                for dtype in (torch.float32, torch.float64)
            }
    for layout in layouts if chunk_tokens else []:
        dims, layout = _dims(layout)
        if dims.tp == 1 and dims.pp == 1:  # the chunked loss refuses TP and PP
            parallel = build_parallel(dims, info.device, info.rank)
            results[("chunked", layout)] = {
                (reduction, str(dtype)): run_layout(info, parallel, micro_batch, reduction, dtype, naive,
                                                    checkpointing, chunk_tokens=chunk_tokens)
                for reduction in ("token", "sequence")
                for dtype in (torch.float32, torch.float64)
            }
    if info.is_distributed:
        shutdown_distributed()
    return results if info.is_main else None


if __name__ == "__main__":
    # equivalence_worker.py OUT.pt LAYOUTS MICRO_BATCH [naive] [ac] [families=qwen3,...] [unreduced] [scaled] [chunk=N]
    #     [counts_over_pp] [stage_unreduced] [tied_unsummed] [packed] [boundaries_first_stage_only]
    # LAYOUTS: RxSxT[xE][,...], e.g. 2x1x1,1x1x2,2x1x1x2; `unreduced` removes the TP gradient sum of Qwen3's q/k norms
    # on purpose, to show that the replicated-parameter check catches a missing reduction.
    out, layouts, micro, *rest = sys.argv[1:]
    families = next((flag.split("=", 1)[1].split(",") for flag in rest if flag.startswith("families=")), ["llama"])
    if "unreduced" in rest:
        import isotrain.parallel.tp as tp

        styles = tp._style

        def without_grad_sum(name: str, where: str):
            if name == "replicated_with_grad_allreduce":
                return tp.ReplicateParallel(grad_reduce=False)
            return styles(name, where)

        tp._style = without_grad_sum
    if "scaled" in rest:  # the pipeline schedule's own gradient scaling, on purpose: the control that must fail
        import isotrain.parallel.pp as pp

        pp.SCALE_GRADS = True
    if "counts_over_pp" in rest:  # on purpose: the step's counts summed over the world (DP × PP), not DP alone
        import isotrain.train.step as step

        counts = step._global_counts
        step._global_counts = lambda micro_batches, reduction, device, group=None: counts(
            micro_batches, reduction, device, None)
    if "tied_unsummed" in rest:  # on purpose: a tied embedding's copies each keep their own stage's gradient part
        import isotrain.train.pipeline_step as pipeline_step

        pipeline_step.sync_tied_grads = lambda model, stage, pp, group: None
    if "stage_unreduced" in rest:  # on purpose: PP × DDP without the DP sum of the last stage's gradients
        import isotrain.train.pipeline_step as pipeline_step

        sync = pipeline_step.sync_replica_grads
        pipeline_step.sync_replica_grads = lambda model, parallel: (None if parallel.pp_rank == 1
                                                                    else sync(model, parallel))
    if "boundaries_first_stage_only" in rest:  # on purpose: the stages after the first get no position ids (no
        import isotrain.parallel.pp as pp  # document restarts; transformers counts 0..L-1 along every row)

        stage_forward = pp.StageModule.forward

        def without_boundaries(self, x, **kwargs):
            if not self.first:
                kwargs.pop("position_ids")
            return stage_forward(self, x, **kwargs)

        pp.StageModule.forward = without_boundaries
    results = run_layouts([_parse_layout(layout) for layout in layouts.split(",")], int(micro),
                          naive="naive" in rest, checkpointing="ac" in rest, families=families,
                          chunk_tokens=next((int(flag.split("=", 1)[1]) for flag in rest if flag.startswith("chunk=")),
                                            0),
                          packed="packed" in rest)
    if results is not None:
        torch.save(results, out)
