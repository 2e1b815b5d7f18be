"""A reward the tiny addition model can learn in a few dozen RL steps (used by test_rl_e2e.py).

Exact match on two-digit sums improves too slowly at this scale for a test of a minute: the sampled
accuracy moves by a few points in 40 steps, less than its step-to-step noise. This reward asks for
a new behaviour instead — answers that start with the digit 1 (right for sums of 100 and more,
about half of them) — so the reward of a working RL loop climbs from ~0.5 towards 1 within 40
steps, while a broken one (wrong sign, advantages on the wrong samples, stale engine weights)
stays flat or falls.
"""


def leading_one(prompt: str, completion: str, answer: str) -> float:
    return float(completion.strip().startswith("1"))
