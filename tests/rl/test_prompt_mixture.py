"""data.sources for `isotrain rl`: a weighted mixture of prompt sources drawn as SFT's mixture (data/mixture.py)."""

import json

import numpy as np
import pytest

from isotrain.config import load_config
from isotrain.data.mixture import apportion
from isotrain.errors import ConfigError
from isotrain.rl.prompts import PromptStream, prompts_fingerprint, read_prompt_sources


def _write(path, prefix, n):
    path.write_text("".join(json.dumps({"prompt": f"{prefix}{i}=", "completion": str(i)}) + "\n" for i in range(n)))
    return str(path)


@pytest.fixture
def data_cfg(tmp_path):
    big, small = _write(tmp_path / "big.jsonl", "b", 12), _write(tmp_path / "small.jsonl", "s", 4)
    cfg = load_config(None, [f"data.sources=[{{path: {big}, weight: 1}}, {{path: {small}, weight: 3}}]"],
                      recipe="rl")
    return cfg.data


def test_prompts_drawn_follow_the_weights_and_do_not_depend_on_the_ranks(data_cfg):
    prompts, mixture = read_prompt_sources(data_cfg.sources, seed=5, prompts_per_round=4)
    assert prompts.prompts[:12] == [f"b{i}=" for i in range(12)] and prompts.prompts[12:] == [f"s{i}=" for i in
                                                                                             range(4)]
    # A mixture epoch holds 16 prompts: weight 3 of 4 gives the 4-prompt source 12 seats (3 own epochs of it).
    assert mixture.counts.tolist() == apportion(16, [1, 3]).tolist() == [4, 12]
    stream = PromptStream(len(prompts.prompts), 4, seed=5, mixture=mixture)
    one = [stream.round_indices(k, 0, 1) for k in range(12)]  # 3 mixture epochs of 4 rounds
    two = [stream.round_indices(k, 0, 2) + stream.round_indices(k, 1, 2) for k in range(12)]
    assert one == two
    drawn = [prompts.prompts[i] for round_ in one for i in round_]
    for epoch in range(3):
        epoch_prompts = drawn[16 * epoch : 16 * (epoch + 1)]
        assert sum(p.startswith("s") for p in epoch_prompts) == 12
        # Each own epoch of the small source is whole: its 4 prompts 3 times; the big source's 4 seats are 4 of
        # its 12 prompts, the next 4 in the next mixture epoch.
        assert sorted(p for p in epoch_prompts if p.startswith("s")) == sorted([f"s{i}=" for i in range(4)] * 3)
    assert sorted(p for p in drawn if p.startswith("b")) == sorted(f"b{i}=" for i in range(12))
    # A function of the seed: another seed, another order of the same shares.
    other = PromptStream(16, 4, seed=6, mixture=read_prompt_sources(data_cfg.sources, seed=6, prompts_per_round=4)[1])
    assert [other.round_indices(k, 0, 1) for k in range(4)] != one[:4]


def test_a_resume_needs_the_same_sources_and_weights(data_cfg):
    heavier = data_cfg.model_copy(update={"sources": [data_cfg.sources[0].model_copy(update={"weight": 2.0}),
                                                      data_cfg.sources[1]]})
    def fingerprint(cfg):
        return prompts_fingerprint(cfg.path, [(source.path, source.weight) for source in cfg.sources])

    assert fingerprint(data_cfg) == fingerprint(data_cfg.model_copy())
    assert fingerprint(heavier) != fingerprint(data_cfg)


def test_a_source_of_another_format_is_refused_for_rl():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.sources=[{path: a.jsonl, format: text}]"], recipe="rl")
    assert str(err.value) == ("data.sources[0].format=text is not read by isotrain rl, whose prompts are "
                              "prompt_completion rows ({prompt, completion}); remove the format")


def test_the_stream_without_sources_is_unchanged():
    assert np.array_equal(PromptStream(16, 4, seed=5).sampler.global_batch(1),
                          np.random.default_rng([5, 0]).permutation(16)[4:8])
