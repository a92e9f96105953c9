"""Per-phase wall-clock accounting for workers."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager
from typing import Iterator


class Timer:
    """Accumulates wall time per named phase until :meth:`pop` hands it out.

    >>> t = Timer()
    >>> with t("sim"):
    ...     pass
    >>> sorted(t.pop())
    ['sim']
    """

    def __init__(self) -> None:
        self._totals: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self._totals[phase] += time.perf_counter() - start

    def add(self, phase: str, seconds: float) -> None:
        self._totals[phase] += seconds

    def pop(self) -> dict[str, float]:
        """Returns seconds per phase since the last pop, and starts again from zero."""
        totals, self._totals = dict(self._totals), defaultdict(float)
        return totals
