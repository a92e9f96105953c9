"""Plan making for ``m2flow-plan`` and ``cluster.plan``: measure a config's components,
search every plan, keep the best as a file; apply a plan file (or ``auto``: one made now) to a
config while it loads; run the best plans for real to check their predictions.

The planner itself is :mod:`m2flow.pipelines.planner`; each workload measures its own
components (:data:`m2flow.cli.workloads.PLANNERS`). The command is :mod:`m2flow.cli.plan`.
"""

from __future__ import annotations

import copy
import dataclasses
import shlex
import statistics
import sys
from datetime import datetime
from pathlib import Path
from typing import Callable, Optional, Sequence

from m2flow.cli.workloads import planner, run_config
from m2flow.pipelines.planner.planfile import (
    PlanFileError, cluster_group, read_plan_file, write_plan_file)
from m2flow.pipelines.planner.profiles import Profile
from m2flow.pipelines.planner.calibration import calibration, models_for
from m2flow.pipelines.planner.search import PlanError, Prediction, search, table

PLAN_DIR = "plans"
"""Where m2flow-plan writes plan files by default (relative to the working directory)."""
AUTO = "auto"


def merge_cluster(composed, cluster: dict):
    """``composed`` (a typed DictConfig) with the plan's ``cluster`` group merged onto it
    (components its cluster option does not list are added, typed by the schema)."""
    from omegaconf import open_dict
    from omegaconf.errors import OmegaConfBaseException

    from m2flow.configs.loader import ConfigError, explain

    try:
        with open_dict(composed):
            composed.merge_with({"cluster": cluster})
    except OmegaConfBaseException as e:
        raise ConfigError(explain(e, "")) from None
    return composed


def without_plan(overrides: Sequence[str]) -> list[str]:
    """``overrides`` less any ``cluster.plan=`` (a plan is made for the others)."""
    return [o for o in overrides if o.lstrip("+~").split("=", 1)[0] != "cluster.plan"]


CALIBRATION_ITERATIONS = 3
"""Real iterations of the config's own plan (after a warm-up) that calibrate the framework's
cost per iteration (``calibration.models_for``)."""


def measure(cfg, *, calibrate: bool = True, say: Callable[[str], None] = print):
    """``cfg``'s workload's components profiled, then (``calibrate``, Ray configs only) a
    short real run of the config as it is that measures the framework's own cost per
    iteration, kept in the profile's facts. Returns (profile, graph)."""
    module = planner(cfg.workload)
    prof, graph = module.profile(cfg, say=say)
    if calibrate and cfg.cluster.backend == "ray":
        say(f"profile: calibration: {CALIBRATION_ITERATIONS} real iterations of the config "
            "as it is (after a warm-up), and with learner overlap if it has none")
        runs = module.calibrate(copy.deepcopy(cfg), CALIBRATION_ITERATIONS)
        prof.facts["calibration"] = calibration(cfg.cluster, graph, runs)
    return prof, graph


def make_plan(cfg, config_name: str, overrides: Sequence[str], *, output: Path,
              profile_path: Optional[str] = None, top: int = 10, elastic: bool = False,
              calibrate: bool = True, overlap: bool = True,
              say: Callable[[str], None] = print):
    """Profiles ``cfg`` (or reads ``profile_path``), calibrates on a short real run of the
    config as it is (``calibrate``, Ray configs only), searches, prints the table, writes
    the plan file ``output`` (and the profile next to it). Returns (predictions, graph)."""
    module = planner(cfg.workload)
    if profile_path:
        prof = Profile.load(profile_path)
        graph = module.graph_of(prof.facts)
        say(f"plan: profile {profile_path} ({prof.source.get('date', 'undated')})")
    else:
        prof, graph = measure(cfg, calibrate=calibrate, say=say)
        saved = prof.save(output.with_suffix(".profile.json"))
        say(f"plan: profile written to {saved}")
    if not overlap:  # learner overlap trains on stale data: left out when asked
        graph = dataclasses.replace(graph, overlap=False)
    models = models_for(prof, graph)
    say("plan: fitted cost models")
    for (comp, phase, device), m in sorted(models.times.items()):
        say(f"  {comp}.{phase} ({device}): {m.describe()}")
    for run in prof.facts.get("calibration", {}).get("runs", []):
        times = ", ".join(f"{t:.3f}" for t in run.get("times", [run["seconds"]]))
        say(f"  framework: {models.overhead(run['overlap']):.3f} s per iteration"
            f"{' with overlap' if run['overlap'] else ''} (the calibration run took "
            f"{run['seconds']:.3f} s, the mean of {times})")
    preds = search(graph, models, prof.node)
    say(f"plan: {graph.workload} workload on {prof.node.cores} cores, {prof.node.gpus} GPUs; "
        f"{len(preds)} plans, {sum(p.feasible for p in preds)} feasible")
    say(table(preds, graph, top=top))
    best = preds[0]
    runner_up = next((p for p in preds[1:] if p.feasible), None)
    command = shlex.join(["m2flow-plan", "--config-name", config_name, *overrides])
    write_plan_file(output, best, config_name=config_name, workload=graph.workload,
                    node=prof.node, knob_overrides=graph.knob_overrides(best.plan, elastic=elastic),
                    label=best.plan.label(graph), runner_up=runner_up, command=command,
                    auto=elastic)
    return preds, graph


