"""Verifiable rewards: extractors, normalisation, format gating, loading by name, batch scoring."""

import math
import textwrap

import pytest

from isotrain.errors import ConfigError
from isotrain.rl.rewards import (
    REWARDS,
    RewardResult,
    boxed_reward,
    exact_match,
    extract_boxed,
    extract_hash_answer,
    format_gated,
    load_reward,
    math_answer_reward,
    normalize_answer,
    score,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72"),
        ("#### 1,234", "1234"),
        ("#### 1,234,567.", "1234567"),
        ("#### -5", "-5"),
        ("####   3.5  \n", "3.5"),
        ("####\n  42", "42"),  # the answer may start on the next line
        ("first #### 1 then #### 2", "2"),  # the last one counts
        ("#### 42\nHope this helps!", "42"),  # only the answer's line
        ("#### 1,2", "1,2"),  # not a thousands separator
        ("#### 3/4", "3/4"),
        ("The answer is 72.", None),
        ("", None),
        ("the answer: ####", None),
        ("#### .", None),
    ],
)
def test_extract_hash_answer(text, expected):
    assert extract_hash_answer(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        (r"so $\boxed{42}$.", "42"),
        (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
        (r"\boxed{\frac{\sqrt{3}}{2}} done", r"\frac{\sqrt{3}}{2}"),
        (r"\boxed{1} wait, no: \boxed{2}", "2"),  # the last one counts
        (r"\fbox{7}", "7"),
        (r"\boxed { 5 }", "5"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces are not structure
        (r"\boxed{-3}", "-3"),
        (r"\boxed{}", ""),
        (r"\boxed{\frac{1}{2}", None),  # unbalanced
        (r"\boxed{1} and \boxed{2", None),  # the last one is unbalanced: no fallback to an earlier one
        ("no box here", None),
        (r"\boxed 5", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3.0", "3"),
        (" 3 ", "3"),
        ("0.5", "1/2"),
        ("0.50", "1/2"),
        (".5", "1/2"),
        ("2/4", "1/2"),
        (r"\frac{1}{2}", "1/2"),
        (r"\dfrac12", "1/2"),
        (r"\tfrac{1}{2}", "1/2"),
        ("-0.5", "-1/2"),
        (r"-\frac{1}{2}", "-1/2"),
        (r"\frac{-1}{2}", "-1/2"),
        ("+7", "7"),
        ("-0", "0"),
        ("1e3", "1000"),
        ("1,234", "1234"),
        ("$1,234.$", "1234"),
        (r"\$5", "5"),
        (r"1\!000", "1000"),
        (r"\text{ 12 }", "12"),
        (r"12\text{ kg}", "12kg"),
        (r"\left( 1, 2 \right)", "(1,2)"),
        (r"x \rightarrow y", r"x\rightarrowy"),  # \right inside \rightarrow is kept
        (r"\frac{\sqrt{3}}{2}", r"\frac{\sqrt{3}}{2}"),  # not a number: text, normalised
        (r"\dfrac{\pi}{2}", r"\frac{\pi}{2}"),
        ("1/0", "1/0"),  # no division by zero
        ("1e999999999", "1e999999999"),  # no giant integer
        ("Yes", "Yes"),  # case is kept
        ("", ""),
    ],
)
def test_normalize_answer(text, expected):
    assert normalize_answer(text) == expected


def test_equal_numbers_normalise_equal():
    forms = ["0.5", "0.50", "1/2", "2/4", r"\frac{1}{2}", r"\dfrac12", r"$\frac{1}{2}$"]
    assert {normalize_answer(form) for form in forms} == {"1/2"}
    assert normalize_answer("3.0") == normalize_answer("3") == normalize_answer("3.")
    assert normalize_answer("0.333") != normalize_answer("1/3")  # exact, no tolerance


def test_exact_match():
    assert exact_match("p", "  Paris\n", "Paris") == 1.0
    assert exact_match("p", "paris", "Paris") == 0.0
    assert exact_match("p", "", "Paris") == 0.0


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("48 + 24 = 72\n#### 72", "72", 1.0),
        ("#### 72", "Natalia sold 72.\n#### 72", 1.0),  # a GSM8K reference with its reasoning
        ("#### 1,234.00", "#### 1234", 1.0),
        ("#### 0.5", "1/2", 1.0),
        ("#### -3", "-3.0", 1.0),
        ("#### 71", "72", 0.0),
        ("the answer is 72", "72", 0.0),  # no '####'
        ("#### 72", "#### -72", 0.0),
    ],
)
def test_math_answer_reward(completion, answer, expected):
    assert math_answer_reward("prompt", completion, answer) == expected


