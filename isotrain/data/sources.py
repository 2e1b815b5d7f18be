"""Read data rows from a file or a saved dataset and check each row against the data format.

A malformed row (bad JSON, a missing or mistyped field) is skipped, but its line (or row)
number and the reason are kept, so the caller can report it: no row is dropped silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from isotrain.errors import DataError

FORMATS = ("text", "prompt_completion", "chat")
ROLES = ("system", "user", "assistant")
SUPPORTED = ".jsonl, .json, .parquet or a directory saved with datasets.save_to_disk"


@dataclass
class RowsResult:
    rows: list[dict]
    row_ids: list[int]  # 1-based line number (.jsonl) or row number (other sources) of each kept row
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line or row number, reason)
    unit: str = "line"  # how row ids are named in messages: "line" for .jsonl, else "row"

    @property
    def num_rows_read(self) -> int:
        return len(self.rows) + len(self.skipped)


def read_rows(path: str, fmt: str, field: str = "data.path") -> RowsResult:
    """Every valid row of `path` for data format `fmt`, plus the skipped ones with reasons; messages name the
    setting `field` (data.path, eval.path) that points at the file."""
    if fmt not in FORMATS:
        raise DataError(f"data.format={fmt!r} is not supported; use one of {', '.join(FORMATS)}")
    result = sort_rows(path, field, lambda row: row_problem(row, fmt))
    if not result.rows:
        raise DataError(no_rows_message(path, fmt, len(result.skipped), result.skipped[:1], result.unit, field))
    return result


def sort_rows(path: str, field: str, problem) -> RowsResult:
    """The rows of `path` that `problem(row)` finds nothing wrong with, and the others with their reasons
    (the caller refuses a file without any usable row, in its own words)."""
    checked, unit = checked_rows(path, field, problem)
    result = RowsResult(rows=[], row_ids=[], unit=unit)
    for row_id, row, reason in checked:
        if reason is None:
            result.rows.append(row)
            result.row_ids.append(row_id)
        else:
            result.skipped.append((row_id, reason))
    return result


def checked_rows(path: str, field: str, problem):
    """(rows, unit): rows yields (row id, row, None) or (row id, None, reason) one at a time, in file order (a
    .jsonl file is read line by line; .json, .parquet and saved datasets as a whole)."""
    source = check_source(path, field)
    if source.is_dir():
        raw, unit = _enumerate(_read_saved_dataset(source, field)), "row"
    elif source.suffix == ".jsonl":
        raw, unit = _read_jsonl(source), "line"
    elif source.suffix == ".json":
        raw, unit = _enumerate(_read_json(source, field)), "row"
    else:  # .parquet, the only other kind check_source accepts
        raw, unit = _enumerate(_read_parquet(source, field)), "row"

    def rows():
        for row_id, row, error in raw:
            reason = error or problem(row)
            yield (row_id, row, None) if reason is None else (row_id, None, reason)

    return rows(), unit


def check_source(path: str, field: str = "data.path") -> Path:
    """`path` as a Path if it names a readable kind of source, else a DataError saying what to use."""
    source = Path(path)
    if not path or not source.exists():
        raise DataError(f"{field} {path!r} does not exist; point {field} at a {SUPPORTED}")
    if not source.is_dir() and source.suffix not in (".jsonl", ".json", ".parquet"):
        raise DataError(f"{field} {path!r} has an unsupported extension {source.suffix!r}; use a {SUPPORTED}")
    return source


def no_rows_message(path: str, fmt: str, num_skipped: int, first_skipped: list[tuple[int, str]], unit: str,
                    field: str) -> str:
    """What a source without one valid row is refused with (`first_skipped`: [] or [(row id, reason)])."""
    if not num_skipped:
        return f"{field} {path!r} holds no rows; add {fmt!r} rows to it or point {field} at another file"
    first_id, first_reason = first_skipped[0]
    return (
        f"{field} {path!r} has no valid {fmt!r} rows: all {num_skipped} rows were skipped "
        f"(first: {unit} {first_id}: {first_reason}); fix the rows or set data.format to match the file"
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
    """(1-based row number, row, no error) for sources that parse as a whole."""
    for i, row in enumerate(rows, start=1):
        yield i, row, None


def _read_jsonl(path: Path):
    """(1-based line number, row or None, parse error or None); blank lines are not rows."""
    with path.open("rb") as handle:
        for line_number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            try:
                yield line_number, json.loads(raw.decode("utf-8")), None
            except UnicodeDecodeError:
                yield line_number, None, "not valid UTF-8"
            except json.JSONDecodeError as err:
                yield line_number, None, f"invalid JSON ({err.msg} at column {err.colno})"


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


def _read_parquet(path: Path, field: str) -> list[dict]:
    import pyarrow
    import pyarrow.parquet

    try:
        return pyarrow.parquet.read_table(path).to_pylist()
    except (OSError, pyarrow.ArrowException) as err:
        raise DataError(f"{field} {str(path)!r} cannot be read as Parquet ({err}); re-export the file") from None


def _read_saved_dataset(path: Path, field: str) -> list[dict]:
    # `datasets` takes seconds to import, so only runs that read a saved dataset pay for it.
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError, OSError) as err:
        raise DataError(
            f"{field} {str(path)!r} is a directory but not a dataset saved with save_to_disk ({err}); "
            f"point {field} at a {SUPPORTED}"
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
    return loaded.to_list()
