"""One config root per recipe: another command's section is refused by name, every shipped YAML loads with its
recipe's root, presets pass validation, and a model source on the command line replaces the file's."""

import functools
import re
from pathlib import Path

import pytest

from helpers import REPO, isotrain_cli, run_concurrently
from isotrain.config import (RECIPE_ROOTS, EmbedRunConfig, RLRunConfig, TrainRunConfig, _yaml_load, build_config,
                             infer_recipe, load_config, read_yaml)
from isotrain.errors import ConfigError
from isotrain.recipes import RECIPES_DIR
from test_cli_errors import assert_error_sentence
from zygote import run_isotrain

LLAMA = {"model": {"config": {"model_type": "llama"}}}

# (command line, the sentence the user sees): each a real `isotrain` process, refused before torch is imported.
REFUSALS = {
    "rl section in train": (["train", "rl.group_size=4"],
                            "config section 'rl' belongs to isotrain rl, not isotrain train; remove rl.group_size "
                            "(or run isotrain rl)"),
    "rollout section in embed": (["embed", "model.config.model_type=bert", "rollout.batch_size=3"],
                                 "config section 'rollout' belongs to isotrain rl, not isotrain embed; remove "
                                 "rollout.batch_size (or run isotrain rl)"),
    "embed section in rl": (["rl", "embed.temperature=0.1"],
                            "config section 'embed' belongs to isotrain embed, not isotrain rl; remove "
                            "embed.temperature (or run isotrain embed)"),
    "moe section in embed": (["embed", "model.config.model_type=bert", "moe.aux_loss_coef=0.01"],
                             "config section 'moe' belongs to isotrain train and isotrain rl, not isotrain embed; "
                             "remove moe.aux_loss_coef"),
    "lora section in embed": (["embed", "model.config.model_type=bert", "lora.r=4"],
                              "config section 'lora' belongs to isotrain train and isotrain rl, not isotrain embed; "
                              "remove lora.r"),
    "typo in rl": (["rl", "rl.grup_size=4"], "unknown config key 'rl.grup_size'; did you mean rl.group_size?"),
}


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    root = tmp_path_factory.mktemp("recipes")
    return run_concurrently({name: functools.partial(isotrain_cli, [*argv, f"output_dir={root / 'run'}"], cwd=root)
                             for name, (argv, _) in REFUSALS.items()}), root


@pytest.mark.parametrize("name", list(REFUSALS))
def test_another_commands_section_is_refused_by_name(refusals, name):
    runs, root = refusals
    assert_error_sentence(runs[name], REFUSALS[name][1])  # exit code 2, this one sentence, no traceback
    assert not (root / "run").exists()


def test_each_recipe_reads_its_own_sections():
    sections = {recipe: set(root.model_fields) for recipe, root in RECIPE_ROOTS.items()}
    shared = {"output_dir", "model", "tokenizer", "data", "eval", "train", "parallel", "logging", "checkpoint"}
    assert sections == {"train": shared | {"moe", "lora"}, "rl": shared | {"moe", "lora", "rl", "rollout"},
                        "embed": shared | {"embed"}}
    with pytest.raises(ConfigError, match=re.escape("recipe 'sft' is unknown; use one of train, rl, embed")):
        build_config(LLAMA, recipe="sft")


# Every YAML config that ships, with the command it is written for.
SHIPPED = {
    RECIPES_DIR / "default.yaml": ("train", TrainRunConfig),
    RECIPES_DIR / "rl_default.yaml": ("rl", RLRunConfig),
    RECIPES_DIR / "embed_default.yaml": ("embed", EmbedRunConfig),
    REPO / "examples" / "addition.yaml": ("train", TrainRunConfig),
    REPO / "examples" / "sft_qwen3_chat.yaml": ("train", TrainRunConfig),
    REPO / "examples" / "pretrain_llama_shards.yaml": ("train", TrainRunConfig),
    REPO / "examples" / "grpo_qwen3_gsm8k.yaml": ("rl", RLRunConfig),
    REPO / "examples" / "embed_bge_nq.yaml": ("embed", EmbedRunConfig),
}


def test_every_shipped_yaml_is_listed():
    found = {*RECIPES_DIR.glob("*.y*ml"), *(REPO / "examples").glob("**/*.y*ml")}
    assert found == set(SHIPPED)


@pytest.mark.parametrize("path", list(SHIPPED), ids=lambda p: p.name)
def test_shipped_yaml_loads_with_its_recipe(path: Path):
    recipe, root = SHIPPED[path]
    # The bundled embed recipe gets its model from the `embed` extra; any model does here.
    extra = ["model.name_or_path=any/model"] if recipe == "embed" else []
    cfg = load_config(path, extra, recipe=recipe)
    assert type(cfg) is root and infer_recipe(read_yaml(path)) == recipe
    others = [other for other in RECIPE_ROOTS if other != recipe]
    if recipe != "train":  # a recipe's own section is refused by the others (train's file is also valid embed's)
        with pytest.raises(ConfigError, match=f"belongs to isotrain {recipe}, not isotrain {others[0]}"):
            load_config(path, extra, recipe=others[0])


