"""The one table of workloads, and a composed config as its workload's checked config object.

This is the only module that knows more than one workload. A config names its workload in its
``workload`` field (set by its schema); a checkpoint carries the same tag. The plan maker
(:mod:`m2flow.cli.planning`) and the commands (:mod:`m2flow.cli.common` and above) build on it,
so turning a composed config into a run config (``resume`` and ``init_from`` resolved, every
start-up check run) lives here, below both.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from m2flow.runs.workload import Workload

WORKLOADS = {
    "embodied": "m2flow.embodied.workload:WORKLOAD",
    "reasoning": "m2flow.reasoning.workload:WORKLOAD",
}
PLANNERS = {  # each workload's profiler for m2flow-plan (m2flow.cli.planning)
    "embodied": "m2flow.embodied.profile",
    "reasoning": "m2flow.reasoning.profile",
}


def workload(name: str) -> Workload:
    """The workload called ``name`` (its module is imported now)."""
    from m2flow.configs import ConfigError

    if name not in WORKLOADS:
        raise ConfigError(f"config error: workload={name!r} is not one of {sorted(WORKLOADS)}.")
    module, _, attr = WORKLOADS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def planner(name: str):
    """The profiler module of workload ``name`` (``profile``, ``graph_of``,
    ``measure_iterations``); imported now."""
    return importlib.import_module(PLANNERS[name])


def register_schemas() -> None:
    """Every workload's schemas in Hydra's ConfigStore (before composing any config)."""
    for name in WORKLOADS:
        workload(name).register_schemas()


def run_config(composed):
    """A composed config as its workload's config object, ``resume`` and ``init_from``
    resolved, checked."""
    from m2flow.configs import to_object

    w = workload(composed.workload)
    obj = to_object(composed)
    resolve_resume(obj)
    resolve_init(obj)
    check_config(w, obj)
    return obj


def resolve_init(cfg) -> None:
    """``init_from`` (the embodied workload's) given as a run directory or a folder of runs:
    its newest checkpoint, as ``m2flow-eval checkpoint=`` takes them."""
    from m2flow.configs import ConfigError
    from m2flow.runs import checkpoint

    if getattr(cfg, "init_from", None) is None:
        return
    try:
        cfg.init_from = str(checkpoint.resolve(cfg.init_from))
    except checkpoint.CheckpointError as e:
        raise ConfigError(f"config error: init_from={cfg.init_from}: {e}") from None


def resolve_resume(cfg) -> None:
    """``resume=latest``: the newest checkpoint of runs named ``run_name`` under
    ``runner.log_dir`` (one config-error line if there is none); ``resume=auto``: the same, or
    a fresh start if there is none. Any other value is a checkpoint, a run directory or a
    run name's folder, as ``init_from`` and ``m2flow-eval checkpoint=`` take them."""
    from m2flow.configs import ConfigError
    from m2flow.runs import checkpoint

    if cfg.resume is None:
        return
    if cfg.resume not in ("latest", "auto"):
        try:
            cfg.resume = str(checkpoint.resolve(cfg.resume))
        except checkpoint.CheckpointError as e:
            raise ConfigError(f"config error: resume={cfg.resume}: {e}") from None
        return
    found = checkpoint.find_latest(cfg.runner.log_dir, cfg.run_name)
    where = Path(cfg.runner.log_dir) / cfg.run_name / "*" / "checkpoints" / checkpoint.LAST
    if found is None and cfg.resume == "latest":
        raise ConfigError(
            f"config error: resume=latest: no checkpoint of run {cfg.run_name!r} under {where}; "
            "check run_name and runner.log_dir, give a path (resume=runs/.../last.pt), or use "
            "resume=auto to start from scratch when there is none.")
    if found is None:
        print(f"resume=auto: no checkpoint of run {cfg.run_name!r} under {where}; "
              "starting from iteration 0.", flush=True)
    else:
        print(f"resume={cfg.resume}: {found}", flush=True)
    cfg.resume = None if found is None else str(found)


def check_config(w: Workload, cfg) -> None:
    """``w``'s start-up checks of ``cfg``; a component's own ``ValueError`` becomes the one
    config-error line."""
    from m2flow.configs import ConfigError

    try:
        w.check(cfg)
    except ConfigError:
        raise
    except ValueError as e:  # a component's own check: make it the one config-error line
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(text if text.startswith("config error") else f"config error: {text}") from None
