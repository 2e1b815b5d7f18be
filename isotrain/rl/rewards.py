"""Verifiable rewards: (prompt, completion, reference answer) -> float, registered by name.

`rl.reward` is a built-in name from `REWARDS` or a user function given as
'package.module:function' or 'path/to/file.py:function'; `load_reward` resolves it before any
work. `score` rewards a batch; a sample whose function raises or returns a non-finite or
non-numeric value gets 0.0 and is counted, never fatal, so one bad sample cannot end a run.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import math
import numbers
import re
import sys
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from pathlib import Path
from typing import Callable

from isotrain.errors import ConfigError

RewardFn = Callable[[str, str, str], float]

# A comma between digits followed by exactly three digits: "1,234,567" -> "1234567", but the
# list "1,2" and "1,2345" keep theirs.
_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_BOX_START = re.compile(r"\\(?:boxed|fbox)\s*\{")
_TEXT_START = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\s*\{")
_LEFT_RIGHT = re.compile(r"\\(?:left|right)(?![a-zA-Z])")  # not \rightarrow
_LATEX_SPACES = re.compile(r"\\[!,;: ]")
# A decimal. The exponent has at most 3 digits and the text at most 200 characters, so
# a completion like "1e999999999" cannot make Fraction build a giant integer.
_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3})?")
_MAX_NUMBER_CHARS = 200
_FORMS = "'package.module:function' or 'path/to/file.py:function'"  # the forms of a user rl.reward
_MISSING = object()


def _braced(text: str, open_index: int) -> tuple[str, int] | None:
    r"""(content, index after the '}') of the group opening at text[open_index] == '{'; None if it
    never closes. Escaped characters (\{, \}, \\) are not braces."""
    depth, i = 0, open_index
    while i < len(text):
        char = text[i]
        if char == "\\":
            i += 2
            continue
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[open_index + 1 : i], i + 1
        i += 1
    return None


def extract_hash_answer(text: str) -> str | None:
    r"""The GSM8K-style answer after the last '####': its first non-empty line, stripped, without
    thousands commas ("1,234" -> "1234") or trailing '.'; None if there is no '####' or nothing
    follows it. Only that line is taken, so "#### 42\nHope this helps!" gives "42"."""
    index = text.rfind("####")
    if index < 0:
        return None
    line = text[index + 4 :].lstrip().split("\n", 1)[0]
    answer = _THOUSANDS_COMMA.sub("", line).strip().rstrip(".").strip()
    return answer or None


def extract_boxed(text: str) -> str | None:
    r"""Content of the last \boxed{...} or \fbox{...}, nested braces kept
    (\boxed{\frac{1}{2}} -> \frac{1}{2}); None if there is none or its braces never close."""
    starts = list(_BOX_START.finditer(text))
    if not starts:
        return None
    group = _braced(text, starts[-1].end() - 1)
    return group[0].strip() if group is not None else None


def _unwrap_text(text: str) -> str:
    r"""\text{kg} -> kg (also \textbf, \textrm, \mathrm, \mbox), nested wrappers too."""
    while (match := _TEXT_START.search(text)) is not None:
        group = _braced(text, match.end() - 1)
        if group is None:
            break
        text = text[: match.start()] + group[0] + text[group[1] :]
    return text


def _frac_parts(text: str) -> tuple[str, str] | None:
    r"""('a', 'b') of 'a/b', \frac{a}{b}, or the shorthand \frac12 (one-character arguments)."""
    if text.count("/") == 1:
        numerator, denominator = text.split("/")
        return numerator, denominator
    if not text.startswith("\\frac"):
        return None
    args, pos = [], len("\\frac")
    for _ in range(2):
        if pos >= len(text):
            return None
        group = _braced(text, pos) if text[pos] == "{" else (text[pos], pos + 1)
        if group is None:
            return None
        args.append(group[0])
        pos = group[1]
    return (args[0], args[1]) if pos == len(text) else None


def _decimal(text: str) -> Fraction | None:
    return Fraction(Decimal(text)) if _NUMBER.fullmatch(text) else None


def _as_number(text: str) -> Fraction | None:
    r"""The exact rational value of a plain, a/b or \frac number; None for anything else."""
    if len(text) > _MAX_NUMBER_CHARS:
        return None
    if (value := _decimal(text)) is not None:
        return value
    sign, body = (-1, text[1:]) if text.startswith("-") else (1, text.removeprefix("+"))
    if (parts := _frac_parts(body)) is None:
        return None
    numerator, denominator = _decimal(parts[0]), _decimal(parts[1])
    if numerator is None or not denominator:  # not numbers, or division by zero
        return None
    return sign * numerator / denominator


def normalize_answer(text: str) -> str:
    r"""A canonical form of a math answer, so that equal answers give equal strings.

    In order: \left and \right are dropped; the LaTeX spaces \! \, \; \: and '\ ' are
    dropped; \text{...} (and \textbf, \textrm, \mathrm, \mbox) is replaced by its content;
    '$' and '\$' are dropped; thousands commas go ("1,234" -> "1234"); all whitespace goes;
    \dfrac and \tfrac become \frac; trailing '.' go. Then, if what is left is a number —
    an integer, a decimal, scientific notation, 'a/b' or \frac{a}{b} (also \frac12), with a
    sign — it becomes its exact reduced value: "3.0" -> "3", "0.50", "1/2", "2/4",
    "\frac{1}{2}" and "\dfrac12" -> "1/2", "-\frac{1}{2}" -> "-1/2". Comparison is exact:
    "0.333" is not "1/3". Case, units, '%' and other LaTeX are left as they are.
    """
    text = _LEFT_RIGHT.sub("", text.strip())
    text = _LATEX_SPACES.sub("", text)
    text = _unwrap_text(text)
    text = text.replace("\\$", "").replace("$", "")
    text = _THOUSANDS_COMMA.sub("", text)
    text = "".join(text.split())
    text = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    text = text.rstrip(".")
    value = _as_number(text)
    return str(value) if value is not None else text


def answers_match(predicted: str | None, reference: str | None) -> bool:
    """Whether two answers are equal after `normalize_answer`; a missing or empty one never is."""
    if predicted is None or reference is None:
        return False
    normalized = normalize_answer(predicted)
    return normalized != "" and normalized == normalize_answer(reference)


def exact_match(prompt: str, completion: str, answer: str) -> float:
    """1.0 if the completion equals the answer up to surrounding whitespace, else 0.0."""
    return 1.0 if completion.strip() == answer.strip() else 0.0


def _reference(answer: str, extracted: str | None, marked: bool, marker: str) -> str:
    """The reference answer: the extracted one if it carries `marker`, else the answer itself."""
    if not marked:
        return answer
    if extracted is None:
        # A data problem, not the model's: score() counts it and logs this message.
        raise ValueError(f"reference answer {answer[-80:]!r} has no usable answer after {marker}")
    return extracted


def math_answer_reward(prompt: str, completion: str, answer: str) -> float:
    """The "math" reward: 1.0 if the completion's '#### x' answer equals the reference ('#### x' or plain x)
    after `normalize_answer`, else 0.0."""
    reference = _reference(answer, extract_hash_answer(answer), "####" in answer, "'####'")
    return 1.0 if answers_match(extract_hash_answer(completion), reference) else 0.0


def boxed_reward(prompt: str, completion: str, answer: str) -> float:
    r"""The "boxed" reward: 1.0 if the completion's last \boxed{x} equals the reference (boxed or plain)
    after `normalize_answer`, else 0.0."""
    marked = _BOX_START.search(answer) is not None
    reference = _reference(answer, extract_boxed(answer), marked, "\\boxed{")
    return 1.0 if answers_match(extract_boxed(completion), reference) else 0.0


REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "math": math_answer_reward,
    "boxed": boxed_reward,
}


def format_gated(fn: RewardFn, pattern: str, penalty: float = 0.0) -> RewardFn:
    """A completion that does not match the regex `pattern` (re.fullmatch on completion.strip(),
    DOTALL) gets `penalty`; otherwise fn's reward. An invalid regex -> ConfigError naming
    rl.format_pattern."""
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as err:
        raise ConfigError(f"rl.format_pattern {pattern!r} is not a valid regular expression ({err}); fix the pattern") from None

    def gated(prompt: str, completion: str, answer: str) -> float:
        if compiled.fullmatch(completion.strip()) is None:
            return penalty
        return fn(prompt, completion, answer)

    gated.__name__ = f"format_gated_{getattr(fn, '__name__', 'reward')}"
    return gated


def _import_file(path: Path):
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:8]
    name = f"isotrain_user_reward_{path.stem}_{digest}"
    module = importlib.util.module_from_spec(importlib.util.spec_from_file_location(name, path))
    sys.modules[name] = module  # dataclasses and pickling look a module up by name
    try:
        module.__spec__.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _import_reward_module(spec: str, module_part: str):
    """The module of a 'package.module:function' or 'path/to/file.py:function' spec."""
    is_path = module_part.endswith(".py") or "/" in module_part or "\\" in module_part
    path = Path(module_part).expanduser().resolve()
    if is_path and not path.is_file():
        where = "relative paths start from the working directory"
        raise ConfigError(f"rl.reward {spec!r}: file {module_part!r} does not exist; check the file path ({where})")
    try:
        return _import_file(path) if is_path else importlib.import_module(module_part)
    except ModuleNotFoundError as err:
        if not is_path and (module_part == err.name or module_part.startswith(f"{err.name}.")):
            raise ConfigError(
                f"rl.reward {spec!r}: module {module_part!r} cannot be imported; check PYTHONPATH "
                "or give the file as 'path/to/file.py:function'"
            ) from err
        missing = f"importing {module_part!r} failed because module {err.name!r} is missing"
        raise ConfigError(f"rl.reward {spec!r}: {missing}; install it") from err
    except Exception as err:  # the user's module failed at import: say so, keep the traceback
        raised = f"importing {module_part!r} raised {type(err).__name__}: {err}"
        raise ConfigError(f"rl.reward {spec!r}: {raised}; fix that module") from err


def load_reward(spec: str) -> RewardFn:
    """A built-in name, or 'package.module:function' imported at run time (also accepts a path
    'path/to/file.py:function', relative to the working directory).

    Every problem is a one-sentence ConfigError naming `rl.reward` and the bad value: an unknown
    built-in (with the built-ins and a did-you-mean), a module that cannot be imported, a missing
    attribute, something not callable or not callable as fn(prompt, completion, answer).
    """
    if spec in REWARDS:
        return REWARDS[spec]
    builtins = ", ".join(sorted(REWARDS))
    if ":" not in spec:
        close = difflib.get_close_matches(spec, list(REWARDS), n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"rl.reward {spec!r} is neither a built-in reward ({builtins}) nor of the form {_FORMS}{hint}"
        )
    module_part, _, attribute = spec.rpartition(":")
    if not module_part or not attribute:
        raise ConfigError(f"rl.reward {spec!r} must name both a module and a function, as {_FORMS}")
    target = getattr(_import_reward_module(spec, module_part), attribute, _MISSING)
    if target is _MISSING:
        raise ConfigError(f"rl.reward {spec!r}: {module_part!r} has no attribute {attribute!r}; check the function name")
    if not callable(target):
        raise ConfigError(
            f"rl.reward {spec!r} names a {type(target).__name__}, not a function; point it at a "
            "function (prompt, completion, answer) -> float"
        )
    try:
        inspect.signature(target).bind("", "", "")
    except TypeError:
        raise ConfigError(
            f"rl.reward {spec!r} has parameters {inspect.signature(target)} but is called as "
            "fn(prompt, completion, answer); give it those three parameters"
        ) from None
    except ValueError:  # some builtins have no signature; the first call will tell
        pass
    return target


@dataclass
class RewardResult:
    rewards: list[float]
    num_errors: int  # samples whose function raised or returned a non-finite / non-number value
    first_error: str | None  # "ValueError: ..." of the first failure, for the log


def _checked_reward(fn: RewardFn, prompt: str, completion: str, answer: str) -> float:
    """fn's reward as a finite float; raises for anything else (bool is a number: 0/1)."""
    value = fn(prompt, completion, answer)
    if not isinstance(value, numbers.Real):  # str, None, tensors are not
        raise TypeError(f"reward function returned {type(value).__name__}, not a number")
    reward = float(value)  # OverflowError for a huge int, counted like any other failure
    if not math.isfinite(reward):
        raise ValueError(f"reward function returned {reward}, not a finite number")
    return reward


def score(fn: RewardFn, prompts: list[str], completions: list[str], answers: list[str]) -> RewardResult:
    """Rewards of a batch; an exception (or NaN/inf, or a non-numeric return; bool is accepted
    as 0/1) on one sample gives it 0.0 and is counted, never fatal."""
    if not len(prompts) == len(completions) == len(answers):
        raise ValueError(f"score() got {len(prompts)} prompts, {len(completions)} completions, {len(answers)} answers")
    rewards: list[float] = []
    num_errors, first_error = 0, None
    for prompt, completion, answer in zip(prompts, completions, answers):
        try:
            rewards.append(_checked_reward(fn, prompt, completion, answer))
        except Exception as err:  # a reward bug on one sample must not end the run; it is counted
            rewards.append(0.0)
            num_errors += 1
            first_error = first_error or f"{type(err).__name__}: {err}"
    return RewardResult(rewards=rewards, num_errors=num_errors, first_error=first_error)
