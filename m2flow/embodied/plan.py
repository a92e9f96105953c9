"""The embodied workload as the planner's component graph: env <-> rollout in a cycle of T
policy calls, then the learner's update and the weight sync.

Which of a config's knobs a plan sets: the env workers and the envs each holds (the total
stays the config's), the pipeline stages, learner overlap, and the placement (the
``cluster`` keys, written by :mod:`m2flow.pipelines.planner.planfile`).

>>> g = graph({"num_envs": 8, "rollout_steps": 50, "chunk": 1, "group": 1})
>>> g.loop[0], g.samples, g.lanes, g.workers
(Phase(component='env', phase='step'), 400, (1, 2, 4), (1, 2, 4))
"""

from __future__ import annotations

from typing import Any, Mapping

from m2flow.pipelines.planner.graph import ComponentSpec, Graph, Phase

LANES = (1, 2, 4)
"""Pipeline stages the search tries (bench/pipeline.py: 2 reaches the bound on 2 cores)."""
WORKERS = (1, 2, 4)
"""Env worker counts the search tries (bench/scaling.py: a second one fills idle cores)."""


def facts(cfg, chunk: int, param_mb: float) -> dict[str, Any]:
    """What the graph needs from an embodied config (``TrainConfig``) and its policy."""
    from m2flow.embodied.algorithms import algorithm_class

    env = cfg.cluster.placement.components.get("env")
    workers = 1 if env is None else env.workers
    return {
        "num_envs": cfg.env.num_envs * workers,
        "rollout_steps": cfg.runner.rollout_steps,
        "chunk": chunk,
        "group": max(1, algorithm_class(cfg.algorithm.name).reset_group_size(cfg.algorithm)),
        "reset": cfg.runner.reset_every_iteration,
        "overlap": cfg.algorithm.name != "bc",
        "param_mb": param_mb,
    }


def graph(f: Mapping[str, Any]) -> Graph:
    """The component graph of an embodied run with facts ``f`` (see :func:`facts`)."""
    n, steps = int(f["num_envs"]), int(f["rollout_steps"])

    def knobs(plan, elastic: bool = False) -> list[str]:
        """``elastic``: build as many env groups as the largest stage count tried, so the run
        can change its stages without restarting a simulator (cluster.plan=auto)."""
        per = n // plan.workers
        groups = max(s for s in LANES if s <= per) if elastic else plan.lanes
        return [f"env.num_envs={per}",
                f"rollout.pipeline_stages={plan.lanes}",
                f"rollout.env_groups={max(groups, plan.lanes)}",
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
        lanes=tuple(s for s in LANES if s <= n),
        workers=tuple(w for w in WORKERS if n % w == 0),
        group=int(f.get("group", 1)),
        overlap=bool(f.get("overlap", True)),
        item_unit="env",
        throughput_unit="env steps/s",
        knob_overrides=knobs,
    )
