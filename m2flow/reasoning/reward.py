"""Rewards: 1.0 for a correct final answer, 0.0 otherwise (wrong, malformed or missing).

>>> exact_match(" 8+16=24", "24"), exact_match(" 8+16=25", "24"), exact_match("no idea", "24")
(1.0, 0.0, 0.0)
>>> math_verify_reward("so the answer is $\\\\frac{1}{2}$", "0.5")
1.0
"""

from __future__ import annotations

import re
from typing import Callable

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number(text: str):
    found = _NUMBER.findall(text.replace(",", ""))
    return found[-1] if found else None


def exact_match(completion: str, answer: str) -> float:
    """The last number of the completion equals the reference (the arithmetic set)."""
    got = last_number(completion)
    if got is None:
        return 0.0
    try:
        return float(float(got) == float(answer))
    except ValueError:
        return float(got == answer.strip())


def math_verify_reward(completion: str, answer: str) -> float:
    """``math-verify``: the completion's final answer (boxed, LaTeX or plain) is equivalent
    to the reference; anything it cannot parse scores 0. Right on any thread: math-verify
    runs in a child process of this one (``m2flow.reasoning.math_verify_process``), whose
    main thread its signal-based timeout needs."""
    from m2flow.reasoning.math_verify_process import shared_verifier

    return shared_verifier().score(completion, answer)


REWARDS: dict[str, Callable[[str, str], float]] = {
    "exact": exact_match,
    "math_verify": math_verify_reward,
}


def reward_fn(name: str) -> Callable[[str, str], float]:
    try:
        return REWARDS[name]
    except KeyError:
        raise ValueError(
            f"algorithm.reward={name!r} is not a reward; use one of {sorted(REWARDS)}."
        ) from None
