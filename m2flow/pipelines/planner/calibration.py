"""Calibration: a profile's cost models corrected by real iterations of the config's own plan.

The fitted models predict each component's calls from the profile, which times each one
alone. A few real iterations of the config's own plan correct them twice: the update's time
inside those iterations against its time alone becomes a factor on the update at that thread
count (threads of a torch update on cores that simulators, Ray and the driver also use can
be slower than alone, more so the more threads), and what the corrected prediction still
misses of the iteration (Ray hand-offs, the runner's bookkeeping) is the framework's own cost
per iteration, added to every plan.
"""

from __future__ import annotations

from m2flow.pipelines.placement import ComponentPlacement
from m2flow.pipelines.planner.costmodel import CostModels, fit
from m2flow.pipelines.planner.graph import Graph
from m2flow.pipelines.planner.search import Plan, placed_ranks, predict


def models_for(profile, graph: Graph) -> CostModels:
    """The profile's cost models, with a one-process-per-item component's cores capped, and
    calibrated when the profile holds calibration runs (``facts["calibration"]``: the
    config's own placement and, per run, its stages, overlap and measured seconds per
    iteration): the update's measured time in a run without overlap against its predicted
    time is a factor on the update at that run's thread count (``CostModels.in_situ``); what
    a run's prediction still misses of its measurement is the framework's own cost per
    iteration, added to every plan (plans with overlap: what the overlapped run missed, when
    there was one)."""
    models = fit(profile, caps={c.name: "size" for c in graph.components
                                if c.processes_per_item})
    cal = profile.facts.get("calibration")
    if not cal:
        return models
    plan_of_run = lambda run: Plan(  # noqa: E731
        cal["mode"], tuple((n, ComponentPlacement(**cal["components"][n])) for n in graph.names),
        run["stages"], run["overlap"])
    train = graph.train
    for run in cal["runs"]:  # the update's time inside a real iteration, at its threads
        measured = (run.get("phases") or {}).get(f"{train.component}_{train.phase}")
        if run["overlap"] or not measured:
            continue
        pred = predict(plan_of_run(run), graph, models, profile.node)
        if pred.feasible and pred.busy.get(train.component):
            threads = _threads(plan_of_run(run), graph, train.component, profile.node)
            models.in_situ[(train.component, train.phase, float(threads))] = (
                measured / pred.busy[train.component])
    missed: dict[bool, float] = {}
    for run in cal["runs"]:
        pred = predict(plan_of_run(run), graph, models, profile.node)
        if pred.feasible:
            missed[bool(run["overlap"])] = max(0.0, run["seconds"] - pred.iteration_s)
    if missed:
        models.overhead_s = missed.get(False, missed.get(True, 0.0))
        models.overhead_overlap_s = missed.get(True)
    return models


def _threads(plan: Plan, graph: Graph, name: str, node) -> int:
    """The threads a component's rank runs with under ``plan`` (as the search sees them)."""
    return placed_ranks(plan, graph, node)[name][0].threads


def plan_of(cluster_cfg, graph: Graph, *, stages: int, overlap: bool) -> Plan:
    """The plan a config runs: its placement of the graph's components, its stages and
    overlap."""
    cal = calibration(cluster_cfg, graph, [])
    return Plan(cal["mode"], tuple((n, ComponentPlacement(**cal["components"][n]))
                                   for n in graph.names), stages, overlap)


def calibration(cluster_cfg, graph: Graph, runs) -> dict:
    """What ``models_for`` needs of calibration runs of a config: its placement of the
    graph's components and ``runs``, each ``(stages, overlap, seconds per iteration)`` and
    optionally the timed iterations' seconds (kept to show the spread) and the mean seconds
    per iteration of each component phase (``{"learner_learn": s, ...}``, a run's
    ``time/<component>_<phase>``). A JSON-able dict, kept in the profile's facts."""
    comps = {}
    for name in graph.names:
        c = cluster_cfg.placement.components.get(name) or ComponentPlacement()
        comps[name] = {"workers": c.workers, "cpus": float(c.cpus),
                       "gpus": list(c.gpus) if c.gpus else None,
                       "cpu_ids": list(c.cpu_ids) if c.cpu_ids else None}
    return {"mode": cluster_cfg.placement.mode, "components": comps,
            "runs": [{"stages": k, "overlap": bool(o), "seconds": float(t),
                      "times": [float(x) for x in (rest[0] if rest else [t])],
                      "phases": {n: float(v) for n, v in (rest[1] if len(rest) > 1
                                                          else {}).items()}}
                     for k, o, t, *rest in runs]}
