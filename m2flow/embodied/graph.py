"""The embodied workload as the planner's component graph: env <-> rollout in a cycle of T
policy calls, then the learner's update and the weight sync.

Which of a config's knobs a plan sets: the env workers and the envs each holds (the total
stays the config's), the pipeline stages, learner overlap, and the placement (the
``cluster`` keys, written by :mod:`m2flow.pipelines.planner.planfile`).

>>> g = graph({"total_envs": 8, "rollout_steps": 50, "chunk": 1, "group": 1})
>>> g.loop[0], g.samples, g.stages, g.workers
(Phase(component='env', phase='step'), 400, (1, 2, 4), (1, 2, 4))
"""

from __future__ import annotations

from typing import Any, Mapping

from m2flow.embodied.layout import Layout
from m2flow.pipelines.planner.graph import ComponentSpec, Graph, Phase

STAGES = (1, 2, 4)
"""Pipeline stages the search tries (see bench/README.md#pipelinepy)."""
WORKERS = (1, 2, 4)
"""Env worker counts the search tries (see bench/README.md#scalingpy)."""


def facts(layout: Layout, cfg, chunk: int, param_mb: float) -> dict[str, Any]:
    """What the graph needs from an embodied run's layout, its config (``TrainConfig``) and
    its policy. ``total_envs`` is the envs of all env workers: a plan divides it among the env
    workers it tries (``env.num_envs`` is the share of one)."""
    return {
        "total_envs": layout.total_envs,
        "rollout_steps": layout.rollout_steps,
        "chunk": chunk,
        "group": max(1, layout.reset_group_size),
        "reset": cfg.runner.reset_every_iteration,
        "overlap": cfg.algorithm.name != "bc",
        "param_mb": param_mb,
    }


def graph(f: Mapping[str, Any]) -> Graph:
    """The component graph of an embodied run with facts ``f`` (see :func:`facts`)."""
    if "total_envs" not in f:
        raise ValueError("the profile's facts have no total_envs (an m2flow before the run's "
                         "Layout called it num_envs); measure it again with m2flow-plan.")
    n, steps = int(f["total_envs"]), int(f["rollout_steps"])

    def knobs(plan, elastic: bool = False) -> list[str]:
        """``elastic``: build as many env groups as the largest stage count tried, so the run
        can change its stages without restarting a simulator (cluster.plan=auto)."""
        per = n // plan.workers
        groups = max(s for s in STAGES if s <= per) if elastic else plan.stages
        return [f"env.num_envs={per}",
                f"staging.pipeline_stages={plan.stages}",
                f"staging.env_groups={max(groups, plan.stages)}",
                f"runner.overlap_learner={str(plan.overlap).lower()}"]

    return Graph(
        workload="embodied",
        components=(ComponentSpec("env", processes_per_item=True, threads=False),
                    ComponentSpec("rollout", gpu=True),
                    ComponentSpec("learner", gpu=True)),
        loop=(Phase("env", "step"), Phase("rollout", "infer")),
        cycle=True,
        rounds=steps,
        items=n,
        train=Phase("learner", "learn"),
        samples=n * steps,
        steps_per_iteration=n * steps * int(f.get("chunk", 1)),
        before=(Phase("env", "reset"),) if f.get("reset", True) else (),
        sync=Phase("learner", "sync"),
        sync_size=float(f.get("param_mb", 0.0)),
        switch=(Phase("rollout", "offload"), Phase("learner", "onload"),
                Phase("learner", "offload"), Phase("rollout", "onload")),
        hop=Phase("env", "hop"),
        stages=tuple(s for s in STAGES if s <= n),
        workers=tuple(w for w in WORKERS if n % w == 0),
        group=int(f.get("group", 1)),
        overlap=bool(f.get("overlap", True)),
        item_unit="env",
        throughput_unit="env steps/s",
        knob_overrides=knobs,
    )


TIMERS = {"env": "sim", "rollout": "infer", "learner": "learn"}
"""Each component's busy time in the runner's metrics (``time/env_sim``, ...)."""


def monitor(cfg, layout: Layout):
    """The watch on a run started with a plan (``cluster.plan=FILE``; ``auto`` has become
    the file it wrote): predicted seconds per iteration of the run's own plan (from the
    profile saved next to the plan file, with the run's sizes), and for an ``auto`` plan the
    stage counts it may re-plan to. None without a plan."""
    from pathlib import Path

    from m2flow.pipelines.planner.monitor import PlanMonitor, stages_within
    from m2flow.pipelines.planner.planfile import read_plan_file
    from m2flow.pipelines.planner.profiles import Profile
    from m2flow.pipelines.planner.calibration import models_for, plan_of
    from m2flow.pipelines.planner.search import predict

    if cfg.cluster.plan in (None, "auto"):
        return None
    plan_file = read_plan_file(cfg.cluster.plan)
    profile = Path(cfg.cluster.plan).with_suffix(".profile.json")
    if not profile.is_file():  # a plan file kept without its profile: its own number
        return PlanMonitor(plan_file.predicted.get("iteration_s", 0.0) or float("nan"))
    prof = Profile.load(profile)
    g = graph({**prof.facts, "total_envs": layout.total_envs,
               "rollout_steps": layout.rollout_steps})
    models = models_for(prof, g)
    plan = plan_of(cfg.cluster, g, stages=layout.pipeline_stages,
                   overlap=cfg.runner.overlap_learner)
    pred = predict(plan, g, models, prof.node)
    if not pred.feasible:
        return None
    stages = stages_within(g, layout.env_groups, layout.num_envs)
    replan = (models, g, prof.node, plan, stages) if plan_file.auto else None
    return PlanMonitor(pred.iteration_s, replan=replan, timers=TIMERS,
                       source=str(cfg.cluster.plan))
