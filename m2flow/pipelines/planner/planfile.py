"""The plan file: the chosen plan as a config the user keeps, reads and reuses.

``m2flow-plan`` writes it; ``m2flow-train --config-name X cluster.plan=FILE`` runs with it.
It is YAML: what the plan was chosen for (the entry config, the node), what was predicted,
``cluster``: the placement as a whole ``cluster`` group (every field of every component, so
nothing of the entry config's own cluster option is left half-applied; the same body saved as
``m2flow/configs/cluster/<name>.yaml`` is a cluster option), and ``overrides``: the
workload's own keys the plan sets (``staging.pipeline_stages=2``, ...). The placement is
merged onto the composed config (a Hydra override cannot add a component the entry's cluster
option does not list); the overrides go before the command line's own.

>>> from m2flow.pipelines.placement import ComponentPlacement
>>> plan = Plan("hybrid", (("env", ComponentPlacement(cpu_ids=[0], cpus=1)),
...                        ("rollout", ComponentPlacement(cpu_ids=[1], cpus=1))), stages=2)
>>> cluster_group(plan)["placement"]["components"]["env"]
{'workers': 1, 'cpus': 1.0, 'cpu_ids': [0], 'gpus': None, 'node': 0, 'node_resource': None}
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
    cluster: dict = field(default_factory=dict)
    """The placement as a ``cluster`` group (merged onto the composed config)."""
    auto: bool = False
    """Made by cluster.plan=auto: the run may re-plan what it can change while running."""
    path: Optional[Path] = None


def cluster_group(plan: Plan) -> dict:
    """The placement of ``plan`` as a ``cluster`` group body (Ray backend: pinning needs a
    process per component), every field of every component set."""
    comps = {}
    for name, c in plan.components:
        comps[name] = {"workers": c.workers, "cpus": float(c.cpus),
                       "cpu_ids": list(c.cpu_ids) if c.cpu_ids else None,
                       "gpus": list(c.gpus) if c.gpus else None, "node": 0,
                       "node_resource": None}
    return {"backend": "ray", "placement": {"mode": plan.mode, "components": comps}}


def write_plan_file(path, pred: Prediction, *, config_name: str, workload: str, node: Node,
                    knob_overrides: list[str], label: str,
                    runner_up: Optional[Prediction] = None, command: str = "",
                    auto: bool = False) -> Path:
    """Writes the plan file for ``pred`` (the chosen plan) and returns its path. ``auto``: a
    plan made by ``cluster.plan=auto``, which the run may change (pipeline stages) when its
    iterations drift from the prediction."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    overrides = list(knob_overrides)
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
            "# ('cluster' below is the placement: saved as m2flow/configs/cluster/<name>.yaml it is "
            "a cluster option)"]
    if command:
        head.append(f"# made by: {command}")
    path.write_text("\n".join(head) + "\n" + yaml.safe_dump(body, sort_keys=False))
    return path


def read_plan_file(path) -> PlanFile:
    """The plan file at ``path``; PlanFileError with one line when it is not one."""
    path = Path(path)
    if not path.is_file():
        raise PlanFileError(f"cluster.plan={path}: no such file; give a plan file written by "
                            "m2flow-plan, or cluster.plan=auto to plan at start-up.")
    try:
        body = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise PlanFileError(f"cluster.plan={path}: not YAML ({str(e).splitlines()[0]}).") from None
    if not isinstance(body, dict) or not isinstance(body.get("overrides"), list) \
            or not isinstance(body.get("cluster"), dict):
        raise PlanFileError(f"cluster.plan={path}: not a plan file (no 'cluster' group and "
                            "'overrides' list); write one with m2flow-plan.")
    return PlanFile(config_name=str(body.get("config_name", "")),
                    workload=str(body.get("workload", "")), label=str(body.get("plan", "")),
                    overrides=[str(o) for o in body["overrides"]], node=body.get("node") or {},
                    predicted=body.get("predicted") or {}, cluster=body["cluster"],
                    auto=bool(body.get("auto")),
                    path=path)
