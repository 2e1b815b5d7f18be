"""Reward functions that fail, for the tests of what a user sees when a reward raises (test_cli_errors.py)."""


def always_raises(prompt: str, completion: str, answer: str) -> float:
    raise ValueError(f"cannot score {answer!r}")


def raises_on_odd_answers(prompt: str, completion: str, answer: str) -> float:
    if int(answer) % 2:
        raise KeyError("odd answer")
    return float(completion.strip() == answer)
