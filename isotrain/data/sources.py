"""Read data rows from a file, a glob or directory of shards, or a saved dataset, and check each row against the
data format.

A source (`data.path`, `data.sources[].path`) is one of
    a file           .jsonl, .jsonl.gz (read through gzip), .json (a list of rows) or .parquet
    a glob           e.g. `corpus/*.jsonl.gz`: the matching files, sorted by name, are the shards
    a directory      a `datasets.save_to_disk` directory (it holds dataset_info.json, state.json or
                     dataset_dict.json), else every data file under it (hidden ones aside), sorted by relative name
    a Hub dataset    `org/name` (not a local path, no data-file suffix): every data file of the dataset repository
                     on the Hugging Face Hub, as a directory of shards; `hf://datasets/org/name[@revision]/pattern`:
                     the files the glob pattern matches in the repository (e.g. one split: `data/train-*.parquet`).
                     Fetched into the Hugging Face cache (isotrain/hub.py) by each machine's local rank 0 first
                     (`fetch_hub_data`), read from there; the offline variables are respected.

Rows are read one at a time (.jsonl and .jsonl.gz line by line, .parquet a record batch at a time, saved datasets
a batch at a time; a .json list one shard at a time), so reading a corpus needs no memory that grows with it.

Row ids: row r (1-based line number of a .jsonl, row number otherwise) of shard s is `s << SHARD_BITS | r`, so
shard 0 and a single file keep plain numbers, every id fits the token store's int64, and `row_label` names the
shard and line of any id again. The shards of one source are of one kind (JSON lines, JSON or Parquet) and of one
schema: Parquet shards must have the same columns, and a shard of which no row is valid, while it has rows, is
refused by name (a missing or renamed field), not skipped row by row.

A malformed row (bad JSON, a missing or mistyped field) is skipped, but its line (or row) number and the reason are
kept, so the caller can report it: no row is dropped silently.
"""

from __future__ import annotations

import glob
import gzip
import json
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from isotrain.errors import DataError
from isotrain.hub import is_hub_id, resolve
from isotrain.parallel.dist import local_main_first

FORMATS = ("text", "prompt_completion", "chat")
ROLES = ("system", "user", "assistant")
SUPPORTED = ".jsonl, .jsonl.gz, .json or .parquet file, a glob or directory of such shards, or a directory saved " \
    "with datasets.save_to_disk"
SUFFIXES = (".jsonl.gz", ".jsonl", ".json", ".parquet")  # the longest first: a .jsonl.gz is not a .gz of anything
KINDS = {".jsonl.gz": "JSON lines", ".jsonl": "JSON lines", ".json": "JSON", ".parquet": "Parquet"}
SAVED_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
HUB_URL = "hf://datasets/"
HUB_DATA_FILES = tuple(f"*{suffix}" for suffix in SUFFIXES)  # what a plain dataset id fetches: its data files
SHARD_BITS = 40  # up to 2**40 rows per shard and 2**23 shards in an int64 row id
PARQUET_BATCH_ROWS = 1024


@dataclass(frozen=True)
class Source:
    """What a configured path names: the files to read, in order, or a saved dataset."""

    path: str  # as configured
    files: tuple[Path, ...] = ()  # one file, or the shards of a glob or directory, sorted by `names`
    names: tuple[str, ...] = ()  # each shard's name relative to the glob's or directory's base; () for one file
    saved_dataset: bool = False  # files == (the directory,)

    @property
    def unit(self) -> str:
        """How row ids are named in messages: "line" for JSON lines, else "row"."""
        return "line" if not self.saved_dataset and _suffix(self.files[0]) in (".jsonl", ".jsonl.gz") else "row"


def row_label(row_id: int, unit: str, shards: list[str] | tuple[str, ...] = ()) -> str:
    """`line 7`, or `shard-00002.jsonl line 7` for a row of a glob or directory of shards (module docstring)."""
    if not shards:
        return f"{unit} {row_id}"
    return f"{shards[row_id >> SHARD_BITS]} {unit} {row_id & ((1 << SHARD_BITS) - 1)}"


