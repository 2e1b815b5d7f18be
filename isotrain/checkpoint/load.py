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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from isotrain.checkpoint.files import SAFETENSORS_DTYPES, read_safetensors_header, tensor_view
from isotrain.checkpoint.manifest import MODEL_INDEX, OPTIMIZER_INDEX
from isotrain.checkpoint.save import CheckpointError
from isotrain.checkpoint.state import (
    OPTIMIZER_STATE_KEYS,
    Box,
    box_index,
    full_box,
    local_part,
    model_tensors,
    shard_spec,
)


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


def check_model_shapes(reader: CheckpointReader, model: nn.Module, prefix: str = "", what: str = "checkpoint",
                       hint: str = _RESUME_HINT, skip: frozenset[str] = frozenset(), strict: bool = False,
                       ignored: tuple[str, ...] = ()) -> None:
    """Refuse a checkpoint whose tensors do not match the model's names and shapes (`skip`: not loaded here).

    `strict`: the model files may hold no tensor the model lacks either (a Qwen2 checkpoint's attention biases
    would otherwise be dropped without a word when loaded into a Llama); names matching a pattern of
    `ignored` (checkpoint.ignore_keys) are exempt."""
    tensors = {name: t for name, t in model_tensors(model).items() if name not in skip}
    missing = [name for name in tensors if f"{prefix}{name}" not in reader]
    if missing:
        raise CheckpointError(f"{what} {reader.directory} has no tensor {prefix}{missing[0]!r} ({len(missing)} "
                              f"missing); it was saved from a different model: {hint}")
    if strict:
        known = set(model_tensors(model))
        extra = sorted(key for key in reader.model_keys if key not in known and not matches(key, ignored))
        if extra:
            raise CheckpointError(f"{what} {reader.directory} holds {len(extra)} tensor(s) the model does not have, "
                                  f"first {extra[0]!r}; it was saved from a different model: {hint}, or list them "
                                  "in checkpoint.ignore_keys to load the rest on purpose")
    for name, tensor in tensors.items():
        saved = reader.shape(f"{prefix}{name}")
        if saved != tuple(tensor.shape):
            raise CheckpointError(f"{what} {reader.directory} has {name} of shape {list(saved)} but the model has "
                                  f"{list(tensor.shape)}; {hint}")


def matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def load_model(reader: CheckpointReader, model: nn.Module, rank: int, what: str = "checkpoint",
               hint: str = _RESUME_HINT, skip: frozenset[str] = frozenset(), strict: bool = False,
               ignored: tuple[str, ...] = ()) -> None:
    """Weights from the fp32 master copies when the model files are in a lower precision; each rank
    reads its own part of each tensor. `skip`: tensors the caller fills itself. With `strict`, names and
    shapes must match both ways; tensors matching `ignored` are neither required nor loaded (they keep
    the model's own values)."""
    skip = skip | {name for name in model_tensors(model) if matches(name, ignored)}
    tensors = {name: t for name, t in model_tensors(model).items() if name not in skip}
    floating = [name for name in tensors if tensors[name].is_floating_point()]
    use_master = bool(floating) and all(f"master.{name}" in reader for name in floating)
    check_model_shapes(reader, model, what=what, hint=hint, skip=skip, strict=strict, ignored=ignored)
    for name, tensor in tensors.items():
        source = f"master.{name}" if use_master and tensor.is_floating_point() else name
        _read_into(reader, source, tensor, rank)


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
    """AdamW moments and step per parameter name, each in this rank's layout.

    The moments are new memory, and faulting it in costs about a quarter of the read time: a
    second thread allocates them ahead of the reads, so the faults overlap the disk.
    """
    names = {id(p): n for n, p in model_tensors(model).items()}
    params = [param for group in optimizer.param_groups for param in group["params"]]
    for param in params:
        name = prefix + names[id(param)]
        if f"step.{name}" not in reader:
            raise CheckpointError(
                f"checkpoint {reader.directory} has no optimizer state for {name!r}; it is not a training "
                "checkpoint of this model: set checkpoint.load_only=model to start from its weights only"
            )
    reads = [(f"{key}.{prefix}{names[id(param)]}", _box(param, rank)) for param in params
             for key in OPTIMIZER_STATE_KEYS if key != "step"]  # moments share their parameter's layout
    ahead = ReadAhead(reader, reads)
    with ThreadPoolExecutor(max_workers=1) as allocator:
        moments = [allocator.submit(_new_moments, param) for param in params]
        index = 0
        for param, allocated in zip(params, moments):
            name = prefix + names[id(param)]
            state = allocated.result()
            for key, tensor in state.items():
                ahead.before(index)
                _read_into(reader, f"{key}.{name}", tensor, rank)
                index += 1
            state["step"] = reader.read(f"step.{name}").clone()
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

