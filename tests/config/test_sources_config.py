"""data.sources: the schema of a weighted mixture, its checks and its command-line replacement of data.path."""

import pytest

from isotrain.config import load_config
from isotrain.errors import ConfigError


def test_sources_parse_with_defaults_and_names(tmp_path):
    cfg = load_config(None, ["data.sources=[{path: web/*.jsonl.gz, weight: 3}, {path: code/}, "
                             "{path: chat.parquet, format: chat, name: dialogue}]"])
    assert cfg.data.path == ""  # the bundled recipe's data.path was replaced by the command line's sources
    assert [(s.label, s.weight, s.format) for s in cfg.data.sources] == [
        ("web", 3.0, None), ("code", 1.0, None), ("dialogue", 1.0, "chat")]
    config = tmp_path / "mixture.yaml"
    config.write_text("model:\n  config: {model_type: llama}\ndata:\n  sources:\n    - {path: a.jsonl}\n")
    back = load_config(config, ["data.path=b.jsonl"])  # the command line's data.path replaces the file's sources
    assert back.data.path == "b.jsonl" and back.data.sources is None
    with pytest.raises(ConfigError, match=r"^data.path='b.jsonl' and data.sources are both set; keep one of them"):
        load_config(None, ["data.sources=[{path: a.jsonl}]", "data.path=b.jsonl"])  # both on the command line


@pytest.mark.parametrize("overrides, message", [
    (["data.sources=[{path: a.jsonl, weight: -1}]"], "data.sources[0].weight=-1 must be > 0"),
    (["data.sources=[{path: a.jsonl, weight: .nan}]"], "data.sources.0.weight"),
    (["data.sources=[]"], "data.sources is an empty list"),
    (["data.sources=[{path: a.jsonl, wieght: 2}]"], "unknown config key 'data.sources[0].wieght'; did you mean "
                                                    "data.sources[0].weight?"),
    (["data.sources=[{path: x/a.jsonl}, {path: y/a.jsonl.gz}]"],
     "data.sources[0] and data.sources[1] are both named 'a' (in logs and metrics); give one of them another `name`"),
    (["data.sources=[{path: a.jsonl, format: chat}]", "data.overflow=split"],
     "data.overflow=split applies to data.format=text only: a piece of a chat row"),
])
def test_bad_sources_are_one_sentence(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


BERT = "model.config.model_type=bert"


def test_embed_reads_sources_of_pairs_and_only_train_prepares_a_store():
    cfg = load_config(None, [BERT, "data.sources=[{path: a.jsonl, weight: 2}, {path: b.jsonl}]"], recipe="embed")
    assert [(s.label, s.weight) for s in cfg.data.sources] == [("a", 2.0), ("b", 1.0)]
    with pytest.raises(ConfigError) as err:
        load_config(None, [BERT, "data.sources=[{path: a.jsonl, format: chat}]"], recipe="embed")
    assert str(err.value) == ("data.sources[0].format=chat is not read by isotrain embed, whose rows are {query, "
                              "positive, negatives} pairs; remove the format")
    for recipe in ("rl", "embed"):
        with pytest.raises(ConfigError) as err:
            load_config(None, ["data.prepare_workers=4"], recipe=recipe)
        assert str(err.value) == ("data.prepare_workers is not read by isotrain " + recipe + ": isotrain rl and embed "
                                  "read their rows in the run's process, without a token store to prepare; remove it")
