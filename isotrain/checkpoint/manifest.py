"""`manifest.json` (size and BLAKE3 piece digests of every file, written last) and the full
verification of a checkpoint.

Verification trusts nothing but the bytes: every listed file must exist with its size and hash,
no unlisted file may exist, every safetensors header must describe exactly its file, and each
index must map every tensor to a file that holds it.

Version 2 (this one) lists, per file, the BLAKE3 digest of each piece (digest.py): `{"bytes": N,
"blake3": [hex, ...], "first_piece_bytes": H}`, with `"hash": "blake3"` and `"piece_bytes"` at the
top. Version 1 manifests (written before BLAKE3) list `{"bytes": N, "sha256": hex}` per file and
are still read and verified.
"""

from __future__ import annotations

import json
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from isotrain.checkpoint.digest import HASH, LEGACY_HASH, PIECE_BYTES, file_pieces_ok, piece_ranges
from isotrain.checkpoint.files import FileEntry, read_safetensors_header, write_json
from isotrain.disk import sha256_file

MANIFEST = "manifest.json"
FORMAT = "isotrain-checkpoint"
VERSION = 2
LEGACY_VERSION = 1  # sha256 of whole files
MODEL_INDEX = "model.safetensors.index.json"
OPTIMIZER_INDEX = "train_state/optimizer.safetensors.index.json"


def write_manifest(directory: Path, entries: dict[str, FileEntry], info: dict) -> FileEntry:
    """Write the manifest of `directory`; `info` says what it is (kind, step, layout)."""
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "hash": HASH,
        "piece_bytes": PIECE_BYTES,
        **info,
        "files": {name: entries[name].as_json() for name in sorted(entries)},
    }
    return write_json(directory / MANIFEST, doc)


def read_manifest(directory: Path) -> dict:
    """The manifest of a checkpoint; ValueError with the reason when missing or malformed."""
    path = directory / MANIFEST
    if not path.is_file():
        raise ValueError(f"{path} is missing")
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("files"), dict):
        raise ValueError(f"{path} is not an isotrain checkpoint manifest")
    if doc.get("version") not in (LEGACY_VERSION, VERSION):
        raise ValueError(f"{path} has format version {doc.get('version')}; this isotrain reads versions "
                         f"{LEGACY_VERSION} and {VERSION}")
    if doc["version"] == VERSION and (doc.get("hash") != HASH or doc.get("piece_bytes") != PIECE_BYTES):
        raise ValueError(f"{path} uses hash {doc.get('hash')!r} in pieces of {doc.get('piece_bytes')} bytes; "
                         f"this isotrain reads {HASH!r} in pieces of {PIECE_BYTES}")
    return doc


def is_legacy(manifest: dict) -> bool:
    """A version 1 manifest: one sha256 per whole file, no pieces to check one by one."""
    return manifest["version"] == LEGACY_VERSION


def pieces(spec: dict) -> list[tuple[int, int]]:
    """[start, stop) of each piece of a listed file (version 2)."""
    return piece_ranges(spec["bytes"], spec["first_piece_bytes"])


def hash_matches(path: Path, spec: dict, legacy: bool, header_only: bool = False) -> str | None:
    """Read `path` once and compare it with its manifest entry; the problem, or None. `header_only`:
    only the first piece (a safetensors file's header) of a version 2 entry."""
    if legacy:
        if sha256_file(path) != spec.get(LEGACY_HASH):
            return f"{path} does not match its {LEGACY_HASH} in the manifest (altered or corrupted)"
        return None
    digests, first = spec.get(HASH), spec.get("first_piece_bytes")
    if not isinstance(digests, list) or not isinstance(first, int):
        return f"{path} has no {HASH} digests in the manifest"
    return file_pieces_ok(path, spec["bytes"], first, digests, count=1 if header_only else None)


def _check_file(directory: Path, name: str, spec: dict, hash_files: bool, legacy: bool,
                defer_tensor_data: bool) -> str | None:
    path = directory / name
    if not path.is_file():
        return f"{path} is listed in the manifest but missing"
    size = path.stat().st_size
    if size != spec.get("bytes"):
        return f"{path} has {size} bytes but the manifest lists {spec.get('bytes')} (truncated or altered)"
    if not hash_files:
        return None
    return hash_matches(path, spec, legacy, header_only=defer_tensor_data and is_tensor_file(name) and not legacy)


