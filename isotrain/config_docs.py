"""Render the config reference (docs/config.md) from the field descriptions of `isotrain.config`.

The typed config trees (one root per recipe, RECIPE_ROOTS) are the one source of truth: this module only
walks them, so the reference
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

from isotrain.config import RECIPE_ROOTS, list_item_section

DOCS_PATH = Path(__file__).resolve().parent.parent / "docs" / "config.md"

HEADER = """\
# Config reference

<!-- Generated from the field descriptions in isotrain/config.py by `python -m isotrain.config_docs`.
     Do not edit by hand: tests/test_docs.py fails when this file and the code disagree. -->

Every key can be set in a YAML config or on the command line as `key.sub=value`
(`isotrain train CONFIG.yaml train.lr=1e-3`). Unknown keys are rejected with a did-you-mean hint.
Each command reads its own config tree: a section that another command reads (e.g. `rl` given to
`isotrain train`) is refused, naming the command it belongs to.
`isotrain config show [CONFIG.yaml] [overrides] [--recipe train|rl|embed]` prints the resolved config
and the derived sizes.
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
    """(dotted prefix, model) of every section in declaration order, depth first; the items of a list of
    sections (`data.sources`) as `data.sources[].`."""
    found = [(prefix, model)]
    for name, field in model.model_fields.items():
        if _is_section(field.annotation):
            found += _sections(field.annotation, f"{prefix}{name}.")
        item = list_item_section(field.annotation)
        if item is not None:
            found += _sections(item, f"{prefix}{name}[].")
    return found


def _commands(recipes: list[str]) -> str:
    return ", ".join(f"`isotrain {recipe}`" for recipe in recipes)


def _recipe_table() -> list[str]:
    """Which command reads which top-level section."""
    sections = list(dict.fromkeys(name for root in RECIPE_ROOTS.values() for name in root.model_fields))
    lines = ["| section | " + " | ".join(f"`isotrain {recipe}`" for recipe in RECIPE_ROOTS) + " |",
             "| --- |" + " --- |" * len(RECIPE_ROOTS)]
    for name in sections:
        if not _is_section(next(root for root in RECIPE_ROOTS.values() if name in root.model_fields)
                           .model_fields[name].annotation):
            continue
        marks = ["yes" if name in root.model_fields else "" for root in RECIPE_ROOTS.values()]
        lines.append(f"| `{name}` | " + " | ".join(marks) + " |")
    return lines


def _differing_rows(base: type[BaseModel], variant: type[BaseModel], prefix: str) -> list[str]:
    """The table rows of `variant` that differ from `base` (a recipe's own version of a shared section)."""
    ours, theirs = _table(base, prefix), _table(variant, prefix)
    return theirs[:2] + [row for row in theirs[2:] if row not in ours]


def render_config_reference() -> str:
    """Every section once, in the order of the roots (shared sections first), with the commands that read it;
    a section that one command reads in a version of its own (RL's `train`) lists the rows that differ."""
    parts = [HEADER, "## Sections of each command\n\n" + "\n".join(_recipe_table()) + "\n"]
    seen: dict[str, type[BaseModel]] = {}
    for recipe, root in RECIPE_ROOTS.items():
        for prefix, model in _sections(root):
            if prefix in seen:
                continue
            seen[prefix] = model
            title = f"`{prefix.rstrip('.')}`" if prefix else "Top level"
            readers = [name for name, other in RECIPE_ROOTS.items() if (prefix, model) in _sections(other)]
            variants = [(name, m) for name, other in RECIPE_ROOTS.items() for p, m in _sections(other)
                        if p == prefix and m is not model]
            if not prefix:  # the roots differ only in their sections, which the table above lists
                readers, variants = list(RECIPE_ROOTS), []
            text = f"## {title}\n\nRead by {_commands(readers)}.\n\n" + "\n".join(_table(model, prefix)) + "\n"
            for name, variant in variants:
                text += (f"\nIn `isotrain {name}` ({variant.__name__}), these keys differ:\n\n"
                         + "\n".join(_differing_rows(model, variant, prefix)) + "\n")
            parts.append(text)
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