@dataclass
class RowsResult:
    rows: list[dict]
    row_ids: list[int]  # 1-based line number (.jsonl) or row number (other sources) of each kept row (module docstring)
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line or row number, reason)
    unit: str = "line"  # how row ids are named in messages: "line" for .jsonl, else "row"
    shards: tuple[str, ...] = ()  # the shard names of a glob or directory, for row_label

    @property
    def num_rows_read(self) -> int:
        return len(self.rows) + len(self.skipped)

    def label(self, row_id: int) -> str:
        return row_label(row_id, self.unit, self.shards)


def read_rows(path: str, fmt: str, field: str = "data.path") -> RowsResult:
    """Every valid row of `path` for data format `fmt`, plus the skipped ones with reasons; messages name the
    setting `field` (data.path, eval.path) that points at the file."""
    if fmt not in FORMATS:
        raise DataError(f"data.format={fmt!r} is not supported; use one of {', '.join(FORMATS)}")
    result = sort_rows(path, field, lambda row: row_problem(row, fmt))
    if not result.rows:
        first = f"{result.label(result.skipped[0][0])}: {result.skipped[0][1]}" if result.skipped else None
        raise DataError(no_rows_message(path, fmt, len(result.skipped), first, field))
    return result


def sort_rows(path: str, field: str, problem) -> RowsResult:
    """The rows of `path` that `problem(row)` finds nothing wrong with, and the others with their reasons
    (the caller refuses a file without any usable row, in its own words)."""
    source = resolve_source(path, field)
    checked, unit = checked_rows(path, field, problem, source)
    result = RowsResult(rows=[], row_ids=[], unit=unit, shards=source.names)
    for row_id, row, reason in checked:
        if reason is None:
            result.rows.append(row)
            result.row_ids.append(row_id)
        else:
            result.skipped.append((row_id, reason))
    return result


def checked_rows(path: str, field: str, problem, source: Source | None = None):
    """(rows, unit): rows yields (row id, row, None) or (row id, None, reason) one at a time, in shard and file
    order (module docstring); a shard that has rows but no valid one is refused by name."""
    source = source or resolve_source(path, field)
    if source.saved_dataset:
        return _check(_enumerate(_read_saved_dataset(source.files[0], field)), problem), source.unit
    if len(source.files) > 1 and _suffix(source.files[0]) == ".parquet":
        _check_parquet_schemas(source, field)

    def shard_rows():
        for index, file in enumerate(source.files):
            name = source.names[index] if source.names else str(file)
            base, num_valid, first_skip = index << SHARD_BITS, 0, None
            for row_id, row, reason in _check(_read_file(file, name, field), problem):
                if reason is None:
                    num_valid += 1
                elif first_skip is None:
                    first_skip = (row_id, reason)
                yield base | row_id, row, reason
            if source.names and len(source.files) > 1 and not num_valid and first_skip:
                raise DataError(
                    f"{field} shard {name!r} has rows but not one valid row (first: {source.unit} {first_skip[0]}: "
                    f"{first_skip[1]}), so its schema differs from the other shards of {path!r}; fix or remove it")

    return shard_rows(), source.unit


def _check(raw, problem):
    for row_id, row, error in raw:
        reason = error or problem(row)
        yield (row_id, row, None) if reason is None else (row_id, None, reason)


def _suffix(path: Path) -> str:
    """The data suffix of `path` ('.jsonl.gz', '.jsonl', ...), or its last suffix if it has none of them."""
    return next((suffix for suffix in SUFFIXES if path.name.endswith(suffix)), path.suffix)


