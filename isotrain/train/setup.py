"""Everything a run builds before its first step: RNGs, tokenizer, dataset, model, optimizer, LoRA adapters
and the step's options: where the config becomes the objects below it, which read values, not the config.

Order: tokenizer -> data -> model (built on the meta device, parallelised, then each rank loads or
initialises only its own shards: models/build.py) -> optimizer over the (possibly sharded) params.
Rank 0 does the file-producing work first (tokenizer training; the tokenization cache, which one rank per file
system builds: every node's local rank 0 when the cache is node-local) and the other ranks then read its result,
so every rank sees byte-identical inputs.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import torch

from isotrain.config import RLRunConfig, RunConfig, TrainRunConfig
from isotrain.data import prepare_dataset
from isotrain.data.cache import cache_root
from isotrain.data.mixture import prepare_mixture
from isotrain.data.sources import read_rows
from isotrain.errors import ConfigError
from isotrain.models.build import build
from isotrain.models.loading import check_model_dir, tokenizer_dir
from isotrain.models.lora import apply_lora, whole_meta_model
from isotrain.models.packing_check import all_ranks_max
from isotrain.models.tokenizer import add_special_tokens, load_tokenizer, train_tokenizer
from isotrain.parallel.dist import DistInfo, barrier, local_main_first
from isotrain.moe.settings import RouterSettings
from isotrain.parallel.mesh import ParallelState
from isotrain.parallel.pp import Pipeline
from isotrain.train.optim import build_optimizer
from isotrain.train.step import StepOptions


def seed_everything(seed: int, deterministic: bool) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic:
        # cuBLAS is deterministic only with a fixed workspace; without it CUDA matmuls raise under
        # use_deterministic_algorithms. Read when cuBLAS starts, so it is set before any CUDA matmul runs.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False


def training_texts(data_cfg) -> list[str]:
    """The raw text of data.path's rows, or of every source's rows of a mixture (weights aside): what a tokenizer is
    trained on."""
    sources = getattr(data_cfg, "sources", None)  # only isotrain train's data section has sources
    if not sources:
        return row_texts(read_rows(data_cfg.path, data_cfg.format).rows, data_cfg.format)
    texts = []
    for i, source in enumerate(sources):
        fmt = source.format or data_cfg.format
        texts += row_texts(read_rows(source.path, fmt, f"data.sources[{i}].path").rows, fmt)
    return texts


def row_texts(rows: list[dict], fmt: str) -> list[str]:
    """The raw text of data rows, to train a tokenizer on."""
    if fmt == "text":
        return [row["text"] for row in rows]
    if fmt == "prompt_completion":
        return [row["prompt"] + row["completion"] for row in rows]
    return [message["content"] for row in rows for message in row["messages"]]


def rank0_first(info: DistInfo, work):
    """Run `work` on rank 0, then on the other ranks (which find rank 0's files in place)."""
    if info.is_main:
        result = work()
        barrier()
        return result
    barrier()
    return work()


def prepare_tokenizer(cfg: RunConfig, info: DistInfo, output_dir: Path, log):
    if cfg.model.name_or_path is not None:
        check_model_dir(cfg.model)  # a wrong model path is named as such, not as a tokenizer
    source = tokenizer_dir(cfg)
    if source is not None:
        tokenizer = load_tokenizer(str(source))
    else:
        trained_dir = output_dir / "tokenizer"

        def train_and_save():
            if info.is_main:
                trained = train_tokenizer(training_texts(cfg.data), cfg.tokenizer.type, cfg.tokenizer.vocab_size)
                trained.save_pretrained(trained_dir)
                log(f"trained a {cfg.tokenizer.type} tokenizer ({len(trained)} tokens) -> {trained_dir}")
            return load_tokenizer(str(trained_dir))

        tokenizer = rank0_first(info, train_and_save)
    added = add_special_tokens(tokenizer, cfg.model.add_special_tokens)
    if added:
        log(f"added {added} special tokens; embeddings are resized to {len(tokenizer)}")
    return tokenizer


def prepare_data(cfg: TrainRunConfig, info: DistInfo, tokenizer, log):
    """The Dataset of data.path, or the Mixture of data.sources (data/mixture.py) for train.seed, prepared by one
    rank per file system that holds the cache (every node's, if node-local)."""
    log = log if info.is_main else _quiet
    if cfg.data.sources is not None:
        def prepare(first):
            return prepare_mixture(cfg.data, tokenizer, cfg.train.seed, cfg.train.global_batch_size, log=log)
    else:
        def prepare(first):
            return prepare_dataset(cfg.data, tokenizer, log=log)
    return local_main_first(info.local_rank, prepare, shared_dir=cache_root(cfg.data.cache_dir))


def _quiet(*_args, **_kwargs) -> None:
    pass


def compute_dtype(cfg: RunConfig) -> torch.dtype | None:
    return torch.bfloat16 if cfg.model.dtype == "bfloat16" else None


def prepare_model(cfg: TrainRunConfig | RLRunConfig, info: DistInfo, tokenizer, parallel: ParallelState):
    model = build(cfg.model, tokenizer, cfg.train.seed, parallel, info.device, compute_dtype=compute_dtype(cfg),
                  compile=cfg.train.compile, activation_checkpointing=cfg.train.activation_checkpointing == "full",
                  loss_parallel=True, adapt=lora_adapter(cfg, parallel.dims))
    optimizer = build_optimizer(model, cfg.train)
    return model, optimizer


def lora_adapter(cfg, dims):
    """`adapt` for the model builder when `lora.r` > 0: adapters applied to the loaded model before any
    data-parallel wrapper, seeded so that every rank initialises the same ones; else None. `dims`: the
    run's resolved ParallelDims."""
    if cfg.lora.r == 0:
        return None
    if dims.fsdp or dims.tp > 1:
        raise ConfigError(f"lora.r={cfg.lora.r} runs on one process, DDP or pipeline stages; LoRA under FSDP2 or "
                          f"tensor parallelism (parallel.dp_shard={dims.dp_shard}, parallel.tp={dims.tp}) is not "
                          "supported yet: set parallel.dp_shard=1 and parallel.tp=1")

    def adapt(model):
        # Under pipeline parallelism each stage adds its adapters as part of the whole model, so that they start as
        # one process's (models/lora.py); the skeleton is built before the seed is set.
        skeleton = whole_meta_model(model) if dims.pp > 1 else None
        torch.manual_seed(cfg.train.seed)
        adapted = apply_lora(model, cfg.lora.r, cfg.lora.alpha, cfg.lora.target_modules, cfg.lora.dropout, skeleton)
        if dims.pp > 1 and all_ranks_max(float(not any(p.requires_grad for p in adapted.parameters())),
                                         next(model.parameters()).device):
            raise ConfigError(f"lora.target_modules={list(cfg.lora.target_modules)} leaves a pipeline stage without "
                              f"adapters (parallel.pp={dims.pp}: each stage trains its own); add a decoder layer's "
                              "linear module, e.g. q_proj")
        return adapted

    return adapt


def step_options(cfg, parallel, loss_parallel: bool = True, document_mask: bool = False,
                 router: RouterSettings | None = None) -> StepOptions:
    """The step settings of a run: FSDP2 casts parameters itself; DDP and single-process runs use autocast for bf16.
    `loss_parallel`: the model was built with vocabulary-sharded logits under TP (SFT; RL gathers them).
    `document_mask`: the run's packing probe found that the model ignores position-id restarts.
    `router`: an MoE model's router terms (isotrain.moe.settings.router_settings)."""
    autocast = torch.bfloat16 if cfg.model.dtype == "bfloat16" and not parallel.dims.fsdp else None
    return StepOptions(pipeline=Pipeline.of(parallel), loss_reduction=cfg.train.loss_reduction,
                       grad_clip=cfg.train.grad_clip, autocast_dtype=autocast, dp_group=parallel.dp_group,
                       loss_parallel=loss_parallel and parallel.dims.tp > 1, parallel=parallel,
                       document_mask=document_mask, router=router, loss_chunk_tokens=cfg.train.loss_chunk_tokens,
                       compile_loss=cfg.train.compile)
