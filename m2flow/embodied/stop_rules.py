"""When a run evaluates and when it stops: the evaluation gate (``runner.eval_gate``), the
confirming evaluation (``runner.stop_confirm_episodes``) and the stop after K evaluations in a
row (``runner.stop_at_success``, ``runner.stop_after_evals``). Pure rules over a runner's
settings and metrics; ``EmbodiedRunner`` applies them."""

from __future__ import annotations

from typing import Optional


def gate_open(metrics: dict, r) -> bool:
    """Whether a scheduled evaluation runs under ``runner.eval_gate``: the iteration's training
    success (``env/<success_metric>``) reached it; an iteration in which no episode ended has
    none, and waits. No gate: always.

    >>> from types import SimpleNamespace as R
    >>> r = R(eval_gate=0.7, success_metric="success_once")
    >>> [gate_open({"env/success_once": s}, r) for s in (0.69, 0.7)]
    [False, True]
    >>> gate_open({"env/episodes": 0.0}, r), gate_open({}, R(**{**vars(r), "eval_gate": None}))
    (False, True)
    """
    if r.eval_gate is None:
        return True
    success = metrics.get(f"env/{r.success_metric}")
    return success is not None and success >= r.eval_gate


def confirms(out: dict, r) -> bool:
    """Whether evaluation ``out`` (``eval/*``) reached ``runner.stop_at_success`` on fewer
    episodes than ``runner.stop_confirm_episodes``, so a larger one must confirm it.

    >>> from types import SimpleNamespace as R
    >>> r = R(stop_at_success=0.9, stop_confirm_episodes=256, eval_episodes=64,
    ...       success_metric="success_once")
    >>> [confirms({"eval/success_once": s}, r) for s in (0.88, 0.91)]
    [False, True]
    >>> confirms({"eval/success_once": 0.95}, R(**{**vars(r), "stop_confirm_episodes": 0}))
    False
    >>> confirms({"eval/success_once": 0.95}, R(**{**vars(r), "eval_episodes": 4000}))
    False
    """
    return (r.stop_at_success is not None and r.stop_confirm_episodes > r.eval_episodes
            and out[f"eval/{r.success_metric}"] >= r.stop_at_success)


class SuccessStop:
    """``runner.stop_at_success`` with ``runner.stop_after_evals``: ``update`` (one
    evaluation's success rate, ``metric``: ``runner.success_metric``) is True once ``evals``
    evaluations in a row reached ``threshold`` (None: never)."""

    def __init__(self, threshold: Optional[float], evals: int = 1, *,
                 metric: str = "success_once"):
        self.threshold, self.evals, self.metric, self.in_a_row = threshold, evals, metric, 0

    def update(self, success: float) -> bool:
        reached = self.threshold is not None and success >= self.threshold
        self.in_a_row = self.in_a_row + 1 if reached else 0
        return self.threshold is not None and self.in_a_row >= self.evals

    def describe(self, success: float) -> str:
        row = f" in {self.in_a_row} evaluations in a row" if self.in_a_row > 1 else ""
        return f"eval/{self.metric} {success:.3f} >= runner.stop_at_success={self.threshold}{row}"
