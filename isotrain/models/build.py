"""Build, parallelise, then load: every model of a run (SFT model, RL policy, reference, critic) comes from here.

    1. build the Hugging Face model with its parameters on the meta device (no memory; buffers such as
       rotary frequencies are computed for real, they are tiny and not in the weight files);
    2. parallelise it (parallel/apply.py: TP -> activation checkpointing -> compile -> FSDP2);
    3. materialise each rank's shards only, then fill them: from the safetensors files, each rank reading
       only the bytes it owns, or, for a fresh model, by running the family's own initialisation one
       module at a time on a full-size scratch copy and keeping this rank's part;
    4. wrap in DDP if the run replicates without sharding.

No rank ever holds the whole model: start-up memory is this rank's shard plus the largest tensor.
A fresh model's weights do not depend on the layout: every rank draws the same full tensors, in the
same order (the order transformers' own initialisation walks the modules), from the same seed.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, PreTrainedModel

from isotrain.config import ModelConfig
from isotrain.models.checks import attention_kernel
from isotrain.models.loading import model_config, model_dir
from isotrain.models.unwrap import model_tensors
from isotrain.parallel.apply import materialise_stage_roots, parallelize, wrap_replicas
from isotrain.parallel.boxes import box_index, shard_spec
from isotrain.parallel.dims import ParallelDims, check_model_fits
from isotrain.parallel.mesh import ParallelState, single_process


@contextlib.contextmanager
def parameters_on_meta():
    """Modules built inside get meta parameters and real buffers (what `to_empty` cannot recreate)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def copy_into(target: torch.Tensor, full: torch.Tensor, rank: int) -> None:
    """Copy this rank's block of the full tensor `full` into `target` (a plain tensor or a DTensor); the block
    is the one the checkpoint code reads and writes for this rank (parallel/boxes.py `shard_spec`)."""
    spec = shard_spec(target)
    with torch.no_grad():
        local = target.to_local() if isinstance(target, DTensor) else target
        local.copy_(full if spec is None else full[box_index(spec.box(rank))])


def _post_order(module: nn.Module, prefix: str = ""):
    """(name, module), children before their parent: the order transformers' initialisation uses."""
    for name, child in module.named_children():
        yield from _post_order(child, f"{prefix}{name}.")
    yield prefix.rstrip("."), module


def init_fresh(model: nn.Module, skeleton: PreTrainedModel, seed: int, rank: int,
               only: set[str] | None = None) -> None:
    """Initialise the (parallelised, materialised) `model` as `skeleton`'s family would, module by module.

    Each module's own parameters get full-size CPU scratch tensors in the meta `skeleton`, the family's
    `_init_weights` fills them, and this rank copies its part; the scratch is freed before the next module.
    `only`: initialise just the modules owning these parameter names (a head missing from loaded weights).
    """
    torch.manual_seed(seed)
    live = dict(model.named_modules())
    # Every slot of each skeleton parameter: a tied weight is initialised (last) by the module of one slot, which on a
    # pipeline stage may be another's (the head's init reaches the first stage's copy under the embedding's name).
    slots: dict[int, list[tuple[str, str]]] = {}
    for name, module in skeleton.named_modules(remove_duplicate=False):
        for key, param in module._parameters.items():
            if param is not None:
                slots.setdefault(id(param), []).append((name, key))
    for name, module in _post_order(skeleton):
        own = [(key, p) for key, p in module._parameters.items() if p is not None]
        if not own or (only is not None and not any(_join(name, key) in only for key, _ in own)):
            continue
        for key, param in own:
            module._parameters[key] = nn.Parameter(torch.empty(param.shape, dtype=param.dtype),
                                                   requires_grad=param.requires_grad)
        skeleton._init_weights(module)
        for key, meta_param in own:
            targets = {id(t): t for t in (live[other]._parameters.get(other_key) if other in live else None
                                          for other, other_key in slots[id(meta_param)]) if t is not None}
            for target in targets.values():  # none: another pipeline stage's, drawn all the same (stages draw alike)
                copy_into(target, module._parameters[key], rank)
            module._parameters[key] = meta_param


def _join(module_name: str, key: str) -> str:
    return f"{module_name}.{key}" if module_name else key


def _shared_parameters(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module, str]]:
    """(module, key, first module, first key) for every parameter slot that holds a parameter seen before
    (tied input and output embeddings)."""
    first: dict[int, tuple[nn.Module, str]] = {}
    shared = []
    for module in model.modules():
        for key, param in module._parameters.items():
            if param is None:
                continue
            if id(param) in first:
                shared.append((module, key, *first[id(param)]))
            else:
                first[id(param)] = (module, key)
    return shared


def _materialise(model: nn.Module, device: torch.device) -> None:
    """Allocate each rank's shards; buffers keep the values they were built with, tied weights stay tied
    (`to_empty` gives every slot its own new tensor)."""
    buffers = {name: buf.detach().clone() for name, buf in model.named_buffers()}
    shared = _shared_parameters(model)
    model.to_empty(device=device)
    materialise_stage_roots(model, device)
    for module, key, first_module, first_key in shared:
        module._parameters[key] = first_module._parameters[first_key]
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(buffers[name])


