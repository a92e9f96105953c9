"""Calibration: a profile's cost models corrected by real iterations of the config's own plan.

The fitted models predict each component's calls; what a real iteration costs beyond them
(Ray hand-offs, the runner's bookkeeping, the learner's first-touch costs) is measured by
running the config's plan for a few iterations, and added to every plan's prediction.
"""

from __future__ import annotations

from m2flow.pipelines.placement import ComponentPlacement
from m2flow.pipelines.planner.costmodel import CostModels, fit
from m2flow.pipelines.planner.graph import Graph
from m2flow.pipelines.planner.search import Plan, predict


def models_for(profile, graph: Graph) -> CostModels:
    """The profile's cost models, with a one-process-per-item component's cores capped, and
    calibrated when the profile holds calibration runs (``facts["calibration"]``: the
    config's own placement and, per run, its lanes, overlap and measured seconds per
    iteration): what a run's prediction misses of its measurement is the framework's own
    cost per iteration, added to every plan (plans with overlap: what the overlapped run
    missed, when there was one)."""
    models = fit(profile, caps={c.name: "size" for c in graph.components
                                if c.processes_per_item})
    cal = profile.facts.get("calibration")
    if not cal:
        return models
    missed: dict[bool, float] = {}
    for run in cal["runs"]:
        plan = Plan(cal["mode"], tuple((n, ComponentPlacement(**cal["components"][n]))
                                       for n in graph.names), run["lanes"], run["overlap"])
        pred = predict(plan, graph, models, profile.node)
        if pred.feasible:
            missed[bool(run["overlap"])] = max(0.0, run["seconds"] - pred.iteration_s)
    if missed:
        models.overhead_s = missed.get(False, missed.get(True, 0.0))
        models.overhead_overlap_s = missed.get(True)
    return models


def plan_of(cluster_cfg, graph: Graph, *, lanes: int, overlap: bool) -> Plan:
    """The plan a config runs: its placement of the graph's components, its lanes and
    overlap."""
    cal = calibration(cluster_cfg, graph, [])
    return Plan(cal["mode"], tuple((n, ComponentPlacement(**cal["components"][n]))
                                   for n in graph.names), lanes, overlap)


def calibration(cluster_cfg, graph: Graph, runs) -> dict:
    """What ``models_for`` needs of calibration runs of a config: its placement of the
    graph's components and ``runs``, each ``(lanes, overlap, seconds per iteration)`` and
    optionally the timed iterations' seconds (kept to show the spread). A JSON-able dict,
    kept in the profile's facts."""
    comps = {}
    for name in graph.names:
        c = cluster_cfg.placement.components.get(name) or ComponentPlacement()
        comps[name] = {"workers": c.workers, "cpus": float(c.cpus),
                       "gpus": list(c.gpus) if c.gpus else None,
                       "cpu_ids": list(c.cpu_ids) if c.cpu_ids else None}
    return {"mode": cluster_cfg.placement.mode, "components": comps,
            "runs": [{"lanes": k, "overlap": bool(o), "seconds": float(t),
                      "times": [float(x) for x in (rest[0] if rest else [t])]}
                     for k, o, t, *rest in runs]}