def with_plan(config_name: str, overrides: Sequence[str], composed):
    """``composed`` (``config_name`` with ``overrides``) with its ``cluster.plan`` applied:
    a plan file's workload overrides before the command line's own and its placement merged
    on; for ``auto`` a plan made now from this config (written under
    ``runner.log_dir/<run_name>/plans/``, and ``cluster.plan`` set to that file so the run
    watches its prediction; the plan's own overrides win here, it was made for the others)."""
    from m2flow.configs import ConfigError, load_config

    value = str(composed.cluster.plan)
    if value == AUTO:
        cfg = run_config(composed)
        out = Path(cfg.runner.log_dir) / cfg.run_name / PLAN_DIR / \
            f"{datetime.now():%Y%m%d-%H%M%S}.yaml"
        try:
            make_plan(cfg, config_name, without_plan(overrides), output=out, elastic=True,
                      top=5)
        except PlanError as e:
            raise ConfigError(f"config error: cluster.plan=auto: {e}") from None
        plan_file = read_plan_file(out)
        print(f"plan: cluster.plan=auto chose {plan_file.label}; written to {out}", flush=True)
        final = without_plan(overrides) + plan_file.overrides + [f"cluster.plan={out}"]
        return merge_cluster(load_config(config_name, final), plan_file.cluster)
    try:
        plan_file = read_plan_file(value)
    except PlanFileError as e:
        raise ConfigError(f"config error: {e}") from None
    if plan_file.workload and plan_file.workload != composed.workload:
        raise ConfigError(
            f"config error: cluster.plan={value} is a plan for the {plan_file.workload} "
            f"workload, but {config_name} is {composed.workload}; make one with m2flow-plan "
            f"--config-name {config_name}.")
    if plan_file.config_name and plan_file.config_name != config_name:
        print(f"plan: note: {value} was made for {plan_file.config_name}, used here for "
              f"{config_name}", file=sys.stderr, flush=True)
    return merge_cluster(load_config(config_name, plan_file.overrides + list(overrides)),
                         plan_file.cluster)


def config_of(config_name: str, overrides: Sequence[str], plan, graph, elastic: bool = False):
    """The run config of ``config_name`` with ``overrides`` and ``plan`` (a search plan)
    applied: its workload keys after the overrides, its placement merged on (``elastic``:
    built to change its stages at run time)."""
    from m2flow.configs import load_config

    knobs = graph.knob_overrides(plan, elastic=elastic)
    composed = load_config(config_name, without_plan(overrides) + knobs)
    return run_config(merge_cluster(composed, cluster_group(plan)))


def verify(config_name: str, overrides: Sequence[str], preds: Sequence[Prediction], graph,
           *, iterations: int, count: int = 2, say: Callable[[str], None] = print) -> list[dict]:
    """Runs the first ``count`` feasible plans for ``iterations`` real iterations each (after
    one warm-up) and prints predicted against measured seconds per iteration."""
    rows = []
    for pred in [p for p in preds if p.feasible][:count]:
        cfg = config_of(config_name, overrides, pred.plan, graph)
        say(f"verify: {pred.plan.label(graph)}: {iterations} iterations after a warm-up")
        times = planner(cfg.workload).measure_iterations(cfg, iterations)
        measured = statistics.fmean(times)
        rows.append({"plan": pred.plan.label(graph), "predicted_s": pred.iteration_s,
                     "measured_s": measured, "error": pred.iteration_s / measured - 1,
                     "times": times})
    say(f"verify: predicted against measured seconds per iteration (mean of {iterations})")
    say(f"{'#':>3}  {'predicted':>9}  {'measured':>9}  {'error':>6}  plan")
    for i, r in enumerate(rows):
        say(f"{i + 1:>3}  {r['predicted_s']:>9.3f}  {r['measured_s']:>9.3f}  "
            f"{100 * r['error']:>+5.0f}%  {r['plan']}")
    if len(rows) == 2:
        right = (rows[0]["measured_s"] <= rows[1]["measured_s"])
        say(f"verify: the chosen plan was {'faster' if right else 'SLOWER'} than the runner-up "
            f"({rows[0]['measured_s']:.3f} s against {rows[1]['measured_s']:.3f} s)")
    return rows