def resolve_source(path: str, field: str = "data.path") -> Source:
    """What `path` names (module docstring), else a DataError saying what to use."""
    if path and not Path(path).exists() and hub_reference(path) is not None:
        return _hub_source(path, field)
    if path and glob.has_magic(path) and not Path(path).exists():  # a file named data[1].jsonl is that file
        return _glob_source(path, field)
    source = Path(path)
    if not path or not source.exists():
        raise DataError(f"{field} {path!r} does not exist; point {field} at a {SUPPORTED}")
    if source.is_dir():
        return _directory_source(path, source, field)
    if _suffix(source) not in SUFFIXES:
        raise DataError(f"{field} {path!r} has an unsupported extension {source.suffix!r}; use a {SUPPORTED}")
    return Source(path, (source,))


def _directory_source(path: str, directory: Path, field: str) -> Source:
    if any((directory / marker).is_file() for marker in SAVED_DATASET_MARKERS):
        return Source(path, (directory,), saved_dataset=True)
    files = sorted((file for file in directory.rglob("*") if _is_shard(file, directory)),
                   key=lambda file: file.relative_to(directory).as_posix())
    if not files:  # neither shards nor a saved dataset: load_from_disk names what is missing
        return Source(path, (directory,), saved_dataset=True)
    return _shards(path, files, directory, field)


def hub_reference(path: str) -> tuple[str, str | None, str | None] | None:
    """(repo id, revision, file pattern) of a Hub dataset `path` (module docstring), or None if it names none."""
    if path.startswith(HUB_URL):
        repo, _, pattern = path[len(HUB_URL):].partition("/")
        name, _, pattern = pattern.partition("/")
        name, _, revision = name.partition("@")
        return f"{repo}/{name}", revision or None, pattern or None
    if _suffix(Path(path)) not in SUFFIXES and is_hub_id(path):
        return path, None, None
    return None


def _hub_directory(path: str, field: str, local_only: bool = False) -> tuple[Path, str | None]:
    """The snapshot directory of Hub dataset `path` in the Hugging Face cache, and its file pattern."""
    repo_id, revision, pattern = hub_reference(path)
    if not is_hub_id(repo_id):
        raise DataError(f"{field} {path!r} names no Hugging Face dataset; write hf://datasets/org/name/pattern, "
                        "e.g. hf://datasets/org/name/data/train-*.parquet, or org/name")
    directory = resolve(repo_id, revision, field=field, repo_type="dataset",
                        allow_patterns=(pattern,) if pattern else HUB_DATA_FILES, local_only=local_only)
    return directory, pattern


def _hub_source(path: str, field: str) -> Source:
    directory, pattern = _hub_directory(path, field)
    if pattern is None:
        return _directory_source(path, directory, field)
    files = [Path(match) for match in sorted(glob.glob(str(directory / pattern), recursive=True))
             if _is_shard(Path(match), directory)]
    if not files:
        raise DataError(f"{field} {path!r} matches no .jsonl, .jsonl.gz, .json or .parquet file of the dataset "
                        f"(its snapshot: {directory}); check the pattern against the repository's files")
    return _shards(path, files, directory, field)


def fetch_hub_data(paths: dict[str, str | None], local_rank: int) -> None:
    """Fetch the Hub datasets among `paths` ({field: path}) into the Hugging Face cache, on each machine's local
    rank 0 first; the machine's other ranks then read that cache only. Local paths are left alone."""
    hub = {field: path for field, path in paths.items() if path and not Path(path).exists() and hub_reference(path)}
    if hub:
        local_main_first(local_rank, lambda first: [_hub_directory(path, field, local_only=not first)
                                                    for field, path in hub.items()])


def _glob_source(pattern: str, field: str) -> Source:
    files = [Path(match) for match in sorted(glob.glob(pattern, recursive=True)) if Path(match).is_file()]
    if not files:
        raise DataError(f"{field} {pattern!r} matches no file; check the pattern, or point {field} at a {SUPPORTED}")
    # Names are relative to the pattern's fixed directories, so the key and messages do not depend on where it runs.
    fixed = []
    for part in Path(pattern).parts:
        if glob.has_magic(part):
            break
        fixed.append(part)
    base = Path(*fixed) if fixed else Path(".")
    unsupported = [file for file in files if _suffix(file) not in SUFFIXES]
    if unsupported:
        raise DataError(f"{field} {pattern!r} matches {str(unsupported[0])!r}, which is not a .jsonl, .jsonl.gz, "
                        ".json or .parquet file; narrow the pattern, e.g. to *.jsonl")
    return _shards(pattern, files, base, field)


