"""The recipes of examples/ pass a user's dry run offline, at the world size each states: `isotrain config show`
and `isotrain estimate-memory` from the config.json of the Hub model it names (shipped in examples/configs/), read
through a Hugging Face cache that holds that file only, as a first online dry run would leave it. The memory each
recipe states in its comment is the estimate's."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import REPO
from hub_cache import offline_home, write_snapshot
from isotrain.config import load_tree

EXAMPLES = REPO / "examples"
# recipe -> (world size it states, whether estimate-memory covers its step)
RECIPES = {
    "sft_qwen3_chat.yaml": (8, True),
    "pretrain_llama_shards.yaml": (8, True),
    "grpo_qwen3_gsm8k.yaml": (8, True),
    "embed_bge_nq.yaml": (1, True),
}


def test_every_recipe_with_a_hub_model_is_listed_here():
    named = {p.name for p in EXAMPLES.glob("*.yaml") if "name_or_path" in (load_tree(p).get("model") or {})}
    assert named == set(RECIPES)


@pytest.fixture
def config_only_cache(tmp_path, monkeypatch):
    """An offline Hugging Face cache holding, for each shipped examples/configs/<org>--<name>/config.json, the
    repository org/name with that file alone."""
    home = tmp_path / "hf-home"
    for config in sorted((EXAMPLES / "configs").glob("*/config.json")):
        write_snapshot(home / "hub", config.parent.name.replace("--", "/", 1), {"config.json": config.read_bytes()})
    with offline_home(monkeypatch, home):
        yield home


def _cli(argv: list[str], capsys) -> tuple[int, str, str]:
    from isotrain.cli import main

    capsys.readouterr()
    with pytest.raises(SystemExit) as done:
        main(argv)
    out = capsys.readouterr()
    return done.value.code, out.out, out.err


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_recipe_passes_config_show_and_estimate_memory_offline(name, config_only_cache, capsys):
    world_size, estimated = RECIPES[name]
    recipe = EXAMPLES / name
    text = recipe.read_text()
    model = load_tree(recipe)["model"]["name_or_path"]
    assert (EXAMPLES / "configs" / model.replace("/", "--") / "config.json").is_file(), f"ship {model}'s config.json"
    assert f"--world-size {world_size}" in text or f"--nproc-per-node {world_size}" in text

    code, out, err = _cli(["config", "show", str(recipe), "--world-size", str(world_size)], capsys)
    assert code == 0, err
    assert f"# world_size: {world_size}" in out and f"name_or_path: {model}" in out

    code, out, err = _cli(["estimate-memory", str(recipe), "--world-size", str(world_size), "--device", "cuda",
                           "--json"], capsys)
    if not estimated:  # a step estimate-memory does not model is refused in one sentence
        assert code == 2 and "Traceback" not in err
        return
    assert code == 0, err
    total_gb = json.loads(out)["total_bytes"] / 1e9
    stated = re.search(r"-> ([\d.]+) GB per rank", text)
    assert stated is not None, f"{name} states no estimate"
    assert float(stated.group(1)) == round(total_gb, 1), f"{name} states {stated.group(1)} GB, the estimate is {total_gb:.2f}"

