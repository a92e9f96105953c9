"""The plan file: the chosen plan as config overrides the user keeps, reads and reuses.

``m2flow-plan`` writes it; ``m2flow-train --config-name X cluster.plan=FILE`` (or the same
overrides on the command line) runs with it. It is YAML: what the plan was chosen for (the
entry config, the node), what was predicted, the overrides (the placement as ``++cluster.*``
keys, which add components a cluster option does not list, then the workload's own keys such
as ``rollout.pipeline_stages``), and the same placement as a ``cluster`` group, ready to be
saved as a ``cluster/<name>.yaml`` option.

>>> from m2flow.pipelines.placement import ComponentPlacement
>>> plan = Plan("hybrid", (("env", ComponentPlacement(cpu_ids=[0], cpus=1)),
...                        ("rollout", ComponentPlacement(cpu_ids=[1], cpus=1))), lanes=2)
>>> cluster_overrides(plan)[:3]
['cluster.backend=ray', 'cluster.placement.mode=hybrid', '++cluster.placement.components.env.workers=1']
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Optional

import yaml

from m2flow.pipelines.planner.profiles import Node
from m2flow.pipelines.planner.search import Plan, Prediction

KEYS = ("workers", "cpus", "cpu_ids", "gpus", "node", "node_resource")
"""Every field of a component's placement: a plan sets all of them, so nothing of the
entry config's own cluster option is left half-applied."""


class PlanFileError(ValueError):
    """A plan file that cannot be read or does not fit the config it is used with."""


@dataclass
class PlanFile:
    """What a plan file holds."""

    config_name: str
    workload: str
    label: str
    overrides: list[str]
    node: dict = field(default_factory=dict)
    predicted: dict = field(default_factory=dict)
    auto: bool = False
    """Made by cluster.plan=auto: the run may re-plan what it can change while running."""
    path: Optional[Path] = None


def cluster_overrides(plan: Plan) -> list[str]:
    """The placement of ``plan`` as Hydra overrides (Ray backend: pinning needs processes)."""
    out = ["cluster.backend=ray", f"cluster.placement.mode={plan.mode}"]
    for name, c in plan.components:
        values = {"workers": c.workers, "cpus": float(c.cpus), "cpu_ids": c.cpu_ids,
                  "gpus": c.gpus, "node": 0, "node_resource": None}
        for key in KEYS:
            out.append(f"++cluster.placement.components.{name}.{key}={_value(values[key])}")
    return out


def _value(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(map(str, v)) + "]"
    return str(v)


def cluster_group(plan: Plan) -> dict:
    """The placement as a ``cluster`` group option (a ``cluster/<name>.yaml`` body)."""
    comps = {}
    for name, c in plan.components:
        d = {"workers": c.workers}
        if c.cpu_ids:
            d["cpu_ids"] = list(c.cpu_ids)
        else:
            d["cpus"] = float(c.cpus)
        if c.gpus:
            d["gpus"] = list(c.gpus)
        comps[name] = d
    return {"backend": "ray", "placement": {"mode": plan.mode, "components": comps}}


def write_plan(path, pred: Prediction, *, config_name: str, workload: str, node: Node,
               knob_overrides: list[str], label: str, runner_up: Optional[Prediction] = None,
               command: str = "", auto: bool = False) -> Path:
    """Writes the plan file for ``pred`` (the chosen plan) and returns its path. ``auto``: a
    plan made by ``cluster.plan=auto``, which the run may change (pipeline stages) when its
    iterations drift from the prediction."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    overrides = cluster_overrides(pred.plan) + list(knob_overrides)
    body = {
        "config_name": config_name,
        "workload": workload,
        "plan": label,
        "node": {"cores": node.cores, "gpus": node.gpus,
                 "memory_mb": None if math.isinf(node.memory_mb) else round(node.memory_mb)},
        "predicted": {"iteration_s": round(pred.iteration_s, 4),
                      "throughput": round(pred.throughput, 2),
                      "memory_mb": round(pred.memory_mb),
                      "breakdown": {k: round(v, 4) for k, v in pred.breakdown.items()}},
        "auto": auto,
        "overrides": overrides,
        "cluster": cluster_group(pred.plan),
    }
    if runner_up is not None:
        body["runner_up"] = {"iteration_s": round(runner_up.iteration_s, 4)}
    head = [f"# m2flow plan for {config_name} on {node.cores} cores, {node.gpus} GPUs "
            f"({datetime.now():%Y-%m-%d %H:%M})",
            f"# {label}",
            f"# predicted {pred.iteration_s:.3f} s/iteration, {pred.throughput:.1f} per s, "
            f"{pred.memory_mb / 1024:.1f} GB",
            f"# use: m2flow-train --config-name {config_name} cluster.plan={path}",
            "# (the 'cluster' block below is the same placement as a cluster/<name>.yaml option)"]
    if command:
        head.append(f"# made by: {command}")
    path.write_text("\n".join(head) + "\n" + yaml.safe_dump(body, sort_keys=False))
    return path


def read_plan(path) -> PlanFile:
    """The plan file at ``path``; PlanFileError with one line when it is not one."""
    path = Path(path)
    if not path.is_file():
        raise PlanFileError(f"cluster.plan={path}: no such file; give a plan file written by "
                            "m2flow-plan, or cluster.plan=auto to plan at start-up.")
    try:
        body = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise PlanFileError(f"cluster.plan={path}: not YAML ({str(e).splitlines()[0]}).") from None
    if not isinstance(body, dict) or not isinstance(body.get("overrides"), list):
        raise PlanFileError(f"cluster.plan={path}: not a plan file (no 'overrides' list); "
                            "write one with m2flow-plan.")
    return PlanFile(config_name=str(body.get("config_name", "")),
                    workload=str(body.get("workload", "")), label=str(body.get("plan", "")),
                    overrides=[str(o) for o in body["overrides"]], node=body.get("node") or {},
                    predicted=body.get("predicted") or {}, auto=bool(body.get("auto")),
                    path=path)
