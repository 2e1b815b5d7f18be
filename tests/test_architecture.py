"""The layout shows the architecture: rooms are stacked, imports only go down, no circles, no private names.

Every module of `isotrain` is parsed (AST: nothing is imported or run), every `import isotrain...` and
`from isotrain... import ...` in it, at the top or inside a function (a lazy import is still a dependency),
becomes an edge of the import graph. The test fails on
  (a) an import cycle between modules,
  (b) an import from a lower layer to a higher one (LAYERS below, bottom first; inside one layer any
      direction is fine as long as there is no cycle),
  (c) `from isotrain.x import _name` in another module than x (a shared name is public, or it moves).

To place a new module, add its dotted name or a package prefix to a layer: the longest prefix wins, and a
module in no layer fails the test, so every new room is placed on purpose.
"""

from __future__ import annotations

import ast
from pathlib import Path

import isotrain

PACKAGE_DIR = Path(isotrain.__file__).resolve().parent

# Bottom first. A module may import from its own layer and any layer below it.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation: errors, presets, durable files, Hub names, bundled recipes",
     ("isotrain", "isotrain.errors", "isotrain.presets", "isotrain.disk", "isotrain.hub", "isotrain.recipes",
      "isotrain.tasks")),
    ("config", ("isotrain.config", "isotrain.config_docs", "isotrain.error_catalogue")),
    ("parallel", ("isotrain.parallel",)),
    ("components: data, models, moe, derived sizes",
     ("isotrain.data", "isotrain.models", "isotrain.moe", "isotrain.sizes")),
    ("checkpoint engine", ("isotrain.checkpoint",)),
    ("train step pieces", ("isotrain.train",)),
    ("rl and embed step pieces", ("isotrain.rl", "isotrain.embed")),
    ("offline tools: ckpt, memory estimate", ("isotrain.ckpt", "isotrain.memory")),
    # The run session every recipe plugs into (it composes everything below), then the recipes themselves.
    ("run session", ("isotrain.session",)),
    ("recipes: sft, rl, embed", ("isotrain.recipes.sft", "isotrain.recipes.rl", "isotrain.recipes.embed")),
    ("cli", ("isotrain.cli", "isotrain.__main__")),
]

# Upward imports that remain on purpose, each with the reason and what would remove it:
# (importer, imported).
ALLOWED_UPWARD: set[tuple[str, str]] = {
    # build()'s last step, `load_pretrained`, reads a Hugging Face directory with the checkpoint reader (each
    # rank reads only its bytes: CheckpointReader, load_hf_weights). It goes when the composition "build,
    # parallelise, materialise, load" moves above checkpoint/ (the run session), or the loader is passed in.
    ("isotrain.models.build", "isotrain.checkpoint.load"),
}


def module_names() -> dict[str, Path]:
    modules = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        parts = ["isotrain", *path.relative_to(PACKAGE_DIR).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> tuple[set[str], list[str]]:
    """(modules of isotrain that `name` imports, `from x import _private` lines taken from another module)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found, private = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.split(".")[0] == "isotrain")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != "isotrain":
                continue
            for alias in node.names:
                if f"{source}.{alias.name}" in modules:
                    found.add(f"{source}.{alias.name}")  # a submodule
                    continue
                found.add(source)
                if alias.name.startswith("_") and not alias.name.startswith("__") and source != name:
                    private.append(f"{name} (line {node.lineno}): from {source} import {alias.name}")
    unknown = {m for m in found if m not in modules}
    assert not unknown, f"{name} imports modules that do not exist: {sorted(unknown)}"
    return found - {name}, private


def import_graph() -> tuple[dict[str, set[str]], list[str]]:
    modules = module_names()
    graph, private = {}, []
    for name, path in modules.items():
        graph[name], taken = imports_of(name, path, modules)
        private += taken
    return graph, private


def layer_of(name: str) -> int | None:
    """Index in LAYERS of the longest prefix of `name` that a layer lists."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    return best


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index_of, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index_of[node] = low[node] = len(index_of)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index_of:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index_of[nxt])
        if low[node] == index_of[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index_of:
            visit(node)
    return found


def cycle_path(graph: dict[str, set[str]], component: list[str]) -> str:
    """One concrete circle through the component's first module, as `a -> b -> a`."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node] & members):
            if nxt == start:
                return " -> ".join(paths[node] + [start])
            if nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    return " <-> ".join(component)


def test_every_module_is_in_a_layer():
    unplaced = sorted(name for name in module_names() if layer_of(name) is None)
    assert not unplaced, f"modules in no layer of tests/test_architecture.py LAYERS: {unplaced}; add them"


def test_no_import_cycles():
    graph, _ = import_graph()
    found = [cycle_path(graph, component) for component in cycles(graph)]
    assert not found, "import cycles (move the shared part into the lower module):\n  " + "\n  ".join(found)


def test_imports_only_go_down():
    graph, _ = import_graph()
    upward = []
    for importer, imported in sorted((a, b) for a, targets in graph.items() for b in targets):
        low, high = layer_of(importer), layer_of(imported)
        if low is not None and high is not None and high > low and (importer, imported) not in ALLOWED_UPWARD:
            upward.append(f"{importer} [{LAYERS[low][0]}] imports {imported} [{LAYERS[high][0]}]")
    assert not upward, "imports from a lower layer to a higher one:\n  " + "\n  ".join(upward)


def test_allow_list_has_no_stale_entries():
    graph, _ = import_graph()
    stale = sorted(edge for edge in ALLOWED_UPWARD
                   if edge[1] not in graph.get(edge[0], set()) or layer_of(edge[1]) <= layer_of(edge[0]))
    assert not stale, f"ALLOWED_UPWARD lists imports that are gone or no longer upward; remove them: {stale}"


def test_no_private_names_across_modules():
    _, private = import_graph()
    assert not private, "private names imported from another module (make them public or move them):\n  " + \
        "\n  ".join(private)
