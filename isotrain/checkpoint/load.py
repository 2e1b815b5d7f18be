"""Read a committed checkpoint into a model and optimizer of any layout.

Each rank reads only what it holds: whole tensors under DDP or one process, its block of each
DTensor under FSDP2, TP or both (a pread of its dim-0 rows into the rank's own tensor, or the runs
of a block that cuts trailing dims), so a checkpoint saved on N ranks loads on M of any layout.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
import struct
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from isotrain.checkpoint.files import SAFETENSORS_DTYPES, read_safetensors_header, tensor_view
from isotrain.checkpoint.manifest import MODEL_INDEX, OPTIMIZER_INDEX
from isotrain.checkpoint.state import OPTIMIZER_STATE_KEYS, is_whole, model_parts, part_view, within
from isotrain.errors import CheckpointError
from isotrain.models.expert_keys import Part, expert_format, key_problems
from isotrain.models.unwrap import hf_model, model_tensors
from isotrain.parallel.boxes import Box, box_index, full_box, is_empty, local_part, shard_spec
from isotrain.parallel.dims import num_experts


_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


BLOCK_BYTES = 16 << 20  # the largest buffer a block read uses (reused from block to block)
RUN_BYTES = 64 << 10  # runs at least this long are read one pread each, straight into the target


@dataclass(frozen=True)
class _Read:
    """One pread of a tensor's bytes [begin, end) that fills `target[into]`: directly, or through a
    buffer of shape `block` of which `pick` is kept."""

    begin: int
    end: int
    into: tuple
    block: tuple[int, ...] | None = None
    pick: tuple = ()


def plan_reads(shape: tuple[int, ...], box: Box, itemsize: int, block_bytes: int = BLOCK_BYTES,
               run_bytes: int = RUN_BYTES, base: int = 0, into: tuple = ()) -> list[_Read]:
    """The preads that bring block `box` of a row-major tensor into a contiguous target of the box's shape.

    A box spanning every dim after its first is one run of bytes: one pread. Otherwise each index of
    the first dim is a sub-tensor of `row` bytes: when the box's runs inside it are long
    (>= `run_bytes`), or the sub-tensor is larger than a block, recurse into each index (a TP split
    of [out, in] reads each row's part; a 3-D expert tensor each expert's part); when the runs are
    short, read whole rows `block_bytes` at a time and keep their part, trading bytes read for
    fewer system calls.
    """
    if any(stop <= start for start, stop in box):
        return []
    if not shape:
        return [_Read(base, base + itemsize, into)]
    (start, stop), inner = box[0], box[1:]
    row = math.prod(shape[1:]) * itemsize
    if inner == full_box(shape[1:]):
        return [_Read(base + start * row, base + stop * row, (*into, slice(0, stop - start)))]
    if row > block_bytes or _run_bytes(shape[1:], inner, itemsize) >= run_bytes:
        return [read for i in range(start, stop) for read in plan_reads(
            shape[1:], inner, itemsize, block_bytes, run_bytes, base + i * row, (*into, i - start))]
    rows_per_block = max(1, block_bytes // row)
    pick = (slice(None), *box_index(inner))
    return [_Read(base + a * row, base + b * row, (*into, slice(a - start, b - start)), (b - a, *shape[1:]), pick)
            for a in range(start, stop, rows_per_block) for b in [min(a + rows_per_block, stop)]]


def _run_bytes(shape: tuple[int, ...], box: Box, itemsize: int) -> int:
    """The length of the box's contiguous runs: its last cut dim's extent times the full dims after it."""
    run = itemsize
    for (start, stop), size in zip(reversed(box), reversed(shape)):
        run *= stop - start
        if (start, stop) != (0, size):
            break
    return run


class CheckpointReader:
    """Tensor lookup by name across a checkpoint's model and optimizer files.

    Reads go through the safetensors headers and `pread`, never a memory map: each read lands
    directly in the tensor that keeps it.
    """

    def __init__(self, directory: Path, block_bytes: int = BLOCK_BYTES, run_bytes: int = RUN_BYTES,
                 record: bool = False):
        self.directory = Path(directory)
        # With `record`, every read into a kept tensor is listed here as (first byte in the file, the
        # memory it landed in), so that a resume can hash those bytes where they now are (onepass.py).
        self.loaded: dict[Path, list[tuple[int, memoryview]]] | None = {} if record else None
        self.block_bytes, self.run_bytes = block_bytes, run_bytes
        self._where: dict[str, Path] = {}
        self._files: dict[Path, tuple[int, int, dict]] = {}  # fd, first data byte, header
        self._index(MODEL_INDEX, "model.safetensors")
        self.model_keys = frozenset(self._where)  # the Hugging Face model files' tensors
        self._index(OPTIMIZER_INDEX, "train_state/optimizer.safetensors")

    def _index(self, index_name: str, single_name: str) -> None:
        index, single = self.directory / index_name, self.directory / single_name
        if index.is_file():
            for key, file_name in json.loads(index.read_text())["weight_map"].items():
                self._where[key] = index.parent / file_name
        elif single.is_file():
            for key in self._file(single)[2]:
                if key != "__metadata__":
                    self._where[key] = single

    def model_key_counts(self) -> Counter:
        """How many model files hold each key: every file the index names, read header by header (a key
        held by two files, which the index can map to one only, counts twice)."""
        files = sorted({self._where[key] for key in self.model_keys})
        return Counter(key for path in files for key in self._file(path)[2] if key != "__metadata__")

    def _file(self, path: Path) -> tuple[int, int, dict]:
        if path not in self._files:
            try:
                header = read_safetensors_header(path)
            except ValueError as err:
                raise CheckpointError(f"{path} is not a valid safetensors file ({err}); "
                                      f"run `isotrain ckpt verify {self.directory}`") from None
            with open(path, "rb") as f:
                (header_len,) = struct.unpack("<Q", f.read(8))
            self._files[path] = (os.open(path, os.O_RDONLY), 8 + header_len, header)
        return self._files[path]

    def _spec(self, key: str) -> dict:
        return self._file(self._where[key])[2][key]

    def __contains__(self, key: str) -> bool:
        return key in self._where

    def keys(self) -> set[str]:
        return set(self._where)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._spec(key)["shape"])

    def dtype(self, key: str) -> torch.dtype:
        return _DTYPES[self._spec(key)["dtype"]]

    def _locate(self, key: str) -> tuple[Path, int, int]:
        """(file, fd, first byte of tensor `key` in the file)."""
        path = self._where[key]
        fd, data_start, header = self._file(path)
        return path, fd, data_start + header[key]["data_offsets"][0]

    def _plan(self, key: str, box: Box | None) -> list[_Read]:
        shape = self.shape(key)
        return plan_reads(shape, full_box(shape) if box is None else box, self.dtype(key).itemsize,
                          self.block_bytes, self.run_bytes)

    def prefetch(self, key: str, box: Box | None = None) -> int:
        """Ask the kernel to start reading tensor `key` (or its box) now, without waiting; returns the bytes."""
        _, fd, first = self._locate(key)
        total = 0
        for read in self._plan(key, box):
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, first + read.begin, read.end - read.begin, os.POSIX_FADV_WILLNEED)
            total += read.end - read.begin
        return total

    def read_into(self, key: str, target: torch.Tensor, box: Box | None = None, kept: bool = False) -> None:
        """Read tensor `key` (or the block `box` of it) from its file straight into `target`'s memory.

        A whole tensor or a block of dim-0 rows is one pread, with no intermediate tensor: loading
        is bound by the disk, not by copies. Other blocks go run by run or through bounded row
        blocks (`plan_reads`). A target of another dtype or device goes through a CPU tensor.
        `kept`: `target` is state the caller keeps (not a temporary), so a recording reader lists the
        bytes read straight into it; bytes read through a buffer are not listed (a check reads them again).
        """
        path, fd, first = self._locate(key)
        sizes = list(self.shape(key)) if box is None else [stop - start for start, stop in box]
        direct = (target.device.type == "cpu" and target.is_contiguous() and target.dtype == self.dtype(key)
                  and list(target.shape) == sizes)
        if not direct:
            target.copy_(self.read(key, box))
            return
        scratch = torch.empty(0, dtype=target.dtype)  # one buffer for every block: faulted in once
        for read in self._plan(key, box):
            part = target[read.into]
            if read.block is None:
                view = tensor_view(part)
                self._pread(path, fd, key, view, first + read.begin)
                if kept and self.loaded is not None:
                    self.loaded.setdefault(path, []).append((first + read.begin, view))
                continue
            if scratch.numel() < math.prod(read.block):
                scratch = torch.empty(math.prod(read.block), dtype=target.dtype)
            block = scratch[: math.prod(read.block)].view(read.block)
            self._pread(path, fd, key, tensor_view(block), first + read.begin)
            part.copy_(block[read.pick])

    def _pread(self, path: Path, fd: int, key: str, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got == 0:
                raise CheckpointError(f"{path} ends inside tensor {key!r}; run `isotrain ckpt verify {self.directory}`")
            done += got

    def read(self, key: str, box: Box | None = None) -> torch.Tensor:
        """Tensor `key` (or the block `box` of it) as a new CPU tensor in its stored dtype."""
        shape = self.shape(key) if box is None else [stop - start for start, stop in box]
        tensor = torch.empty(shape, dtype=self.dtype(key))
        self.read_into(key, tensor, box)
        return tensor

    def close(self) -> None:
        for fd, _, _ in self._files.values():
            os.close(fd)
        self._files.clear()

    def state(self) -> dict:
        return json.loads((self.directory / "train_state" / "state.json").read_text())


def _box(tensor: torch.Tensor, rank: int) -> Box | None:
    """The block of `tensor` (a plain tensor or DTensor) that this rank holds; None for all of it."""
    spec = shard_spec(tensor)
    return spec.box(rank) if spec is not None else None


def _read_into(reader: CheckpointReader, key: str, target: torch.Tensor, rank: int) -> None:
    """Copy the part of tensor `key` that this rank holds into `target` (a plain tensor or DTensor)."""
    with torch.no_grad():
        reader.read_into(key, local_part(target), _box(target, rank), kept=True)


class ReadAhead:
    """Keeps the kernel reading up to `window_bytes` ahead of the tensor being read.

    A rank of a sharded layout reads only its part of each tensor, which the kernel's own
    readahead does not take for a sequential stream; announcing the next reads keeps the disk
    busy while the current one is copied and faulted in.
    """

    def __init__(self, reader: CheckpointReader, upcoming: list[tuple[str, Box | None]],
                 window_bytes: int = 256 << 20):
        self.reader, self.upcoming, self.window_bytes = reader, upcoming, window_bytes
        self.starts, position = [], 0  # where each read starts in the stream of this rank's reads
        for key, box in upcoming:
            self.starts.append(position)
            position += sum(read.end - read.begin for read in reader._plan(key, box))
        self.starts.append(position)
        self.announced = 0

    def before(self, index: int) -> None:
        """Call before reading entry `index` of `upcoming`."""
        limit = self.starts[index + 1] + self.window_bytes
        while self.announced < len(self.upcoming) and self.starts[self.announced] < limit:
            self.reader.prefetch(*self.upcoming[self.announced])
            self.announced += 1


_RESUME_HINT = "resume with the checkpoint's model.config or set checkpoint.resume=never"


def sources(reader: CheckpointReader, name: str, shape: tuple[int, ...], parts: list[Part],
            probe: str = "") -> list[Part]:
    """The saved tensors that hold in-memory tensor `name`: its parts (the keys `save_pretrained` writes), or,
    in checkpoints isotrain wrote before MoE experts were saved per expert, the tensor whole under its
    in-memory name. `probe`: the prefix whose keys decide (`step.` for optimizer state). A checkpoint holding
    both is refused: the same weights would be stored twice."""
    if parts[0].key == name:
        return parts
    legacy = f"{probe}{name}"
    if legacy not in reader:
        return parts
    both = next((f"{probe}{part.key}" for part in parts if f"{probe}{part.key}" in reader), None)
    if both is not None:
        raise CheckpointError(f"checkpoint {reader.directory} holds both {legacy!r} and {both!r}, the same weights "
                              "twice (an expert is duplicated); keep one format: export it again from its run")
    return [Part(name, full_box(shape))]


def model_sources(reader: CheckpointReader, model: nn.Module, parts: dict[str, list[Part]] | None = None,
                  probe: str = "") -> dict[str, list[Part]]:
    """`sources` of every tensor of `model`; without `parts`, every tensor is stored whole under its name."""
    tensors = model_tensors(model)
    if parts is None:
        return {name: [Part(name, full_box(tuple(t.shape)))] for name, t in tensors.items()}
    return {name: sources(reader, name, tuple(t.shape), parts[name], probe) for name, t in tensors.items()}


def check_experts(reader: CheckpointReader, model: nn.Module, what: str = "checkpoint") -> None:
    """Refuse model files in which any expert of a MoE model is missing, duplicated or out of range,
    naming the key (expert_keys.key_problems); counts keys over every model file, not the index alone."""
    config = getattr(hf_model(model), "config", None)
    fmt = expert_format(config)
    if fmt is None or num_experts(config) is None:
        return
    problems = key_problems(reader.model_key_counts(), num_experts(config), fmt)
    if problems:
        more = f" ({len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
        raise CheckpointError(f"{what} {reader.directory} cannot be loaded: {problems[0]}{more}; load a "
                              "checkpoint that holds every expert once (`isotrain ckpt verify` lists every problem)")


def check_model_shapes(reader: CheckpointReader, model: nn.Module, prefix: str = "", what: str = "checkpoint",
                       hint: str = _RESUME_HINT, skip: frozenset[str] = frozenset(), strict: bool = False,
                       ignored: tuple[str, ...] = (), found: dict[str, list[Part]] | None = None,
                       elsewhere: frozenset[str] = frozenset()) -> None:
    """Refuse a checkpoint whose tensors do not match the model's names and shapes (`skip`: not loaded here).
    `elsewhere`: the model's tensors that other pipeline stages hold (known to the model, loaded there).

    `found`: where each tensor is stored (`model_sources`; by default whole under its name).
    `strict`: the model files may hold no tensor the model lacks either (a Qwen2 checkpoint's attention biases
    would otherwise be dropped without a word when loaded into a Llama); names matching a pattern of
    `ignored` (checkpoint.ignore_keys) are exempt."""
    found = model_sources(reader, model) if found is None else found
    wanted = {name: found[name] for name in model_tensors(model) if name not in skip}
    missing = [part.key for parts in wanted.values() for part in parts if f"{prefix}{part.key}" not in reader]
    if missing:
        raise CheckpointError(f"{what} {reader.directory} has no tensor {prefix}{missing[0]!r} ({len(missing)} "
                              f"missing); it was saved from a different model: {hint}")
    if strict:
        known = {part.key for parts in found.values() for part in parts} | elsewhere
        extra = sorted(key for key in reader.model_keys if key not in known and not matches(key, ignored))
        if extra:
            raise CheckpointError(f"{what} {reader.directory} holds {len(extra)} tensor(s) the model does not have, "
                                  f"first {extra[0]!r}; it was saved from a different model: {hint}, or list them "
                                  "in checkpoint.ignore_keys to load the rest on purpose")
    for parts in wanted.values():
        for part in parts:
            saved = reader.shape(f"{prefix}{part.key}")
            if saved != part.shape:
                raise CheckpointError(f"{what} {reader.directory} has {part.key} of shape {list(saved)} but the model "
                                      f"has {list(part.shape)}; {hint}")


def matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def part_reads(parts: list[Part], target: torch.Tensor, rank: int) -> list[tuple[Part, Box | None, torch.Tensor]]:
    """What this rank reads to fill its block of `target` (a plain tensor or DTensor): for each saved part it
    holds some of, (part, the block of the part to read, the memory it goes to). Generic over placements:
    an expert's part is read by the ranks whose block of the fused tensor holds its rows (FSDP2's or expert
    parallelism's `Shard(0)`), each reading only its own rows and columns."""
    local, shape = local_part(target), tuple(target.shape)
    if is_whole(parts, shape):
        return [(parts[0], _box(target, rank), local)]
    spec = shard_spec(target)
    own = spec.box(rank) if spec is not None else full_box(shape)
    reads = []
    for part in parts:
        box = within(own, part)
        if not is_empty(box):
            reads.append((part, box, part_view(local, own, part)))
    return reads