def test_math_reward_with_an_empty_reference_marker_raises_for_score_to_count():
    with pytest.raises(ValueError, match="no usable answer after '####'"):
        math_answer_reward("p", "#### 1", "reasoning but #### ")


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        (r"so \boxed{\frac{1}{2}}", r"\boxed{0.5}", 1.0),
        (r"\boxed{\dfrac12}", "1/2", 1.0),
        (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt{3}}{2}", 1.0),
        (r"\boxed{3} no wait \boxed{4}", "4", 1.0),
        (r"\fbox{1,000}", "1000", 1.0),
        (r"\boxed{3} no wait \boxed{4}", "3", 0.0),
        (r"\boxed{4", "4", 0.0),  # unbalanced
        ("4", "4", 0.0),  # no box
        (r"\boxed{}", r"\boxed{}", 0.0),  # an empty answer is never right
    ],
)
def test_boxed_reward(completion, answer, expected):
    assert boxed_reward("prompt", completion, answer) == expected


def test_builtin_registry():
    assert REWARDS == {"exact_match": exact_match, "math": math_answer_reward, "boxed": boxed_reward}


def test_format_gated():
    gated = format_gated(math_answer_reward, r"<think>.*</think>.*#### .+", penalty=-1.0)
    assert gated("p", "<think>6*7\n=42</think>\n#### 42\n", "42") == 1.0  # DOTALL, stripped
    assert gated("p", "<think>6*7</think> #### 41", "42") == 0.0  # format right, answer wrong
    assert gated("p", "#### 42", "42") == -1.0  # answer right, format wrong
    assert format_gated(exact_match, "a+")("p", "aab", "aab") == 0.0  # fullmatch, not search


def test_format_gated_invalid_regex():
    with pytest.raises(ConfigError) as info:
        format_gated(exact_match, "<think>(.*</think>")
    message = str(info.value)
    assert message.startswith("rl.format_pattern '<think>(.*</think>' is not a valid regular expression")
    assert message.endswith("; fix the pattern")


def test_load_builtin():
    assert load_reward("math") is math_answer_reward
    assert load_reward("boxed") is boxed_reward
    assert load_reward("exact_match") is exact_match


def test_load_misspelled_builtin_suggests_the_right_one():
    with pytest.raises(ConfigError) as info:
        load_reward("exact-match")
    assert str(info.value) == (
        "rl.reward 'exact-match' is neither a built-in reward (boxed, exact_match, math) nor of the "
        "form 'package.module:function' or 'path/to/file.py:function'; did you mean 'exact_match'?"
    )
    with pytest.raises(ConfigError, match=r"did you mean 'math'\?$"):
        load_reward("maths")
    with pytest.raises(ConfigError) as info:
        load_reward("bleu")
    assert "did you mean" not in str(info.value) and "(boxed, exact_match, math)" in str(info.value)


REWARD_MODULE = """
    from dataclasses import dataclass

    @dataclass
    class Weights:  # a dataclass needs its module in sys.modules
        length: float = 0.01

    def short_is_good(prompt, completion, answer):
        return 1.0 - Weights().length * len(completion)

    def two_args(completion, answer):
        return 1.0

    THRESHOLD = 0.5
"""


def write_module(directory, name, source=REWARD_MODULE):
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    return path


def test_load_module_function_from_sys_path(tmp_path, monkeypatch):
    write_module(tmp_path, "my_rewards_mod")
    monkeypatch.syspath_prepend(str(tmp_path))
    fn = load_reward("my_rewards_mod:short_is_good")
    assert fn("p", "abc", "x") == pytest.approx(0.97)