def _is_shard(file: Path, root: Path) -> bool:
    relative = file.relative_to(root)
    return file.is_file() and _suffix(file) in SUFFIXES and not any(part.startswith(".") for part in relative.parts)


def _shards(path: str, files: list[Path], base: Path, field: str) -> Source:
    kinds = sorted({KINDS[_suffix(file)] for file in files})
    if len(kinds) > 1:
        raise DataError(f"{field} {path!r} holds shards of several kinds ({' and '.join(kinds)}); use one kind per "
                        f"source, e.g. a glob such as {str(base / '*.jsonl')!r}")
    names = tuple(_relative_name(file, base) for file in files)
    return Source(path, tuple(files), names)


def _relative_name(file: Path, base: Path) -> str:
    try:
        return file.relative_to(base).as_posix()
    except ValueError:
        return file.as_posix()


def no_rows_message(path: str, fmt: str, num_skipped: int, first_skipped: str | None, field: str) -> str:
    """What a source without one valid row is refused with (`first_skipped`: e.g. "line 1: missing 'text'")."""
    if not num_skipped:
        return f"{field} {path!r} holds no rows; add {fmt!r} rows to it or point {field} at another file"
    return (
        f"{field} {path!r} has no valid {fmt!r} rows: all {num_skipped} rows were skipped "
        f"(first: {first_skipped}); fix the rows or set data.format to match the file"
    )


def row_problem(row: object, fmt: str) -> str | None:
    """Why `row` is not a valid row of format `fmt`, or None when it is."""
    if not isinstance(row, dict):
        return f"row is a {type(row).__name__}, not an object"
    if fmt == "text":
        return _string_problem(row, "text", allow_empty=False)
    if fmt == "prompt_completion":
        return _string_problem(row, "prompt", allow_empty=True) or _string_problem(row, "completion", allow_empty=False)
    return _messages_problem(row)


def _string_problem(row: dict, key: str, allow_empty: bool) -> str | None:
    value = row.get(key)
    if value is None:
        return f"missing {key!r}"
    if not isinstance(value, str):
        return f"{key!r} must be a string, not {type(value).__name__}"
    if not allow_empty and not value:
        return f"{key!r} is empty"
    return None


def _messages_problem(row: dict) -> str | None:
    messages = row.get("messages")
    if messages is None:
        return "missing 'messages'"
    if not isinstance(messages, list) or not messages:
        return "'messages' must be a non-empty list of {role, content} objects"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{i}] is a {type(message).__name__}, not an object"
        if message.get("role") not in ROLES:
            return f"messages[{i}].role is {message.get('role')!r}; use one of {', '.join(ROLES)}"
        if not isinstance(message.get("content"), str):
            return f"messages[{i}].content must be a string"
    if not any(message["role"] == "assistant" for message in messages):
        return "no assistant turn to train on"
    return None


def _enumerate(rows):
    """(1-based row number, row, no error) for sources that are not read line by line."""
    for i, row in enumerate(rows, start=1):
        yield i, row, None


def _read_file(path: Path, name: str, field: str):
    """(row id, row or None, error or None) of one file, by its kind."""
    suffix = _suffix(path)
    if suffix == ".jsonl":
        with path.open("rb") as handle:
            yield from _read_jsonl(handle)
    elif suffix == ".jsonl.gz":
        yield from _read_jsonl_gz(path, name, field)
    elif suffix == ".json":
        yield from _enumerate(_read_json(path, field))
    else:
        yield from _enumerate(_read_parquet(path, field))