def _read_parts(reader: CheckpointReader, prefix: str, parts: list[Part], target: torch.Tensor, rank: int) -> None:
    with torch.no_grad():
        for part, box, into in part_reads(parts, target, rank):
            reader.read_into(f"{prefix}{part.key}", into, box, kept=True)


def load_model(reader: CheckpointReader, model: nn.Module, rank: int, what: str = "checkpoint",
               hint: str = _RESUME_HINT, skip: frozenset[str] = frozenset(), strict: bool = False,
               ignored: tuple[str, ...] = (), elsewhere: frozenset[str] = frozenset()) -> None:
    """Weights from the fp32 master copies when the model files are in a lower precision; each rank
    reads its own part of each tensor. `skip`: tensors the caller fills itself. With `strict`, names and
    shapes must match both ways (`elsewhere`: tensors of the model that other pipeline stages hold); tensors
    matching `ignored` are neither required nor loaded (they keep the model's own values). A MoE model's
    experts come from their per-expert keys (or, in older checkpoints, the fused tensors), every expert present
    exactly once (`check_experts`)."""
    skip = skip | {name for name in model_tensors(model) if matches(name, ignored)}
    tensors = {name: t for name, t in model_tensors(model).items() if name not in skip}
    check_experts(reader, model, what)
    found = model_sources(reader, model, model_parts(model))
    floating = [name for name in tensors if tensors[name].is_floating_point()]
    use_master = bool(floating) and all(f"master.{part.key}" in reader for name in floating for part in found[name])
    check_model_shapes(reader, model, what=what, hint=hint, skip=skip, strict=strict, ignored=ignored, found=found,
                       elsewhere=elsewhere)
    for name, tensor in tensors.items():
        _read_parts(reader, "master." if use_master and tensor.is_floating_point() else "", found[name], tensor, rank)