def test_load_file_path_function(tmp_path, monkeypatch):
    (tmp_path / "sub").mkdir()
    path = write_module(tmp_path / "sub", "file_rewards")
    assert load_reward(f"{path}:short_is_good")("p", "a", "x") == pytest.approx(0.99)
    monkeypatch.chdir(tmp_path)  # a relative path starts from the working directory
    assert load_reward("sub/file_rewards.py:short_is_good")("p", "", "x") == 1.0


def test_load_missing_module():
    with pytest.raises(ConfigError) as info:
        load_reward("no_such_pkg_xyz.rewards:fn")
    assert str(info.value) == (
        "rl.reward 'no_such_pkg_xyz.rewards:fn': module 'no_such_pkg_xyz.rewards' cannot be imported; "
        "check PYTHONPATH or give the file as 'path/to/file.py:function'"
    )


def test_load_missing_file(tmp_path):
    spec = f"{tmp_path}/nope.py:fn"
    with pytest.raises(ConfigError) as info:
        load_reward(spec)
    assert str(info.value) == (
        f"rl.reward {spec!r}: file '{tmp_path}/nope.py' does not exist; check the file path "
        "(relative paths start from the working directory)"
    )


def test_load_module_whose_dependency_is_missing(tmp_path, monkeypatch):
    write_module(tmp_path, "needs_dep", "import no_such_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="module 'no_such_dependency_xyz' is missing; install it$"):
        load_reward("needs_dep:fn")


def test_load_module_that_raises_on_import(tmp_path):
    path = write_module(tmp_path, "broken", "raise RuntimeError('no GPU here')\n")
    with pytest.raises(ConfigError) as info:
        load_reward(f"{path}:fn")
    assert str(info.value).endswith("raised RuntimeError: no GPU here; fix that module")


@pytest.mark.parametrize("module, spec, message", [
    ("attr_rewards", "attr_rewards:short_is_bad",
     "rl.reward 'attr_rewards:short_is_bad': 'attr_rewards' has no attribute 'short_is_bad'; check the function name"),
    ("const_rewards", "const_rewards:THRESHOLD",
     "rl.reward 'const_rewards:THRESHOLD' names a float, not a function; "
     "point it at a function (prompt, completion, answer) -> float"),
    ("sig_rewards", "sig_rewards:two_args",
     "rl.reward 'sig_rewards:two_args' has parameters (completion, answer) but is called as "
     "fn(prompt, completion, answer); give it those three parameters"),
], ids=["missing-attribute", "not-callable", "wrong-parameters"])
def test_load_names_a_bad_function(tmp_path, monkeypatch, module, spec, message):
    write_module(tmp_path, module)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as info:
        load_reward(spec)
    assert str(info.value) == message


@pytest.mark.parametrize("spec", [":fn", "module:", ":"])
def test_load_incomplete_spec(spec):
    with pytest.raises(ConfigError, match=f"rl.reward '{spec}' must name both a module and a function"):
        load_reward(spec)


def test_score_counts_failures_and_scores_the_rest():
    def flaky(prompt, completion, answer):
        if completion == "boom":
            raise ValueError("cannot parse 'boom'")
        if completion == "nan":
            return math.nan
        return math_answer_reward(prompt, completion, answer)

    result = score(flaky, ["p"] * 4, ["#### 1", "boom", "nan", "#### 3"], ["1", "2", "3", "4"])
    assert result == RewardResult(rewards=[1.0, 0.0, 0.0, 0.0], num_errors=2, first_error="ValueError: cannot parse 'boom'")


def test_score_rejects_non_numbers_and_accepts_bools():
    returns = iter([True, False, "1.0", None, math.inf, 10**400, 2])
    result = score(lambda p, c, a: next(returns), *(["x"] * 7,) * 3)
    assert result.rewards == [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 2.0]
    assert result.num_errors == 4
    assert result.first_error == "TypeError: reward function returned str, not a number"
    assert all(type(reward) is float for reward in result.rewards)


def test_score_of_an_empty_batch():
    assert score(exact_match, [], [], []) == RewardResult(rewards=[], num_errors=0, first_error=None)
