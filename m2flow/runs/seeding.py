"""Seeds derived from (base seed, purpose, iteration, rank): every iteration is reproducible
on its own, which is what makes a resumed run equal an uninterrupted one."""

from __future__ import annotations

import numpy as np

TRAIN, EVAL, SAMPLE, LEARN, STAGGER, DEMO = 0, 1, 2, 3, 4, 5  # purposes


def derive(seed: int, purpose: int, iteration: int, rank: int, n: int = 1) -> list[int]:
    """``n`` independent 31-bit seeds for one purpose, iteration and rank."""
    state = np.random.SeedSequence([seed, purpose, iteration, rank]).generate_state(n)
    return [int(s) & 0x7FFFFFFF for s in state]
