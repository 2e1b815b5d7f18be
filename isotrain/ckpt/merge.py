"""`isotrain ckpt merge RECIPE.yaml`: merge Hugging Face model directories or isotrain checkpoints.

Tensor by tensor: each output shard reads the same-named tensor of every input (fp32 master weights
where an isotrain checkpoint has them), merges it (merge_methods.py), casts it and streams it to
disk, so memory holds a few tensors, never a model. The shard plan depends on the inputs only, and
every random draw is seeded per tensor, so the output is byte-identical for any `--processes`.

The key policy is explicit: every input must hold exactly the reference's tensors (the base's, else
the first model's) with the same shapes, except tensors matching `drop_keys` (left out) or
`keep_from_base` (copied from the base unmerged). Anything else is refused with the tensor named.
The output is written like an export: a `.tmp-` directory, a manifest, one atomic rename; the
recipe and the inputs' file hashes are kept in `merge.json`.
"""

from __future__ import annotations

import fnmatch
import itertools
import json
import resource
import shutil
import uuid
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from isotrain.ckpt import merge_methods as methods
from isotrain.ckpt.export import DTYPES, plan_shards, source_dtype
from isotrain.checkpoint.files import (
    FileEntry,
    safetensors_header,
    tensor_view,
    write_chunks,
    write_json,
)
from isotrain.checkpoint.load import CheckpointReader
from isotrain.checkpoint.manifest import MODEL_INDEX, read_manifest, verify_checkpoint, write_manifest
from isotrain.ckpt.inspection import directory_bytes
from isotrain.config import read_yaml, validate_tree
from isotrain.disk import commit, sha256_file
from isotrain.errors import CheckpointError

_COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "tokenizer.model")


