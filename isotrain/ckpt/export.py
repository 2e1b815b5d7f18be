"""`isotrain ckpt export`: a checkpoint (or model directory) to a plain Hugging Face model directory.

Tensors are streamed one at a time (read, cast, written, hashed), so exporting needs memory for the
largest tensor only. With fp32 master weights in the training state (bf16 runs) those are the
source, so `--dtype float32` gives the exact weights rather than bf16 values widened. The output is
written like a checkpoint: into a `.tmp-` directory, fsynced, listed in a manifest, renamed into place.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from isotrain.checkpoint.files import (
    FileEntry,
    safetensors_header,
    tensor_view,
    write_chunks,
    write_json,
)
from isotrain.checkpoint.load import CheckpointReader
from isotrain.checkpoint.manifest import MODEL_INDEX, read_manifest, verify_checkpoint, write_manifest
from isotrain.checkpoint.state import OPTIMIZER_STATE_KEYS
from isotrain.ckpt.inspection import directory_bytes
from isotrain.disk import commit
from isotrain.errors import CheckpointError
from isotrain.models.expert_keys import Part, expert_format, is_fused, saved_name, saved_parts

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_STATE_PREFIXES = tuple(f"{key}." for key in (*OPTIMIZER_STATE_KEYS, "master"))
_NOT_COPIED = re.compile(r"^(model.*\.safetensors|model\.safetensors\.index\.json|manifest\.json)$")


@dataclass
class ExportReport:
    out: Path
    num_tensors: int
    dropped: list[str]
    dtype: str
    source_bytes: int  # the whole source directory, training state included
    source_model_bytes: int  # its model weight files
    out_bytes: int
    from_master: bool


def source_dtype(directory: Path) -> str:
    """The dtype a model directory's config.json names (what an export or merge writes unless told otherwise)."""
    config = json.loads((directory / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or "float32")


def plan_shards(shapes: dict[str, tuple[torch.Size, torch.dtype]], max_bytes: int) -> list[list[str]]:
    """Tensor names grouped into safetensors shards of at most `max_bytes` each (a larger tensor alone), in order."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, (shape, dtype) in shapes.items():
        num = shape.numel() * dtype.itemsize
        if shards[-1] and size + num > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += num
    return shards


def _check_source_and_out(source: Path, out: Path) -> None:
    """Only a checkpoint that verifies is exported, and never into a directory that holds anything."""
    problems = verify_checkpoint(source)
    if problems:
        raise CheckpointError(f"{source} cannot be exported: {problems[0]}; export a valid checkpoint "
                              f"(`isotrain ckpt list RUN_DIR` shows them)")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} already exists; choose a new output directory or remove it")


def export_checkpoint(source: Path, out: Path, dtype: str | None = None, drop_keys: str | None = None,
                      max_shard_bytes: int = 5 << 30) -> ExportReport:
    source, out = Path(source), Path(out)
    _check_source_and_out(source, out)
    target_name = dtype or source_dtype(source)
    if target_name not in DTYPES:
        raise CheckpointError(f"--dtype {target_name} is not supported; use one of {', '.join(DTYPES)}")
    target = DTYPES[target_name]
    try:
        pattern = re.compile(drop_keys) if drop_keys else None
    except re.error as err:
        raise CheckpointError(f"--drop-keys {drop_keys!r} is not a valid regular expression ({err})") from None

    reader = CheckpointReader(source)
    model_keys = sorted(k for k in reader.keys() if not k.startswith(_STATE_PREFIXES))
    plan = _saved_keys(source, reader, model_keys)
    dropped = [k for k in plan if pattern and pattern.search(k)]
    kept = [k for k in plan if not (pattern and pattern.search(k))]
    if not kept:
        raise CheckpointError(f"--drop-keys {drop_keys!r} matches every tensor of {source}; nothing would be exported")
    from_master = any(f"master.{plan[k][0]}" in reader for k in kept)

    def read(key: str) -> torch.Tensor:
        stored, part = plan[key]
        tensor = reader.read(f"master.{stored}" if f"master.{stored}" in reader else stored,
                             None if part is None else part.box)
        if part is not None and part.drop_first:
            tensor = tensor[0]
        return tensor.to(target) if tensor.is_floating_point() else tensor

    def out_dtype(key: str) -> torch.dtype:
        stored = reader.dtype(plan[key][0])
        return target if stored.is_floating_point else stored

    def out_shape(key: str) -> torch.Size:
        stored, part = plan[key]
        return torch.Size(reader.shape(stored) if part is None else part.shape)

    shapes = {k: (out_shape(k), out_dtype(k)) for k in kept}
    shards = plan_shards(shapes, max_shard_bytes)
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:12]}")
    manifest = read_manifest(source)
    tmp.mkdir(parents=True)
    try:
        entries = _write(source, tmp, shards, shapes, read, target_name)
        info = {"kind": "model", "step": manifest.get("step"), "exported_from": str(source.resolve())}
        write_manifest(tmp, entries, info)
        commit(tmp, out)  # an existing `out` is empty (checked above): the rename replaces it
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        reader.close()
    model_files = [n for n in manifest["files"] if n.startswith("model") and "safetensors" in n]
    return ExportReport(out, len(kept), dropped, target_name, directory_bytes(source),
                        sum(directory_bytes(source / n) for n in model_files), directory_bytes(out), from_master)


def _saved_keys(source: Path, reader: CheckpointReader, model_keys: list[str]) -> dict[str, tuple[str, Part | None]]:
    """Output key -> (stored key, the block of it to write or None for all of it): a MoE model's experts one
    tensor each under the keys `save_pretrained` writes, also when the source stored them fused (isotrain
    checkpoints written before per-expert saving); any other tensor as stored."""
    try:
        fmt = expert_format(json.loads((source / "config.json").read_text()))
    except (OSError, ValueError):
        fmt = None
    plan: dict[str, tuple[str, Part | None]] = {}
    for key in model_keys:
        shape = reader.shape(key)
        if fmt is not None and is_fused(key, shape):
            plan.update((part.key, (key, part)) for part in saved_parts(key, shape, fmt))
        else:
            plan[saved_name(key, fmt)] = (key, None)
    return dict(sorted(plan.items()))


def _write(source: Path, tmp: Path, shards: list[list[str]], shapes: dict, read, dtype_name: str) -> dict[str, FileEntry]:
    entries: dict[str, FileEntry] = {}
    for path in sorted(source.iterdir()):
        if path.is_file() and not _NOT_COPIED.match(path.name):
            if path.name == "config.json":
                config = json.loads(path.read_text())
                config["dtype"] = dtype_name
                config.pop("torch_dtype", None)
                entries[path.name] = write_json(tmp / path.name, config)
            else:
                entries[path.name] = write_chunks(tmp / path.name, [path.read_bytes()])
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, keys in zip(names, shards):
        meta = {k: torch.empty(shapes[k][0], dtype=shapes[k][1], device="meta") for k in keys}
        header = safetensors_header(meta)
        # A generator: one tensor is in memory at a time.
        entries[name] = write_chunks(tmp / name, itertools.chain([header], (tensor_view(read(k)) for k in keys)),
                                     first_piece_bytes=len(header))
    if len(shards) > 1:
        total = sum(shapes[k][0].numel() * shapes[k][1].itemsize for k in shapes)
        weight_map = {k: name for name, keys in zip(names, shards) for k in keys}
        entries[MODEL_INDEX] = write_json(tmp / MODEL_INDEX, {"metadata": {"total_size": total},
                                                              "weight_map": weight_map})
    return entries


def export_adapter(source: Path, out: Path) -> ExportReport:
    """The LoRA adapters of a LoRA run's checkpoint as a peft adapter directory (adapter_config.json and
    adapter_model.safetensors) that `peft.PeftModel.from_pretrained(base, out)` loads."""
    from isotrain.config import LoraConfig, read_yaml, validate_tree
    from isotrain.models.lora import lora_config

    source, out = Path(source), Path(out)
    _check_source_and_out(source, out)
    run_config = source / "train_state" / "config.yaml"
    reader = CheckpointReader(source)
    try:
        names = sorted(k for k in reader.keys() if k.startswith("adapter."))
        if not names or not run_config.is_file():
            raise CheckpointError(f"{source} holds no LoRA adapters (it was not saved by a run with lora.r > 0); "
                                  "export its full weights without --adapter")
        # Only the lora and model sections: the run may be `isotrain train` or `isotrain rl` (or an older run that
        # saved every recipe's sections), and the adapter needs nothing else.
        run = read_yaml(run_config)
        lora = validate_tree(run.get("lora") or {}, LoraConfig, "lora.")
        base_model = (run.get("model") or {}).get("name_or_path")
        # peft saves "<module>.lora_A.weight": the adapter's name ("default") is not part of the file's keys.
        tensors = {k.removeprefix("adapter.").replace(".default.", "."): reader.read(k) for k in names}
    finally:
        reader.close()
    config = lora_config(lora).to_dict()
    config["base_model_name_or_path"] = base_model
    config["peft_type"] = str(config["peft_type"].value)
    config["task_type"] = str(config["task_type"])
    config["target_modules"] = sorted(config["target_modules"])
    tmp = out.with_name(f"{out.name}.tmp-{uuid.uuid4().hex[:12]}")
    tmp.mkdir(parents=True)
    try:
        entries = {"adapter_config.json": write_json(tmp / "adapter_config.json", config)}
        meta = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in tensors.items()}
        header = safetensors_header(meta, {"format": "pt"})
        entries["adapter_model.safetensors"] = write_chunks(
            tmp / "adapter_model.safetensors", itertools.chain([header], (tensor_view(t) for t in tensors.values())))
        write_manifest(tmp, entries, {"kind": "adapter", "step": read_manifest(source).get("step"),
                                      "exported_from": str(source.resolve())})
        commit(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return ExportReport(out, len(tensors), [], "float32", directory_bytes(source), num_bytes, directory_bytes(out),
                        False)
