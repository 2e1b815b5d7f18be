"""How far the config travels: each recipe's run, traced from its entry point, stays on few floors.

A run of each recipe (one process, a tiny model, one step) is traced with `sys.setprofile`. A function call
"carries the config" when one of its arguments is the run's config or one of its sections, or when it is a
method of an object whose `cfg` is the config (the session, a recipe, the checkpoint manager). For those calls
we count

    files   the package files they run in;
    climbs  the calls from a lower layer into a higher one (test_architecture.LAYERS), e.g. a loop in a
            lower room calling back into the recipe: every climb is a place where a reader following the
            config has to go back up.

`python tests/test_config_path.py` prints every recipe's path.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from test_architecture import layer_of

PACKAGE = Path(__file__).resolve().parents[1] / "isotrain"
MAX_FILES, MAX_CLIMBS = 15, 5


def _carries(frame, targets: set[int]) -> bool:
    """An argument is the config or one of its sections, or the call is a method of an object holding the config
    (`self.cfg`: the session, a recipe, the checkpoint manager). A function that is only handed such an object
    does not read the config itself: the methods it calls are counted where they run."""
    code = frame.f_code
    names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    values = [frame.f_locals.get(name) for name in names]
    if any(id(value) in targets for value in values):
        return True
    return bool(names) and names[0] == "self" and id(getattr(values[0], "cfg", None)) in targets


def trace(run, cfg) -> tuple[dict[str, list[str]], list[tuple[str, str]]]:
    """({file: functions that carried the config} in the order first visited, climbs as distinct (caller, callee)
    modules) of `run(cfg)`."""
    from pydantic import BaseModel

    sections = [getattr(cfg, name) for name in type(cfg).model_fields]
    targets = {id(cfg), *(id(section) for section in sections if isinstance(section, BaseModel))}
    files: list[str] = []
    functions: dict[str, list[str]] = {}  # per file, the functions that carried the config
    climbs: list[tuple[str, str]] = []  # distinct (caller, callee) pairs

    def profile(frame, event, _arg):
        if event != "call":
            return
        path = frame.f_code.co_filename
        if not path.startswith(str(PACKAGE)):
            return
        code = frame.f_code
        if not _carries(frame, targets):
            return
        module = _module(path)
        if module not in files:
            files.append(module)
            functions[module] = []
        if code.co_name not in functions[module]:
            functions[module].append(code.co_name)
        caller = frame.f_back
        if caller is not None and caller.f_code.co_filename.startswith(str(PACKAGE)):
            caller_module = _module(caller.f_code.co_filename)
            if layer_of(module) > layer_of(caller_module) and (caller_module, module) not in climbs:
                climbs.append((caller_module, module))

    sys.setprofile(profile)
    try:
        run(cfg)
    finally:
        sys.setprofile(None)
    return functions, climbs


def _module(path: str) -> str:
    relative = Path(path).resolve().relative_to(PACKAGE.parent).with_suffix("")
    return ".".join(relative.parts).removesuffix(".__init__")


def _configs(tmp_path: Path) -> dict:
    from isotrain.config import load_config

    data = tmp_path / "pairs.jsonl"
    data.write_text("\n".join(json.dumps({"query": f"q {i} {'ab' * (i % 5)}", "positive": f"p {i} {'ab' * (i % 5)}"})
                              for i in range(16)) + "\n")
    tiny = ["model.config.hidden_size=32", "model.config.intermediate_size=64", "model.config.num_hidden_layers=1",
            "model.config.num_attention_heads=4", "model.config.num_key_value_heads=2", "train.max_steps=1",
            "logging.progress=false", "eval.path=null"]
    return {
        "train": load_config(None, [*tiny, "tokenizer.type=char", f"output_dir={tmp_path / 'sft'}"]),
        "rl": load_config(None, [*tiny, "model.name_or_path=null", "model.config.model_type=llama", "tokenizer.type=char", "rl.prompts_per_step=2",
                                 "rl.group_size=2", "rl.max_new_tokens=2", "train.micro_batch_size=4",
                                 f"output_dir={tmp_path / 'rl'}"], recipe="rl"),
        "embed": load_config(None, [*tiny, "model.name_or_path=null", "model.config.model_type=bert", "model.config.max_position_embeddings=64",
                                    "tokenizer.vocab_size=300", "data.max_seq_len=32", f"data.path={data}",
                                    "train.global_batch_size=8", "train.micro_batch_size=8",
                                    f"output_dir={tmp_path / 'embed'}"], recipe="embed"),
    }


def _entry(recipe: str):
    from rich.console import Console

    if recipe == "train":
        from isotrain.recipes.sft import train as run
    elif recipe == "rl":
        from isotrain.recipes.rl import rl_train as run
    else:
        from isotrain.recipes.embed import embed_train as run
    return lambda cfg: run(cfg, console=Console(quiet=True))


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["train", "rl", "embed"])
def test_the_config_stays_on_few_floors(recipe, tmp_path):
    files, climbs = trace(_entry(recipe), _configs(tmp_path)[recipe])
    assert files and next(iter(files)).startswith("isotrain.recipes.")  # the trace sees the run
    shown = f"{len(files)} files: {files}; climbs: {climbs}"
    assert len(files) <= MAX_FILES and len(climbs) <= MAX_CLIMBS, shown


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        configs = _configs(Path(tmp))
        for name, config in configs.items():
            visited, climbed = trace(_entry(name), config)
            print(f"isotrain {name}: {len(visited)} files, {len(climbed)} climbs")
            for module, names in visited.items():
                print(f"  {module}: {', '.join(names)}")
            for caller, callee in climbed:
                print(f"  climb: {caller} -> {callee}")