class MergeInput(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(description="A Hugging Face model directory or an isotrain checkpoint.")
    weight: float = Field(1.0, allow_inf_nan=False, description="w_i of this model.")
    density: float | None = Field(None, gt=0, le=1, description="TIES/DARE: fraction of τ_i kept. Default: density.")


class MergeRecipe(BaseModel):
    model_config = ConfigDict(extra="forbid")
    method: Literal[methods.METHODS] = Field(description="linear, task_arithmetic, ties, dare_linear, dare_ties, slerp.")
    models: list[MergeInput] = Field(min_length=1)
    base: str | None = Field(None, description="θ_base of the task vectors; required by task_arithmetic, ties, dare_*.")
    out: str = Field(description="The new directory to write (must not exist or be empty).")
    scale: float = Field(1.0, allow_inf_nan=False, description="λ: how much of the merged task vector is added.")
    normalize: bool = Field(True, description="linear: divide by Σ w_i.")
    density: float = Field(1.0, gt=0, le=1, description="TIES/DARE default fraction of each τ_i kept.")
    t: float = Field(0.5, ge=0, le=1, description="slerp: 0 gives the first model, 1 the second.")
    seed: int = Field(0, ge=0, description="DARE: masks are drawn from (seed, tensor name, model index).")
    dtype: Literal["float32", "bfloat16", "float16"] | None = Field(None, description="Default: the reference's.")
    drop_keys: list[str] = Field([], description="fnmatch patterns of tensors to leave out of the output.")
    keep_from_base: list[str] = Field([], description="fnmatch patterns of tensors copied from the base unmerged.")
    max_shard_gb: float = Field(5.0, gt=0, description="Split the output weights into files of at most this size.")

    @model_validator(mode="after")
    def _shape(self) -> MergeRecipe:
        if self.method in methods.NEEDS_BASE and self.base is None:
            raise ValueError(f"method {self.method} merges task vectors θ_i − θ_base: set base to the model the "
                             "others were fine-tuned from")
        if self.method == "slerp" and len(self.models) != 2:
            raise ValueError(f"slerp interpolates between exactly 2 models; the recipe lists {len(self.models)}")
        if self.keep_from_base and self.base is None:
            raise ValueError("keep_from_base copies tensors from the base: set base too")
        if self.method == "linear" and self.normalize and sum(m.weight for m in self.models) == 0:
            raise ValueError("linear with normalize divides by the sum of the weights, which is 0: change the "
                             "weights or set normalize: false")
        return self


@dataclass
class MergeReport:
    out: Path
    merged: int
    kept_from_base: list[str]
    dropped: list[str]
    dropped_bytes: int
    reference_bytes: int  # the reference model's weight files
    out_bytes: int  # the whole output directory
    peak_rss_bytes: int  # of this process and its workers
    files: list[str] = field(default_factory=list)


def read_recipe(path: str | Path) -> MergeRecipe:
    return validate_tree(read_yaml(path), MergeRecipe)


def _matches(name: str, patterns: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


class _Input:
    """One input directory: its weight tensors by name (fp32 masters preferred) and its provenance."""

    def __init__(self, path: str, verify: bool):
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise CheckpointError(f"{path} is not a model directory with config.json; list Hugging Face model "
                                  "directories or isotrain checkpoints in the recipe")
        self.hashes = self._verified_hashes() if verify else {}
        self.reader = CheckpointReader(self.path)
        self.keys = set(self.reader.model_keys)
        if not self.keys:
            raise CheckpointError(f"{path} holds no model.safetensors or model.safetensors.index.json; merge "
                                  "directories saved with safetensors")
        self.config = json.loads((self.path / "config.json").read_text())

    def _verified_hashes(self) -> dict:
        if (self.path / "manifest.json").is_file():  # written by isotrain: trust only verified bytes
            problems = verify_checkpoint(self.path)
            if problems:
                raise CheckpointError(f"{self.path} cannot be merged: {problems[0]}; merge a valid checkpoint")
            # The manifest's own entries: size and its hashes (BLAKE3 pieces, or an older manifest's sha256).
            return {name: spec for name, spec in read_manifest(self.path)["files"].items() if "safetensors" in name}
        return {p.name: sha256_file(p) for p in sorted(self.path.iterdir())
                if p.is_file() and "safetensors" in p.name}

    def read(self, name: str) -> torch.Tensor:
        master = f"master.{name}"
        return self.reader.read(master if master in self.reader else name)

    def close(self) -> None:
        self.reader.close()


def _check_inputs(recipe: MergeRecipe, reference: _Input, inputs: list[_Input]) -> tuple[list[str], list[str]]:
    """(names merged or copied, names dropped); refuses any other difference between the inputs."""
    names = sorted(reference.keys)
    dropped = [n for n in names if _matches(n, recipe.drop_keys)]
    wanted = [n for n in names if n not in dropped]
    ties = reference.config.get("tie_word_embeddings")
    for other in inputs:
        if other is reference:
            continue
        if other.config.get("tie_word_embeddings") != ties:
            raise CheckpointError(f"{other.path} has tie_word_embeddings={other.config.get('tie_word_embeddings')} "
                                  f"but {reference.path} has {ties}; merge models that tie (or untie) their "
                                  "embeddings alike")
        missing = [n for n in wanted if n not in other.keys and not _matches(n, recipe.keep_from_base)]
        if missing:
            raise CheckpointError(f"{other.path} has no tensor {missing[0]!r} ({len(missing)} missing) that "
                                  f"{reference.path} has; add it to drop_keys or keep_from_base, or merge models "
                                  "of one architecture")
        extra = sorted(n for n in other.keys - reference.keys if not _matches(n, recipe.drop_keys))
        if extra:
            raise CheckpointError(f"{other.path} holds tensor {extra[0]!r} ({len(extra)} extra) that "
                                  f"{reference.path} lacks; add it to drop_keys, or merge models of one architecture")
        for name in wanted:
            if name in other.keys and other.reader.shape(name) != reference.reader.shape(name):
                raise CheckpointError(f"tensor {name!r} has shape {list(other.reader.shape(name))} in {other.path} "
                                      f"but {list(reference.reader.shape(name))} in {reference.path}; models of "
                                      "different sizes (or vocabularies) cannot be merged tensor by tensor")
    return wanted, dropped


def merge_tensor(recipe: MergeRecipe, name: str, base: torch.Tensor | None, tensors: list[torch.Tensor]) -> torch.Tensor:
    """The merged fp32 tensor `name` from the inputs' fp32 tensors (the base's first where there is one)."""
    weights = [m.weight for m in recipe.models]
    densities = [m.density if m.density is not None else recipe.density for m in recipe.models]
    method = recipe.method
    if method == "linear":
        return methods.linear(tensors, weights, recipe.normalize)
    if method == "task_arithmetic":
        return methods.task_arithmetic(base, tensors, weights, recipe.scale)
    if method == "ties":
        return methods.ties(base, tensors, weights, densities, recipe.scale)
    if method in ("dare_linear", "dare_ties"):
        return methods.dare(base, tensors, weights, densities, recipe.scale, name, recipe.seed,
                            sign_election=method == "dare_ties")
    return methods.slerp(tensors[0], tensors[1], recipe.t)


def _open(recipe: MergeRecipe, verify: bool = False) -> tuple[_Input | None, list[_Input], _Input]:
    """The inputs; with `verify` (once, before any output) their bytes are checked and hashed."""
    base = _Input(recipe.base, verify) if recipe.base is not None else None
    models = [_Input(m.path, verify) for m in recipe.models]
    return base, models, base if base is not None else models[0]


def _write_shard(recipe: MergeRecipe, path: Path, names: list[str], shapes: dict, target: torch.dtype) -> FileEntry:
    """One output file; runs in a worker process when --processes > 1 (so it opens its own readers)."""
    base, models, reference = _open(recipe)

    def produce(name: str) -> torch.Tensor:
        stored = reference.read(name)
        if not stored.is_floating_point():  # position ids, masks and other integer buffers are copied
            return stored
        if _matches(name, recipe.keep_from_base):
            merged = base.read(name).float()
        else:
            merged = merge_tensor(recipe, name, base.read(name).float() if base is not None else None,
                                  [m.read(name).float() for m in models])
        return merged.to(target)

    try:
        meta = {n: torch.empty(shapes[n][0], dtype=shapes[n][1], device="meta") for n in names}
        chunks = (tensor_view(produce(n)) for n in names)  # a generator: one tensor in memory at a time
        return write_chunks(path, itertools.chain([safetensors_header(meta)], chunks))
    finally:
        for item in (base, *models):
            if item is not None:
                item.close()


def merge_models(recipe: MergeRecipe, processes: int = 1) -> MergeReport:
    out = Path(recipe.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists; choose a new output directory or remove it")
    if processes < 1:
        raise CheckpointError(f"--processes {processes} is invalid; use 1 or more")
    base, models, reference = _open(recipe, verify=True)
    try:
        wanted, dropped = _check_inputs(recipe, reference, [x for x in (base, *models) if x is not None])
        target_name = recipe.dtype or source_dtype(reference.path)
        target = DTYPES.get(target_name, torch.float32)
        shapes = {n: (torch.Size(reference.reader.shape(n)),
                      target if reference.reader.dtype(n).is_floating_point else reference.reader.dtype(n))
                  for n in wanted}
        dropped_bytes = sum(torch.Size(reference.reader.shape(n)).numel() * reference.reader.dtype(n).itemsize
                            for n in dropped)
        provenance = {"recipe": recipe.model_dump(mode="json"),
                      "inputs": {str(x.path): x.hashes for x in (base, *models) if x is not None}}
        reference_bytes = sum(directory_bytes(reference.path / n) for n in reference.hashes)
        reference_dir, ref_config = reference.path, reference.config
    finally:
        for item in (base, *models):
            if item is not None:
                item.close()
    shards = plan_shards(shapes, int(recipe.max_shard_gb * 1e9))
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:12]}")
    tmp.mkdir(parents=True)
    try:
        entries = _write_files(recipe, tmp, names, shards, shapes, target, processes)
        entries.update(_static_files(reference_dir, ref_config, tmp, target_name))
        entries["merge.json"] = write_json(tmp / "merge.json", provenance)
        if len(shards) > 1:
            total = sum(shapes[n][0].numel() * shapes[n][1].itemsize for n in shapes)
            entries[MODEL_INDEX] = write_json(tmp / MODEL_INDEX, {
                "metadata": {"total_size": total},
                "weight_map": {n: file for file, keys in zip(names, shards) for n in keys}})
        write_manifest(tmp, entries, {"kind": "model", "step": None, "merged_with": recipe.method})
        commit(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
               resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) * 1024
    kept = [n for n in wanted if _matches(n, recipe.keep_from_base)]
    return MergeReport(out, len(wanted) - len(kept), kept, dropped, dropped_bytes, reference_bytes,
                       directory_bytes(out), peak, sorted(entries))


def _write_files(recipe, tmp: Path, names: list[str], shards: list[list[str]], shapes: dict, target,
                 processes: int) -> dict[str, FileEntry]:
    jobs = [(recipe, tmp / name, keys, shapes, target) for name, keys in zip(names, shards)]
    if processes == 1 or len(jobs) == 1:
        return {name: _write_shard(*job) for name, job in zip(names, jobs)}
    with ProcessPoolExecutor(max_workers=processes, mp_context=get_context("spawn")) as pool:
        futures = {name: pool.submit(_write_shard, *job) for name, job in zip(names, jobs)}
        return {name: future.result() for name, future in futures.items()}


def _static_files(reference: Path, config: dict, tmp: Path, dtype_name: str) -> dict[str, FileEntry]:
    """config.json (with the output dtype) and the tokenizer files of the reference model."""
    entries = {}
    for name in _COPIED:
        path = reference / name
        if not path.is_file():
            continue
        if name == "config.json":
            config = dict(config, dtype=dtype_name)
            config.pop("torch_dtype", None)
            entries[name] = write_json(tmp / name, config)
        else:
            entries[name] = write_chunks(tmp / name, [path.read_bytes()])
    return entries
