"""What `isotrain ckpt list|inspect` report, as plain data: the commands only print it.

Both read headers, manifests and `state.json` only, never tensor data, so they are instant on
checkpoints of any size.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from isotrain.checkpoint.files import read_safetensors_header
from isotrain.checkpoint.layout import CHECKPOINTS_DIR, committed, leftovers, read_latest, set_aside
from isotrain.checkpoint.manifest import read_manifest, verify_checkpoint
from isotrain.errors import CheckpointError

def directory_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def find_checkpoints_root(run_dir: Path) -> Path:
    """`RUN_DIR/checkpoints`, or RUN_DIR itself when it is that directory."""
    run_dir = Path(run_dir)
    if (run_dir / CHECKPOINTS_DIR).is_dir():
        return run_dir / CHECKPOINTS_DIR
    if run_dir.is_dir() and (committed(run_dir) or leftovers(run_dir) or run_dir.name == CHECKPOINTS_DIR):
        return run_dir
    raise CheckpointError(f"{run_dir} holds no checkpoints/ directory; pass the output_dir of a run")


@dataclass
class ListedCheckpoint:
    step: int
    path: Path
    num_bytes: int
    counters: dict  # tokens_seen, trained_tokens, samples_seen (empty when state.json is unreadable)
    problem: str | None  # the first problem of a quick check (sizes and headers, no sha256)
    latest: bool


@dataclass
class RunListing:
    root: Path
    checkpoints: list[ListedCheckpoint]
    leftovers: list[tuple[Path, int]]
    set_aside: list[tuple[Path, int]]
    latest: str | None


def list_run(run_dir: Path) -> RunListing:
    root = find_checkpoints_root(run_dir)
    latest = read_latest(root)
    rows = []
    for step, path in committed(root):
        problems = verify_checkpoint(path, hash_files=False)
        try:
            state = json.loads((path / "train_state" / "state.json").read_text())
            counters = {k: state[k] for k in ("tokens_seen", "trained_tokens", "samples_seen") if k in state}
        except (OSError, ValueError):
            counters = {}
        problem = problems[0].replace(f"{path}/", "") if problems else None  # the row names the checkpoint
        rows.append(ListedCheckpoint(step, path, directory_bytes(path), counters, problem, path.name == latest))
    return RunListing(root, rows, [(p, directory_bytes(p)) for p in leftovers(root)],
                      [(p, directory_bytes(p)) for p in set_aside(root)], latest)


@dataclass
class TensorInfo:
    name: str
    dtype: str
    shape: list[int]
    num_bytes: int
    file: str


@dataclass
class Inspection:
    path: Path
    manifest: dict  # kind, step, layout, ... (files removed)
    state: dict  # counters, model dtype, optimizer; {} for a model directory
    files: dict[str, int]  # name -> bytes
    model: list[TensorInfo] = field(default_factory=list)
    optimizer: list[TensorInfo] = field(default_factory=list)
    experts: str | None = None  # how a MoE model's experts are stored; None for a dense model


def describe_experts(directory: Path, keys: list[str]) -> str | None:
    """One line on a MoE model's experts: how many layers and experts, and whether they are stored per expert
    under global ids (the keys `save_pretrained` writes) or fused (older isotrain checkpoints)."""
    from isotrain.models.expert_keys import expert_format, layers_with_experts
    from isotrain.parallel.dims import num_experts

    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    fmt = expert_format(config)
    if fmt is None:
        return None
    per_expert, fused = layers_with_experts(keys, fmt)
    total = num_experts(config)
    if fused:
        return (f"{len(fused) // 2} MoE layer(s) stored fused (an older isotrain checkpoint; it loads, and "
                f"`isotrain ckpt export` writes its experts one tensor each)")
    ids = sorted(set().union(*per_expert.values())) if per_expert else []
    span = f"global ids {ids[0]}-{ids[-1]}" if ids else "none found"
    return (f"{len(per_expert)} MoE layer(s) x {total} experts ({config['model_type']}), stored one tensor per "
            f"expert and projection ({span})")


def _tensors(directory: Path, names: list[str]) -> list[TensorInfo]:
    found = []
    for name in names:
        try:
            header = read_safetensors_header(directory / name)
        except (OSError, ValueError) as err:
            raise CheckpointError(f"{directory / name} is not a readable safetensors file ({err}); "
                                  f"run `isotrain ckpt verify {directory}`") from None
        for key, spec in header.items():
            if key == "__metadata__":
                continue
            num = spec["data_offsets"][1] - spec["data_offsets"][0]
            found.append(TensorInfo(key, spec["dtype"], list(spec["shape"]), num, name))
    return found


def inspect_checkpoint(directory: Path) -> Inspection:
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory; pass a checkpoint such as RUN/checkpoints/step-00000100")
    try:
        manifest = read_manifest(directory)
    except ValueError as err:
        raise CheckpointError(f"{err}; only isotrain checkpoints and model directories can be inspected") from None
    files = {name: spec.get("bytes", 0) for name, spec in manifest["files"].items()}
    try:
        state = json.loads((directory / "train_state" / "state.json").read_text())
    except (OSError, ValueError):
        state = {}
    tensor_files = sorted(n for n in files if n.endswith(".safetensors"))
    model = _tensors(directory, [n for n in tensor_files if not n.startswith("train_state/")])
    optimizer = _tensors(directory, [n for n in tensor_files if n.startswith("train_state/")])
    info = {k: v for k, v in manifest.items() if k != "files"}
    experts = describe_experts(directory, [t.name for t in model])
    return Inspection(directory, info, state, files, model, optimizer, experts)