def _read_jsonl(handle):
    """(1-based line number, row or None, parse error or None); blank lines are not rows."""
    for line_number, raw in enumerate(handle, start=1):
        if not raw.strip():
            continue
        try:
            yield line_number, json.loads(raw.decode("utf-8")), None
        except UnicodeDecodeError:
            yield line_number, None, "not valid UTF-8"
        except json.JSONDecodeError as err:
            yield line_number, None, f"invalid JSON ({err.msg} at column {err.colno})"


def _read_jsonl_gz(path: Path, name: str, field: str):
    """_read_jsonl of a gzip file, decompressed as it is read."""
    try:
        with gzip.open(path, "rb") as handle:
            yield from _read_jsonl(handle)
    except gzip.BadGzipFile:
        raise DataError(f"{field} {name!r} is not gzip data although its name ends in .gz; compress it with gzip "
                        "or rename it to .jsonl") from None
    except (EOFError, zlib.error) as err:
        raise DataError(f"{field} {name!r} is a damaged or truncated gzip file ({err}); write it again") from None


def _read_json(path: Path, field: str) -> list:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise DataError(f"{field} {str(path)!r} is not UTF-8 text; save it as UTF-8 JSON") from None
    except json.JSONDecodeError as err:
        raise DataError(
            f"{field} {str(path)!r} is not valid JSON ({err.msg} at line {err.lineno}); fix it or use one "
            "object per line in a .jsonl file"
        ) from None
    if not isinstance(data, list):
        raise DataError(
            f"{field} {str(path)!r} holds a JSON {type(data).__name__}, not a list of rows; "
            "write a JSON list of objects or a .jsonl file"
        )
    return data


def _read_parquet(path: Path, field: str):
    """The rows of a Parquet file, PARQUET_BATCH_ROWS at a time."""
    import pyarrow
    import pyarrow.parquet

    try:
        for batch in pyarrow.parquet.ParquetFile(path).iter_batches(batch_size=PARQUET_BATCH_ROWS):
            yield from batch.to_pylist()
    except (OSError, pyarrow.ArrowException) as err:
        raise DataError(f"{field} {str(path)!r} cannot be read as Parquet ({err}); re-export the file") from None


def _check_parquet_schemas(source: Source, field: str) -> None:
    """Every Parquet shard has the first one's columns and types (read from the files' footers only)."""
    import pyarrow
    import pyarrow.parquet

    first = None
    for name, file in zip(source.names, source.files):
        try:
            schema = pyarrow.parquet.read_schema(file)
        except (OSError, pyarrow.ArrowException) as err:
            raise DataError(f"{field} shard {name!r} cannot be read as Parquet ({err}); re-export the file") from None
        if first is None:
            first = (name, schema)
        elif not schema.equals(first[1], check_metadata=False):
            columns = ", ".join(f"{f.name}: {f.type}" for f in schema)
            expected = ", ".join(f"{f.name}: {f.type}" for f in first[1])
            raise DataError(f"{field} shard {name!r} has columns ({columns}) but {first[0]!r} has ({expected}); "
                            f"write every shard of {source.path!r} with the same columns")


def _read_saved_dataset(path: Path, field: str):
    """The rows of a `save_to_disk` directory (its 'train' split, or its only one), a batch at a time."""
    # `datasets` takes seconds to import, so only runs that read a saved dataset pay for it.
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as err:
        raise DataError(
            f"{field} {str(path)!r} is a directory but not a dataset saved with save_to_disk, and holds no data "
            f"shards ({err}); point {field} at a {SUPPORTED}"
        ) from None
    if isinstance(loaded, datasets.DatasetDict):
        splits = list(loaded)
        if "train" in loaded:
            loaded = loaded["train"]
        elif len(splits) == 1:
            loaded = loaded[splits[0]]
        else:
            raise DataError(
                f"{field} {str(path)!r} holds splits {splits} but no 'train' split; save the training split alone"
            )
    for batch in loaded.iter(batch_size=PARQUET_BATCH_ROWS):
        yield from (dict(zip(batch, values)) for values in zip(*batch.values()))
