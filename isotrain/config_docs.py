"""Render the config reference (docs/config.md) from the field descriptions of `isotrain.config`.

The typed config tree is the one source of truth: this module only walks it, so the reference
cannot say anything the code does not. `python -m isotrain.config_docs` rewrites docs/config.md;
`--check` exits 1 when the file differs from what the code would produce (tests/test_docs.py
runs the same comparison).
"""

from __future__ import annotations

import json
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from isotrain.config import Config

DOCS_PATH = Path(__file__).resolve().parent.parent / "docs" / "config.md"

HEADER = """\
# Config reference

<!-- Generated from the field descriptions in isotrain/config.py by `python -m isotrain.config_docs`.
     Do not edit by hand: tests/test_docs.py fails when this file and the code disagree. -->

Every key can be set in a YAML config or on the command line as `key.sub=value`
(`isotrain train CONFIG.yaml train.lr=1e-3`). Unknown keys are rejected with a did-you-mean hint.
`isotrain config show [CONFIG.yaml] [overrides]` prints the resolved config and the derived sizes.
"""


def _is_section(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def type_name(annotation: object) -> str:
    """A short, Markdown-table-safe name of a field type: `int`, `float or null`, `one of `a`, `b``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{value}`" for value in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(arg) for arg in args)
    if annotation is type(None):
        return "null"
    if annotation is typing.Any:
        return "any"
    if origin is not None:
        return f"{origin.__name__}[{', '.join(type_name(arg) for arg in args)}]"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    return f"`{json.dumps(value)}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(model: type[BaseModel], prefix: str) -> list[str]:
    lines = ["| key | type | default | description |", "| --- | --- | --- | --- |"]
    for name, field in model.model_fields.items():
        if _is_section(field.annotation):
            continue
        row = [f"`{prefix}{field.alias or name}`", type_name(field.annotation), default_text(field), field.description or ""]
        lines.append("| " + " | ".join(_cell(cell) for cell in row) + " |")
    return lines


def _sections(model: type[BaseModel], prefix: str = "") -> list[tuple[str, type[BaseModel]]]:
    """(dotted prefix, model) of every section in declaration order, depth first."""
    found = [(prefix, model)]
    for name, field in model.model_fields.items():
        if _is_section(field.annotation):
            found += _sections(field.annotation, f"{prefix}{name}.")
    return found


def render_config_reference() -> str:
    parts = [HEADER]
    for prefix, model in _sections(Config):
        title = f"`{prefix.rstrip('.')}`" if prefix else "Top level"
        parts.append(f"## {title}\n\n" + "\n".join(_table(model, prefix)) + "\n")
    return "\n".join(parts)


def write_or_check(path: Path, expected: str, module: str, argv: list[str]) -> int:
    """The command line of a generated docs page: rewrite `path`, or with --check exit 1 when it is stale."""
    if argv == ["--check"]:
        current = path.read_text(encoding="utf-8") if path.is_file() else None
        if current != expected:
            print(f"{path} is out of date with the code; run `python -m {module}`")
            return 1
        return 0
    if argv:
        print(f"usage: python -m {module} [--check]", file=sys.stderr)
        return 2
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(expected, encoding="utf-8")
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return write_or_check(DOCS_PATH, render_config_reference(), "isotrain.config_docs", argv)


if __name__ == "__main__":
    sys.exit(main())
