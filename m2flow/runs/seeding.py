"""Seeds derived from (base seed, purpose, iteration, rank): every iteration is reproducible
on its own, which is what makes a resumed run equal an uninterrupted one."""

from __future__ import annotations

import numpy as np

TRAIN, EVAL, SAMPLE, LEARN, STAGGER, DEMO = 0, 1, 2, 3, 4, 5  # purposes


def derive(seed: int, purpose: int, iteration: int, rank: int, n: int = 1) -> list[int]:
    """``n`` independent 31-bit seeds for one purpose, iteration and rank."""
    state = np.random.SeedSequence([seed, purpose, iteration, rank]).generate_state(n)
    return [int(s) & 0x7FFFFFFF for s in state]


def eval_seeds(seed: int, n: int) -> list[int]:
    """The seeds of evaluation episodes 0..n-1. Episode e's seed depends on ``seed`` and ``e``
    alone, never on how many envs, env workers or rounds run the evaluation, so one
    checkpoint gives the same episodes with any ``env.num_envs``; and the first k of n
    are the k of a shorter evaluation (training-time evaluation's episodes are the first of
    ``m2flow-eval``'s).

    >>> eval_seeds(0, 5)[:3] == eval_seeds(0, 3)
    True
    """
    return derive(seed, EVAL, 0, 0, n)
