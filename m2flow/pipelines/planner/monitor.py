"""Watching a run against its plan: predicted against measured iteration time, and a new
stage count when they drift apart.

A run started with a plan (``cluster.plan=FILE``, or ``auto``) knows the plan's predicted
seconds per iteration. Every iteration it reports ``plan/predicted_s``, ``plan/measured_s``
(the median of the last ``WINDOW`` iterations) and ``plan/drift``. When the drift passes
``DRIFT`` and the plan was made by ``cluster.plan=auto``, it re-plans what a run can change
while it runs, its pipeline stages: each component's predicted busy seconds are
scaled to what the run measured (``time/<component>_<phase>``), what is left is the
framework's own cost, and every stage count the run's env groups allow is predicted again; a
different one is taken if it gains ``REPLAN_GAIN``. The corrected prediction becomes the new
reference either way, so one drift re-plans once.

>>> m = PlanMonitor(predicted_s=1.0)
>>> [round(m.observe({"perf/iteration_s": s})["plan/drift"], 2) for s in (1.0, 1.1, 1.1)]
[0.0, 0.05, 0.1]
"""

from __future__ import annotations

import statistics
from typing import Callable, Mapping, Optional, Sequence

DRIFT = 0.20
"""Relative difference of measured against predicted iteration time that triggers a re-plan."""
WINDOW = 3
"""Iterations whose median is compared (one slow iteration is not a drift)."""
REPLAN_GAIN = 0.05
"""A different stage count is taken only if predicted at least this much faster."""


class PlanMonitor:
    """Compares a run's iterations with a prediction; re-plans stages when allowed.

    Args:
        predicted_s: the plan's predicted seconds per iteration.
        replan: None (watch only), or ``(models, graph, node, plan, stages)`` to re-plan
            with: the cost models, the workload graph, the node, the running plan and the
            stage counts it may switch to.
        timers: per component, the timer phase of its busy time in the run's metrics
            (``{"env": "sim", ...}`` -> ``time/env_sim``).
    """

    def __init__(self, predicted_s: float, *, replan=None,
                 timers: Optional[Mapping[str, str]] = None, source: str = "the plan"):
        self.predicted = predicted_s
        self.source = source
        self.replan = replan
        self.timers = dict(timers or {})
        self.times: list[float] = []
        self.busy: list[dict[str, float]] = []
        self.replans = 0

    def observe(self, metrics: Mapping[str, float],
                set_stages: Optional[Callable[[int], None]] = None,
                log: Callable[[str], None] = lambda line: None) -> dict:
        """Takes one iteration's metrics; returns ``plan/*`` metrics. A re-plan calls
        ``set_stages`` and ``log``s a line saying what it changed and why."""
        if not self.times and not self.replans:
            what = "re-plans the stages on a drift" if self.replan else "watch only"
            log(f"plan: {self.source}: predicted {self.predicted:.3f} s/iteration for this "
                f"run's plan; measured against it as plan/measured_s, plan/drift ({what})")
        self.times.append(float(metrics["perf/iteration_s"]))
        self.busy.append({c: float(metrics.get(f"time/{c}_{p}", 0.0))
                          for c, p in self.timers.items()})
        window = self.times[-WINDOW:]
        measured = statistics.median(window)
        drift = measured / self.predicted - 1
        out = {"plan/predicted_s": self.predicted, "plan/measured_s": measured,
               "plan/drift": drift}
        if abs(drift) > DRIFT and len(window) == WINDOW and self.replan is not None:
            line = self._replan(measured, set_stages)
            log(f"plan: measured {measured:.3f} s/iteration over the last {WINDOW} against "
                f"{out['plan/predicted_s']:.3f} s predicted ({100 * drift:+.0f} %): {line}")
            self.times.clear()
            self.busy.clear()
            self.replans += 1
        return out

    def _replan(self, measured: float, set_stages) -> str:
        from m2flow.pipelines.planner.search import Plan, predict

        models, graph, node, plan, stages = self.replan
        now = predict(plan, graph, models, node)
        seen = {c: statistics.median(b[c] for b in self.busy[-WINDOW:]) for c in self.timers}
        factors = {c: seen[c] / now.busy[c]  # what the run measured is what it costs
                   for c in self.timers if seen.get(c) and now.busy.get(c)}
        scaled = models.scaled(factors, 0.0)
        base = predict(plan, graph, scaled, node)
        models = scaled.scaled({}, max(0.0, measured - base.iteration_s))
        options = {}
        for k in stages:
            p = predict(Plan(plan.mode, plan.components, k, plan.overlap), graph, models, node)
            if p.feasible:
                options[k] = p
        current = options.get(plan.stages) or predict(plan, graph, models, node)
        best = min(options.values(), key=lambda p: p.iteration_s, default=current)
        why = ", ".join(f"{c} x{f:.3g}" for c, f in sorted(factors.items())) or "no timers"
        name = graph.stages_label
        if best.plan.stages != plan.stages and \
                best.iteration_s < current.iteration_s * (1 - REPLAN_GAIN) and set_stages:
            set_stages(best.plan.stages)
            self.replan = (models, graph, node, best.plan, stages)
            self.predicted = best.iteration_s
            return (f"re-planned with the measured component times ({why}): {name} "
                    f"{plan.stages} -> {best.plan.stages}, predicted {best.iteration_s:.3f} s")
        self.replan = (models, graph, node, plan, stages)
        self.predicted = current.iteration_s
        return (f"re-planned with the measured component times ({why}): {name}={plan.stages} "
                f"stays the best of {sorted(options)}; predicted now {current.iteration_s:.3f} s")


def stages_within(graph, limit: int, per_worker: int) -> Sequence[int]:
    """The stage counts a run can switch to: the graph's, at most ``limit`` (the env groups
    built) and at most the items each worker holds."""
    return [k for k in graph.stages if k <= min(limit, per_worker)]