def empty_model(config, model_class=AutoModelForCausalLM) -> nn.Module:
    """The whole model in this process with uninitialised parameters (real buffers, ties kept): for a copy
    whose weights arrive later (a rollout engine). Draws nothing from the RNGs, so building it never
    shifts a seeded or resumed run's random stream."""
    with parameters_on_meta():
        model = model_class.from_config(config, dtype=torch.float32)
    _materialise(model, torch.device("cpu"))
    return model


def build(cfg: ModelConfig, tokenizer, seed: int, parallel: ParallelState, device: torch.device, *,
          model_class=AutoModelForCausalLM, compute_dtype: torch.dtype | None = None, compile: bool = False,
          activation_checkpointing: bool = False, loss_parallel: bool = False, trainable: bool = True,
          config_updates: dict | None = None, adapt=None, checkpoint_context_fn=None) -> nn.Module:
    """A model of `model_class` for this rank's layout, loaded from `cfg.name_or_path` (a local directory or a Hub
    id's cached snapshot) or freshly initialised.

    Parameters are fp32 (master weights); `compute_dtype` is applied by FSDP2 or by autocast in the step.
    `config_updates` set config fields before building (e.g. num_labels=1 for PPO's critic). `adapt(model)`
    runs on the loaded model before any data-parallel wrapper and returns the model to train (LoRA).
    `checkpoint_context_fn`: the contexts of a checkpointed layer's forward and recompute (parallel/apply.py).
    """
    config = model_config(cfg, tokenizer)
    for key, value in (config_updates or {}).items():
        setattr(config, key, value)
    check_model_fits(parallel.dims, config)
    with parameters_on_meta():
        model = model_class.from_config(config, dtype=torch.float32,
                                        attn_implementation=attention_kernel(cfg.attn_implementation, config,
                                                                             model_class))
    model.config.use_cache = False
    skeleton = copy.deepcopy(model)  # meta: a few KB of module objects
    model = parallelize(model, parallel, compute_dtype=compute_dtype, compile=compile,
                        activation_checkpointing=activation_checkpointing, loss_parallel=loss_parallel,
                        checkpoint_context_fn=checkpoint_context_fn)
    _materialise(model, device)
    if cfg.name_or_path is None:
        init_fresh(model, skeleton, seed, parallel.rank)
    else:
        load_pretrained(str(model_dir(cfg)), model, skeleton, seed, parallel.rank,
                        new_heads=model_class is not AutoModelForCausalLM)
    if adapt is not None:
        model = adapt(model)
    if trainable:
        model.train()  # from_pretrained would have returned eval mode; dropout must follow the config
    else:
        model.requires_grad_(False).eval()
    return wrap_replicas(model, parallel, trainable)


def load_pretrained(path: str, model: nn.Module, skeleton: PreTrainedModel, seed: int, rank: int,
                    new_heads: bool = False) -> None:
    """Weights from a Hugging Face directory, each rank reading its own part of each tensor.

    Two differences from the files are handled: a vocabulary grown for added special tokens (the new
    rows are initialised like transformers' `resize_token_embeddings`, seeded), and, with `new_heads`, a head
    that the files do not have because they hold another task's model (PPO's critic from a causal LM: its
    value head is initialised fresh). Any other missing or mismatched tensor is refused by the loader.
    """
    from isotrain.checkpoint.load import CheckpointReader, load_hf_weights

    reader = CheckpointReader(path)
    try:
        tensors = model_tensors(model)
        backbone = f"{getattr(skeleton, 'base_model_prefix', 'model')}."
        heads = {name for name in tensors if name not in reader and not name.startswith(backbone)} \
            if new_heads else set()
        grown = {name for name, t in tensors.items() if name in reader and t.ndim == 2
                 and reader.shape(name)[1:] == tuple(t.shape[1:]) and reader.shape(name)[0] < t.shape[0]}
        load_hf_weights(path, model, rank, skip=frozenset(heads | grown))
        for name in sorted(grown):
            copy_into(tensors[name], _grown_rows(skeleton, reader.read(name), tensors[name].shape[0], seed), rank)
    finally:
        reader.close()
    if heads:
        init_fresh(model, skeleton, seed, rank, only=heads)


def _grown_rows(skeleton: PreTrainedModel, saved: torch.Tensor, rows: int, seed: int) -> torch.Tensor:
    """`saved` with rows added as transformers' `resize_token_embeddings` adds them (sampled around the mean
    of the old rows), seeded so that every rank and every layout draws the same ones."""
    torch.manual_seed(seed)
    old = nn.Embedding(*saved.shape, _weight=saved)
    return skeleton._get_resized_embeddings(old, rows).weight.detach()


def build_plain(cfg: ModelConfig, tokenizer, seed: int, device: torch.device | str = "cpu", **kwargs) -> nn.Module:
    """The whole model in one process (rollout engines, tools, benchmarks): the same weights as any layout."""
    return build(cfg, tokenizer, seed, single_process(ParallelDims(1, 1, 1)), torch.device(device), **kwargs)
