"""When a run evaluates and when it stops: the evaluation gate (``runner.eval_gate``), the
confirming evaluation (``runner.stop_confirm_episodes``) and the stop after K evaluations in a
row (``runner.stop_at_success``, ``runner.stop_after_evals``). Pure rules over a runner's
settings and metrics; ``EmbodiedRunner`` applies them."""

from __future__ import annotations

from typing import Optional


class TrainingSuccess:
    """The training episodes' success since the last scheduled evaluation, for
    ``runner.eval_gate``: ``observe`` takes each iteration's metrics (``env/<metric>`` over
    ``env/episodes`` episodes), ``take`` returns their episode-weighted mean (None: no episode
    ended) and starts a new window. One iteration holds a few episodes (16 in the default
    job), too few to tell a policy at 0.6 from one at 0.9; the window holds
    ``runner.eval_interval`` iterations of them.

    >>> w = TrainingSuccess("success_once")
    >>> for m in ({"env/success_once": 0.5, "env/episodes": 16.0}, {"env/episodes": 0.0},
    ...           {"env/success_once": 1.0, "env/episodes": 8.0}):
    ...     w.observe(m)
    >>> round(w.take(), 4), w.take()
    (0.6667, None)
    """

    def __init__(self, metric: str):
        self.metric, self.successes, self.episodes = metric, 0.0, 0.0

    def observe(self, metrics: dict) -> None:
        n = metrics.get("env/episodes", 0.0)
        if n and f"env/{self.metric}" in metrics:
            self.successes += metrics[f"env/{self.metric}"] * n
            self.episodes += n

    def take(self) -> Optional[float]:
        mean = self.successes / self.episodes if self.episodes else None
        self.successes, self.episodes = 0.0, 0.0
        return mean


def gate_open(success: Optional[float], r) -> bool:
    """Whether a scheduled evaluation runs under ``runner.eval_gate``: the training success
    since the last scheduled evaluation (``TrainingSuccess.take``) reached it; none (no
    episode ended) waits. No gate: always.

    >>> from types import SimpleNamespace as R
    >>> r = R(eval_gate=0.6)
    >>> [gate_open(s, r) for s in (0.59, 0.6, None)], gate_open(None, R(eval_gate=None))
    ([False, True, False], True)
    """
    if r.eval_gate is None:
        return True
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