def load_hf_weights(directory: Path, model: nn.Module, rank: int, skip: frozenset[str] = frozenset()) -> None:
    """Load a Hugging Face model directory (`save_pretrained`'s model.safetensors, or shards and their
    index) into a model already parallelised on any layout, each rank reading only its own part.

    The model's tensors must exist (after building on the meta device, `to_empty` them first); tied
    weights are one parameter, stored once under the name the model reports.
    """
    directory = Path(directory)
    meta = [name for name, tensor in model_tensors(model).items() if tensor.is_meta]
    if meta:
        raise CheckpointError(f"cannot load {directory} into {meta[0]!r}, which is still on the meta device; "
                              "allocate the model with to_empty(device=...) before loading weights")
    reader = CheckpointReader(directory)
    try:
        if not reader.keys():
            raise CheckpointError(f"{directory} holds no model.safetensors or model.safetensors.index.json; "
                                  "point to a Hugging Face model directory saved with safetensors")
        load_model(reader, model, rank, what="model directory",
                   hint="point to the directory of this model (the same config.json)", skip=frozenset(skip))
    finally:
        reader.close()


def _new_moments(param: torch.Tensor) -> dict[str, torch.Tensor]:
    """Zeroed moment tensors in the parameter's layout: the zeroing is what page-faults them in."""
    return {key: torch.zeros_like(param, memory_format=torch.preserve_format)
            for key in OPTIMIZER_STATE_KEYS if key != "step"}