def test_the_rl_config_of_the_docs_loads():
    text = (REPO / "docs" / "rl.md").read_text()
    block = re.search(r"```yaml\n(.*?)```", text, re.S).group(1)
    tree = _yaml_load(block)
    assert infer_recipe(tree) == "rl"
    assert build_config(tree, recipe="rl").rl.mini_batch_prompts == 16


def test_infer_recipe_reads_the_sections_only_one_recipe_has():
    assert infer_recipe({"model": {}, "train": {}}) == "train"
    assert infer_recipe({"moe": {}, "lora": {}}) == "train"
    assert infer_recipe({"rollout": {"engine": "hf"}}) == "rl"
    assert infer_recipe({"embed": {"pooling": "cls"}}) == "embed"


# --- presets are filled before validation: a preset value meets every check a value set by hand meets ---

def test_a_preset_value_is_validated(monkeypatch):
    from isotrain import presets

    monkeypatch.setitem(presets.PRESETS, "grpo", {**presets.PRESETS["grpo"], "clip_low": 1.5})
    with pytest.raises(ConfigError, match=re.escape("config value rl.clip_low=1.5 is invalid: Input should be less "
                                                    "than 1")):
        build_config({**LLAMA, "rl": {}}, recipe="rl")
    assert build_config({**LLAMA, "rl": {"clip_low": 0.1}}, recipe="rl").rl.clip_low == 0.1  # explicit wins
    monkeypatch.setitem(presets.PRESETS, "dapo", {**presets.PRESETS["dapo"], "overlong_buffer": lambda rl: -1})
    with pytest.raises(ConfigError, match=re.escape("config value rl.overlong_buffer=-1 is invalid")):
        build_config({**LLAMA, "rl": {"algorithm": "dapo"}}, recipe="rl")


def test_a_preset_is_validated_into_its_fields_type():
    rl = build_config({**LLAMA, "rl": {"algorithm": "dapo", "max_new_tokens": 40}}, recipe="rl").rl
    assert (rl.overlong_buffer, rl.clip_high, rl.dynamic_sampling) == (10, 0.28, True)
    assert type(rl.overlong_buffer) is int and type(rl.clip_high) is float
    # A preset derived from an invalid setting leaves the sentence to that setting.
    with pytest.raises(ConfigError, match=r"^config value rl.max_new_tokens='many' is invalid"):
        build_config({**LLAMA, "rl": {"algorithm": "dapo", "max_new_tokens": "many"}}, recipe="rl")


# --- the model source on the command line ---

def test_name_or_path_override_replaces_a_fresh_model_of_the_file():
    cfg = load_config(None, ["model.name_or_path=/models/mine"])  # the bundled SFT recipe sets model.config
    assert (cfg.model.name_or_path, cfg.model.config) == ("/models/mine", None)
    cfg = load_config(None, ["model.config={model_type: qwen2}"], recipe="rl")  # the bundled RL recipe: a directory
    assert (cfg.model.name_or_path, cfg.model.config) == (None, {"model_type": "qwen2"})


def test_both_model_sources_or_a_partial_mapping_are_still_refused():
    one_source = re.escape("set exactly one of model.name_or_path (a local model directory or a Hub id) or model.config")
    with pytest.raises(ConfigError, match=one_source):
        load_config(None, ["model.name_or_path=/models/mine", "model.config.hidden_size=64"])
    with pytest.raises(ConfigError, match=one_source):  # editing a mapping does not replace the file's directory
        load_config(None, ["model.config.model_type=llama"], recipe="rl")
    cfg = load_config(None, ["model.config=null", "model.name_or_path=/models/mine"])
    assert (cfg.model.name_or_path, cfg.model.config) == ("/models/mine", None)


def test_config_show_shows_each_recipes_tree(tmp_path):
    # Forked from the zygote (only stdout is read; the refusals above are ordinary launches, whose stderr holds
    # whatever a fresh interpreter prints).
    runs = run_concurrently({recipe: functools.partial(
        run_isotrain, ["config", "show", "--recipe", recipe, "model.name_or_path=/absent", "rl.group_size=4"
                       if recipe == "rl" else "train.seed=1"], cwd=tmp_path) for recipe in RECIPE_ROOTS})
    for recipe, proc in runs.items():
        assert proc.returncode == 0, proc.stderr
        shown = _yaml_load(proc.stdout.split("# derived sizes")[0])
        assert list(shown) == list(RECIPE_ROOTS[recipe].model_fields), recipe
    assert "# train.global_batch_size: 256 (rl.mini_batch_prompts × rl.group_size)" in runs["rl"].stdout
    assert _yaml_load(runs["rl"].stdout.split("# derived sizes")[0])["train"]["global_batch_size"] is None