def is_tensor_file(name: str) -> bool:
    return name.endswith(".safetensors")


def _check_index(directory: Path, index_name: str, problems: list[str]) -> None:
    path = directory / index_name
    try:
        weight_map = json.loads(path.read_text())["weight_map"]
        assert isinstance(weight_map, dict)
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        problems.append(f"{path} is not a valid index (a JSON object with a 'weight_map')")
        return
    by_file: dict[str, set[str]] = {}
    for tensor, file_name in weight_map.items():
        by_file.setdefault(file_name, set()).add(tensor)
    for file_name, names in sorted(by_file.items()):
        shard = path.parent / file_name
        try:
            stored = set(read_safetensors_header(shard)) - {"__metadata__"}
        except (OSError, ValueError):
            problems.append(f"{path} maps tensors to {shard}, which is missing or unreadable")
            continue
        if names - stored:
            problems.append(f"{shard} lacks {len(names - stored)} tensors that {path} maps to it, "
                            f"e.g. {sorted(names - stored)[0]!r}")
        if stored - names:
            problems.append(f"{path} does not list {len(stored - names)} tensors of {shard}, "
                            f"e.g. {sorted(stored - names)[0]!r}")


def verify_checkpoint(directory: Path, hash_files: bool = True, threads: int = 2,
                      defer_tensor_data: bool = False) -> list[str]:
    """Every problem found in a checkpoint (or model) directory, one sentence each; [] when it is valid.

    `defer_tensor_data`: hash every file but the data pieces of safetensors files (their headers
    are hashed), which a resume checks while it loads them (`onepass.py`); no effect on a version 1
    manifest, whose whole-file sha256 can only be checked here."""
    directory = Path(directory)
    if not directory.is_dir():
        return [f"{directory} is not a directory"]
    try:
        manifest = read_manifest(directory)
    except ValueError as err:
        return [str(err)]
    listed: dict[str, dict] = manifest["files"]
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        legacy = is_legacy(manifest)
        results = pool.map(lambda item: _check_file(directory, item[0], item[1], hash_files, legacy,
                                                       defer_tensor_data),
                           sorted(listed.items()))
        problems = [problem for problem in results if problem]
    present = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if p.is_file()}
    for name in sorted(present - set(listed) - {MANIFEST}):
        problems.append(f"{directory / name} is not listed in the manifest")
    for name in sorted(n for n in present & set(listed) if n.endswith(".safetensors")):
        try:
            read_safetensors_header(directory / name)
        except ValueError as err:
            problems.append(f"{directory / name} is not a valid safetensors file: {err}")
    if (directory / "model.safetensors").is_file() == (directory / MODEL_INDEX).is_file():
        problems.append(f"{directory} must hold exactly one of model.safetensors and {MODEL_INDEX}")
    if not (directory / "config.json").is_file():
        problems.append(f"{directory / 'config.json'} is missing")
    for index in (MODEL_INDEX, OPTIMIZER_INDEX):
        if (directory / index).is_file():
            _check_index(directory, index, problems)
    if manifest.get("kind") == "checkpoint" and not (directory / "train_state" / "state.json").is_file():
        problems.append(f"{directory / 'train_state' / 'state.json'} is missing")
    return problems + expert_problems(directory)


def expert_problems(directory: Path) -> list[str]:
    """For a MoE model directory: every expert of every layer held exactly once, in range (expert_keys.py),
    counted over the headers of every model file; [] for a dense model or unreadable files (named above)."""
    from isotrain.models.expert_keys import expert_format, key_problems
    from isotrain.parallel.dims import num_experts

    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return []
    fmt = expert_format(config)
    if fmt is None or num_experts(config) is None:
        return []
    counts: Counter = Counter()
    for path in sorted(directory.glob("model*.safetensors")):
        try:
            counts.update(key for key in read_safetensors_header(path) if key != "__metadata__")
        except (OSError, ValueError):
            continue
    return [f"{directory}: {problem}" for problem in key_problems(counts, num_experts(config), fmt)]