def load_optimizer(reader: CheckpointReader, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int,
                   prefix: str = "") -> None:
    """AdamW moments and step per saved tensor name (a MoE expert's moments per expert), each in this rank's
    layout; a `prefix` names another model of the run (its tensors stored whole).

    The moments are new memory, and faulting it in costs about a quarter of the read time: a
    second thread allocates them ahead of the reads, so the faults overlap the disk.
    """
    names = {id(p): n for n, p in model_tensors(model).items()}
    parts = model_parts(model) if not prefix else None
    found = model_sources(reader, model, parts, probe="step.")
    params = [param for group in optimizer.param_groups for param in group["params"]]
    for param in params:
        for part in found[names[id(param)]]:
            if f"step.{prefix}{part.key}" not in reader:
                raise CheckpointError(
                    f"checkpoint {reader.directory} has no optimizer state for {prefix}{part.key!r}; it is not a "
                    "training checkpoint of this model: set checkpoint.load_only=model to start from its weights only"
                )
    plans = [part_reads(found[names[id(param)]], param, rank) for param in params]
    reads = [(f"{key}.{prefix}{part.key}", box) for plan in plans for key in OPTIMIZER_STATE_KEYS if key != "step"
             for part, box, _ in plan]  # moments share their parameter's layout
    # torch's own rule (Optimizer.load_state_dict): a fused or capturable AdamW keeps `step` on the parameter's
    # device (its CUDA kernel reads it there), any other on the CPU.
    on_device = {id(p) for group in optimizer.param_groups if group.get("fused") or group.get("capturable")
                 for p in group["params"]}
    ahead = ReadAhead(reader, reads)
    with ThreadPoolExecutor(max_workers=1) as allocator:
        moments = [allocator.submit(_new_moments, param) for param in params]
        index = 0
        for param, allocated in zip(params, moments):
            name = names[id(param)]
            state = allocated.result()
            for key, tensor in state.items():
                for part, box, into in part_reads(found[name], tensor, rank):
                    ahead.before(index)
                    reader.read_into(f"{key}.{prefix}{part.key}", into, box, kept=True)
                    index += 1
            step = reader.read(f"step.{prefix}{found[name][0].key}").clone()
            state["step"] = step.to(param.device) if id(param) in on_device else step
            optimizer.state[param] = {key: state[key] for key in OPTIMIZER_STATE_KEYS}


def load_adapter(reader: CheckpointReader, model: nn.Module, rank: int) -> None:
    """The trainable LoRA tensors of a LoRA run (its base weights come from model.name_or_path)."""
    for name, tensor in model_tensors(model).items():
        if not tensor.requires_grad:
            continue
        if f"adapter.{name}" not in reader:
            raise CheckpointError(
                f"checkpoint {reader.directory} has no LoRA adapter tensor {name!r}; it was not saved by a LoRA run "
                "with these lora settings: start from its weights with model.name_or_path set to it"
            )
        _read_into(reader, f"adapter.{name}", tensor, rank)


def load_component(reader: CheckpointReader, prefix: str, model: nn.Module, optimizer: torch.optim.Optimizer,
                   rank: int) -> None:
    """Another trained model of the run (PPO's critic) and its optimizer state, saved as `<prefix>.<name>`."""
    check_model_shapes(reader, model, prefix=f"{prefix}.")
    for name, tensor in model_tensors(model).items():
        _read_into(reader, f"{prefix}.{name}", tensor, rank)
    load_optimizer(reader, model, optimizer, rank, prefix=f"{prefix}.")

