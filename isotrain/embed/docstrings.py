"""Build the bundled embedding data: (first line, rest) pairs of Python standard-library docstrings.

    python -m isotrain.embed.docstrings   # rewrites isotrain/recipes/data/docstrings_{train,eval}.jsonl

For every public function, class and method of the modules in MODULES (sorted by qualified name), a docstring
whose first line is a summary and whose rest says more becomes {"query": summary, "positive": rest (its first
1000 characters, whitespace collapsed)}. A pair goes to the held-out split when the first byte of the
BLAKE2b hash of its qualified name is below 26 (≈10 %), so the split does not depend on the order or number
of pairs. The Python version the bundled files were built with is named in docs/embed.md; rebuilding
with another Python can change a few docstrings.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import re
import warnings
from pathlib import Path

MODULES = ("argparse", "base64", "bisect", "calendar", "collections", "configparser", "contextlib", "copy", "csv",
           "dataclasses", "datetime", "decimal", "difflib", "email.message", "enum", "fnmatch", "fractions",
           "ftplib", "functools", "glob", "gzip", "hashlib", "heapq", "hmac", "html.parser", "http.client",
           "http.cookiejar", "imaplib", "inspect", "ipaddress", "itertools", "json", "logging", "logging.handlers",
           "mailbox", "mimetypes", "operator", "optparse", "os", "pathlib", "pickle", "pprint", "queue", "random",
           "re", "sched", "secrets", "selectors", "shlex", "shutil", "smtplib", "socket", "socketserver",
           "statistics", "string", "subprocess", "tarfile", "tempfile", "textwrap", "threading", "timeit",
           "tokenize", "traceback", "typing", "unittest.case", "urllib.parse", "urllib.request", "uuid", "warnings",
           "weakref", "xml.dom.minidom", "zipfile")
MAX_POSITIVE_CHARS = 1000


def _members(module):
    """(qualified name, object) of the public functions, classes and their methods defined in `module`."""
    for name, obj in vars(module).items():
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            yield f"{module.__name__}.{name}", obj
        elif inspect.isclass(obj):
            yield f"{module.__name__}.{name}", obj
            for attr, member in vars(obj).items():
                if not attr.startswith("_") and inspect.isfunction(member):
                    yield f"{module.__name__}.{name}.{attr}", member


def pair(doc: str | None) -> dict | None:
    """{"query": first line, "positive": the rest} of a docstring with both, else None."""
    if not doc:
        return None
    lines = inspect.cleandoc(doc).split("\n")
    query = lines[0].strip()
    rest = re.sub(r"\s+", " ", " ".join(lines[1:])).strip()
    if len(query) < 15 or len(rest) < 40:
        return None
    return {"query": query, "positive": rest[:MAX_POSITIVE_CHARS]}


def held_out(qualified_name: str) -> bool:
    return hashlib.blake2b(qualified_name.encode(), digest_size=1).digest()[0] < 26


def build() -> tuple[list[dict], list[dict]]:
    found = {}
    with warnings.catch_warnings():  # reading typing's deprecated aliases warns; their docstrings are as good
        warnings.simplefilter("ignore", DeprecationWarning)
        for module_name in MODULES:
            module = importlib.import_module(module_name)
            for qualified, obj in _members(module):
                row = pair(inspect.getdoc(obj) if not inspect.isclass(obj) else obj.__doc__)
                if row is not None:
                    found[qualified] = row
    train, evaluation, seen = [], [], set()
    for qualified in sorted(found):
        row = found[qualified]
        if row["query"] in seen:  # one pair per summary: a repeated summary would be an ambiguous query
            continue
        seen.add(row["query"])
        (evaluation if held_out(qualified) else train).append(row)
    return train, evaluation


def main() -> None:
    from isotrain.recipes import RECIPES_DIR

    train, evaluation = build()
    for name, rows in (("docstrings_train.jsonl", train), ("docstrings_eval.jsonl", evaluation)):
        path = Path(RECIPES_DIR) / "data" / name
        path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
        print(f"wrote {len(rows)} pairs -> {path}")


if __name__ == "__main__":
    main()
