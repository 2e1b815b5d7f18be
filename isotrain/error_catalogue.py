"""Render the error catalogue (docs/errors.md): every sentence isotrain stops a run with, read from the code.

The source is the code itself: each `raise <ProjectError>(...)` (ConfigError, DataError, TrainingError,
CheckpointError, IsotrainError) and each `raise ValueError(...)` inside a config validator, whose text
the CLI prints as `error: <sentence>`. Placeholders keep the expression they are filled from, e.g.
`{path!r}`. `python -m isotrain.error_catalogue` rewrites docs/errors.md; `--check` exits 1 when it is
stale, and tests/test_docs.py fails then, so a new message cannot ship without its entry.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
DOCS_PATH = PACKAGE.parent / "docs" / "errors.md"
USER_ERRORS = {"IsotrainError", "ConfigError", "DataError", "TrainingError", "CheckpointError"}

HEADER = """\
# Error catalogue

<!-- Generated from the raise statements of the isotrain package by `python -m isotrain.error_catalogue`.
     Do not edit by hand: tests/test_docs.py fails when this file and the code disagree. -->

Every refusal below stops the command with `error: <sentence>` on stderr and exit code 2, with no
traceback (`--debug` shows one). Each sentence names the value that is wrong and the fix; `{...}` is
filled in with the actual value. [Troubleshooting](troubleshooting.md) explains the common ones.
A message built elsewhere (passed on from a check, a save or another rank) is listed where it is made.
"""


@dataclass(frozen=True)
class Entry:
    module: str
    function: str
    kind: str
    text: str


def _text(node: ast.AST) -> str | None:
    """The message template of an argument: literal text with `{expression}` placeholders."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            else:
                conversion = {-1: "", 115: "!s", 114: "!r", 97: "!a"}[value.conversion]
                parts.append("{" + ast.unparse(value.value) + conversion + "}")
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _text(node.left), _text(node.right)
        if left is not None and right is not None:
            return left + right
    if isinstance(node, ast.IfExp):
        body, orelse = _text(node.body), _text(node.orelse)
        if body is not None and orelse is not None:
            return f"{body} | {orelse}"
    return None


def _is_validator(function: ast.FunctionDef) -> bool:
    for decorator in function.decorator_list:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        name = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
        if name in ("model_validator", "field_validator"):
            return True
    return False


def _entries(path: Path) -> list[Entry]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    found: list[Entry] = []

    def add(function: str, kind: str, text: str) -> None:
        found.append(Entry(module, function, kind, " ".join(text.split())))

    def visit(node: ast.AST, function: str, validator: bool, assigned: dict[str, list[str]]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, child.name, _is_validator(child), _assignments(child))
                if child.name.endswith("_message") or child.name.startswith("_describe"):  # built here, raised elsewhere
                    for ret in ast.walk(child):
                        if isinstance(ret, ast.Return) and ret.value is not None and _text(ret.value) is not None:
                            add(child.name, "message", _text(ret.value))
                continue
            if isinstance(child, ast.Raise) and isinstance(child.exc, ast.Call):
                target = child.exc.func
                kind = target.id if isinstance(target, ast.Name) else getattr(target, "attr", "")
                if (kind in USER_ERRORS or (kind == "ValueError" and validator)) and child.exc.args:
                    argument = child.exc.args[0]
                    text = _text(argument)
                    if text is not None:
                        add(function, kind, text)
                    elif isinstance(argument, ast.Name):  # a message assigned earlier in the function
                        for assigned_text in assigned.get(argument.id, []):
                            add(function, kind, assigned_text)
            visit(child, function, validator, assigned)

    visit(tree, "(module)", False, {})
    return found


def _assignments(function: ast.AST) -> dict[str, list[str]]:
    """Message templates assigned to a plain name inside `function`, by name."""
    texts: dict[str, list[str]] = {}
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            text = _text(node.value)
            if text is not None:
                texts.setdefault(node.targets[0].id, []).append(text)
    return texts


def collect() -> list[Entry]:
    entries = []
    for path in sorted(PACKAGE.rglob("*.py")):
        entries += _entries(path)
    return entries


def render() -> str:
    parts = [HEADER]
    by_module: dict[str, list[Entry]] = {}
    for entry in collect():
        by_module.setdefault(entry.module, []).append(entry)
    for module, entries in by_module.items():
        parts.append(f"## `{module}`\n\n| raised in | message |\n|---|---|")
        for entry in entries:
            message = entry.text.replace("|", "\\|").replace("`", "'")
            parts.append(f"| `{entry.function}` | `{message}` |")
        parts.append("")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    from isotrain.config_docs import write_or_check

    argv = sys.argv[1:] if argv is None else argv
    return write_or_check(DOCS_PATH, render(), "isotrain.error_catalogue", argv)


if __name__ == "__main__":
    sys.exit(main())
