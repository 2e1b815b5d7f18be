"""Read a committed checkpoint into a model and optimizer of any layout.

Each rank reads only what it holds: whole tensors under DDP or one process, its dim-0 rows under
FSDP2 (a pread of those bytes into the rank's own tensor), so a checkpoint saved on N ranks loads on M.
"""

from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from isotrain.checkpoint.files import SAFETENSORS_DTYPES, read_safetensors_header, tensor_view
from isotrain.checkpoint.manifest import MODEL_INDEX, OPTIMIZER_INDEX
from isotrain.checkpoint.save import CheckpointError
from isotrain.checkpoint.state import OPTIMIZER_STATE_KEYS, local_part, model_tensors, shard_spec


_DTYPES = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


class CheckpointReader:
    """Tensor lookup by name across a checkpoint's model and optimizer files.

    Reads go through the safetensors headers and `pread`, never a memory map: each read lands
    directly in the tensor that keeps it.
    """

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self._where: dict[str, Path] = {}
        self._files: dict[Path, tuple[int, int, dict]] = {}  # fd, first data byte, header
        self._index(MODEL_INDEX, "model.safetensors")
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

    def _locate(self, key: str, rows: tuple[int, int] | None):
        """(path, fd, first data byte, header entry, begin, end): where tensor `key` (or its rows) lies."""
        path = self._where[key]
        fd, data_start, header = self._file(path)
        spec = header[key]
        begin, end = spec["data_offsets"]
        if rows is not None and spec["shape"]:
            row_bytes = (end - begin) // spec["shape"][0] if spec["shape"][0] else 0
            begin, end = begin + rows[0] * row_bytes, begin + rows[1] * row_bytes
        return path, fd, data_start, spec, begin, end

    def prefetch(self, key: str, rows: tuple[int, int] | None = None) -> int:
        """Ask the kernel to start reading tensor `key` (or its rows) now, without waiting; returns its bytes."""
        _, fd, data_start, _, begin, end = self._locate(key, rows)
        if end > begin and hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, data_start + begin, end - begin, os.POSIX_FADV_WILLNEED)
        return end - begin

    def read_into(self, key: str, target: torch.Tensor, rows: tuple[int, int] | None = None) -> None:
        """Read tensor `key` (or its dim-0 rows) from its file straight into `target`'s memory.

        One pread per tensor and no intermediate tensor: loading is bound by the disk, not by
        copies. A target of another dtype or device goes through a CPU tensor.
        """
        path, fd, data_start, spec, begin, end = self._locate(key, rows)
        direct = (target.device.type == "cpu" and target.is_contiguous() and target.dtype == _DTYPES[spec["dtype"]]
                  and target.numel() * target.element_size() == end - begin)
        if not direct:
            target.copy_(self.read(key, rows))
            return
        view, done = tensor_view(target), 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], data_start + begin + done)
            if got == 0:
                raise CheckpointError(f"{path} ends inside tensor {key!r}; run `isotrain ckpt verify {self.directory}`")
            done += got

    def read(self, key: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `key` (or its dim-0 rows) as a new CPU tensor in its stored dtype."""
        shape = list(self.shape(key))
        if rows is not None and shape:
            shape[0] = rows[1] - rows[0]
        tensor = torch.empty(shape, dtype=self.dtype(key))
        self.read_into(key, tensor, rows)
        return tensor

    def close(self) -> None:
        for fd, _, _ in self._files.values():
            os.close(fd)
        self._files.clear()

    def state(self) -> dict:
        return json.loads((self.directory / "train_state" / "state.json").read_text())


def shard_spec_supported(tensor: torch.Tensor) -> bool:
    try:
        shard_spec(tensor)
    except NotImplementedError:
        return False
    return True


def _rows(tensor: torch.Tensor, rank: int) -> tuple[int, int] | None:
    """The dim-0 rows of `tensor` (a plain tensor or DTensor) that this rank holds; None for all."""
    spec = shard_spec(tensor)
    return spec.bounds(spec.shard_of_rank[rank]) if spec is not None else None


def _read_into(reader: CheckpointReader, key: str, target: torch.Tensor, rank: int) -> None:
    """Copy the part of tensor `key` that this rank holds into `target` (a plain tensor or DTensor)."""
    with torch.no_grad():
        reader.read_into(key, local_part(target), _rows(target, rank))


class ReadAhead:
    """Keeps the kernel reading up to `window_bytes` ahead of the tensor being read.

    A rank of a sharded layout reads only its rows of each tensor, which the kernel's own
    readahead does not take for a sequential stream; announcing the next reads keeps the disk
    busy while the current one is copied and faulted in.
    """

    def __init__(self, reader: CheckpointReader, upcoming: list[tuple[str, tuple[int, int] | None]],
                 window_bytes: int = 256 << 20):
        self.reader, self.upcoming, self.window_bytes = reader, upcoming, window_bytes
        self.starts, position = [], 0  # where each read starts in the stream of this rank's reads
        for key, rows in upcoming:
            _, _, _, _, begin, end = reader._locate(key, rows)
            self.starts.append(position)
            position += end - begin
        self.starts.append(position)
        self.announced = 0

    def before(self, index: int) -> None:
        """Call before reading entry `index` of `upcoming`."""
        limit = self.starts[index + 1] + self.window_bytes
        while self.announced < len(self.upcoming) and self.starts[self.announced] < limit:
            self.reader.prefetch(*self.upcoming[self.announced])
            self.announced += 1


def check_model_shapes(reader: CheckpointReader, model: nn.Module, prefix: str = "") -> None:
    """Refuse a checkpoint whose tensors do not match the model's names and shapes."""
    tensors = model_tensors(model)
    missing = [name for name in tensors if f"{prefix}{name}" not in reader]
    if missing:
        raise CheckpointError(
            f"checkpoint {reader.directory} has no tensor {prefix}{missing[0]!r} ({len(missing)} missing); "
            "it was saved from a different model: resume with its model.config or set checkpoint.resume=never"
        )
    for name, tensor in tensors.items():
        saved = reader.shape(f"{prefix}{name}")
        if saved != tuple(tensor.shape):
            raise CheckpointError(
                f"checkpoint {reader.directory} has {name} of shape {list(saved)} but the model has "
                f"{list(tensor.shape)}; resume with the checkpoint's model.config or set checkpoint.resume=never"
            )


def load_model(reader: CheckpointReader, model: nn.Module, rank: int) -> None:
    """Weights from the fp32 master copies when the model files are in a lower precision."""
    tensors = model_tensors(model)
    use_master = all(f"master.{name}" in reader for name in tensors if tensors[name].is_floating_point())
    check_model_shapes(reader, model)
    for name, tensor in tensors.items():
        source = f"master.{name}" if use_master and tensor.is_floating_point() else name
        _read_into(reader, source, tensor, rank)


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
    reads = [(f"{key}.{prefix}{names[id(param)]}", _rows(param, rank)) for param in params
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


def load_hf_weights(reader: CheckpointReader, model: nn.Module, rank: int, skip: set[str] = frozenset()) -> None:
    """A plain Hugging Face model directory's weights into a model of any layout (names and shapes checked);
    `skip`: tensors the caller fills itself."""
    tensors = {name: t for name, t in model_tensors(model).items() if name not in skip}
    for name, tensor in tensors.items():
        if name not in reader:
            raise CheckpointError(f"{reader.directory} has no tensor {name!r}, which this model needs; "
                                  "it holds another model: point model.name_or_path at the right directory")
        if reader.shape(name) != tuple(tensor.shape):
            raise CheckpointError(f"{reader.directory} has {name} of shape {list(reader.shape(name))} but the model "
                                  f"has {list(tensor.shape)}; point model.name_or_path at the right directory")
    for name, tensor in tensors.items():
        if shard_spec_supported(tensor):
            _read_into(reader, name, tensor, rank)
        else:
            from isotrain.models.build import copy_into

            copy_into(tensor, reader.read(name))
