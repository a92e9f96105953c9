"""``m2flow-train`` and ``m2flow-eval``: Hydra-composed configs, errors as one line.

    m2flow-train                                   # the default job (PushCube, PPO, MLP)
    m2flow-train --config-name maniskill_pickcube_ppo_mlp env.num_envs=4
    m2flow-train --cfg                             # print the composed config and exit
    m2flow-train resume=latest                     # continue this config's newest checkpoint
    m2flow-train -m seed=0,1,2                     # a sweep: one run per job, then a summary
    m2flow-eval checkpoint=runs/.../checkpoints/last.pt episodes=50
    m2flow-eval checkpoint=runs/maniskill_pickcube_ppo_mlp     # its newest run's newest checkpoint
    m2flow-eval env=libero_spatial policy=cnn episodes_per_task=2

This module holds the one table of workloads (below); it is the only module that knows more
than one of them. A config names its workload in its ``workload`` field (set by its schema);
a checkpoint carries the same tag.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Optional, Sequence

from m2flow.runs.workload import Workload

WORKLOADS = {
    "embodied": "m2flow.embodied.workload:WORKLOAD",
    "reasoning": "m2flow.reasoning.workload:WORKLOAD",
}
PLANNERS = {  # each workload's profiler for m2flow-plan (m2flow.planning)
    "embodied": "m2flow.embodied.profile",
    "reasoning": "m2flow.reasoning.profile",
}
DEFAULT_CONFIG = "maniskill_pushcube_ppo_mlp"
DEFAULT_EVAL_CONFIG = "eval"  # m2flow/configs/eval.yaml
EXIT_FAILED, EXIT_CONFIG, EXIT_INTERRUPTED = 1, 2, 130  # 143 after SIGTERM


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


def load_run_config(config_name: str, overrides: Sequence[str] = (), *, make_plan: bool = True):
    """Entry config ``config_name`` with ``overrides``, as its workload's config object,
    checked (names, ranges, cross-field rules) before anything starts. ``make_plan=False``:
    ``cluster.plan=auto`` stays as it is (making the plan measures the components; a plan
    file is applied either way).

    >>> cfg = load_run_config("maniskill_pushcube_ppo_mlp", ["env.num_envs=2"])
    >>> cfg.env.num_envs, cfg.workload
    (2, 'embodied')
    """
    from m2flow.configs import load_config

    register_schemas()
    composed = load_config(config_name, overrides)
    if composed.cluster.plan is not None and (make_plan or str(composed.cluster.plan) != "auto"):
        # a plan file (or a plan made now) applied
        from m2flow.planning import with_plan

        composed = with_plan(config_name, overrides, composed)
    return _run_config(composed)


def _run_config(composed):
    """A composed config as its workload's config object, ``resume`` resolved, checked."""
    from m2flow.configs import to_object

    w = workload(composed.workload)
    obj = to_object(composed)
    _resolve_resume(obj)
    _resolve_init(obj)
    _check(w, obj)
    return obj


def _resolve_init(cfg) -> None:
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


def _resolve_resume(cfg) -> None:
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


def load_eval_config(overrides: Sequence[str]) -> tuple[object, Optional[dict]]:
    """(config, checkpoint state or None) for ``m2flow-eval``:

    - ``checkpoint=PATH [key=value ...]``: the checkpoint's own config (its workload's schema,
      from the checkpoint's tag), overrides and config-group options on top;
    - otherwise a Hydra-composed config (entry config ``config=NAME``, default ``eval``) with
      the policy's initial weights: ``m2flow-eval env=libero_spatial policy=cnn``.
    """
    from omegaconf import OmegaConf

    from m2flow.configs import ConfigError, load_config
    from m2flow.configs.loader import group_option, merge_onto, to_object
    from m2flow.runs import checkpoint

    register_schemas()
    pairs = []
    for ov in overrides:
        key, sep, value = ov.partition("=")
        if not sep:
            raise ConfigError(f"config error: {ov!r} is not key=value (e.g. checkpoint=path.pt).")
        pairs.append((key, value))
    shorthands = {"checkpoint": "eval.checkpoint", "output_dir": "eval.output_dir"}
    if not any(k in ("checkpoint", "eval.checkpoint") for k, _ in pairs):
        name = next((v for k, v in pairs if k == "config"), DEFAULT_EVAL_CONFIG)
        w = workload(load_config(name).workload)  # which shorthands apply
        shorthands.update(w.eval_shorthands)
        rest = [f"{shorthands.get(k, k)}={v}" for k, v in pairs if k != "config"]
        cfg = to_object(load_config(name, rest))
        _check(w, cfg)
        return cfg, None
    if any(k == "config" for k, _ in pairs):
        raise ConfigError("config error: config=NAME starts from an entry config; with "
                          "checkpoint=PATH the checkpoint's own config is used. Drop one.")
    path = next(v for k, v in pairs if k in ("checkpoint", "eval.checkpoint"))
    try:
        path = str(checkpoint.resolve(path))  # a run directory, or a folder of runs: newest
        pairs = [(k, path if k in ("checkpoint", "eval.checkpoint") else v) for k, v in pairs]
        state = checkpoint.load(path)
    except ValueError as e:
        raise ConfigError(f"config error: checkpoint={path}: {e}") from None
    w = workload(state.get("workload", "embodied"))
    shorthands.update(w.eval_shorthands)
    dotlist, groups = [], []
    for key, value in pairs:
        if key in ("env", "policy", "algorithm", "cluster", "runner"):
            groups.append(group_option(key, value))
        else:
            dotlist.append(f"{shorthands.get(key, key)}={value}")
    saved = OmegaConf.create(state["config"])
    try:
        base = w.typed_base(saved) if w.typed_base else w.config_class
    except ValueError as e:  # e.g. the algorithm that wrote it is not installed here
        raise ConfigError(f"config error: checkpoint={path}: {e}") from None
    merged = merge_onto(base, saved, *groups, OmegaConf.from_dotlist(dotlist))
    cfg = to_object(merged)
    _check(w, cfg)
    return cfg, state


def _check(w: Workload, cfg) -> None:
    from m2flow.configs import ConfigError

    try:
        w.check(cfg)
    except ConfigError:
        raise
    except ValueError as e:  # a component's own check: make it the one config-error line
        text = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(text if text.startswith("config error") else f"config error: {text}") from None


def _quiet_ctrl_c(prog: str):
    """Ctrl-C while the command loads (imports, config checks; nothing is started yet) ends
    it at once with one line and exit code 130. A KeyboardInterrupt would not do: a library
    cut short mid-import fails in odd ways, with a traceback. ``_interruptible`` takes over
    when the run starts."""
    def wrap(main):
        @functools.wraps(main)
        def run(argv: Optional[list[str]] = None) -> int:
            def leave(signum, frame):
                sys.stdout.flush()
                lead = "\n" if sys.stderr.isatty() else ""
                print(f"{lead}{prog}: interrupted during start-up; nothing was saved.",
                      file=sys.stderr, flush=True)
                os._exit(EXIT_INTERRUPTED)

            previous = signal.signal(signal.SIGINT, leave)
            try:
                return main(argv)
            finally:
                signal.signal(signal.SIGINT, previous)
        return run
    return wrap


@_quiet_ctrl_c("m2flow-train")
def train(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="m2flow-train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config-name", "-cn", default=DEFAULT_CONFIG,
                        help=f"entry config in m2flow/configs (default: {DEFAULT_CONFIG})")
    parser.add_argument("--cfg", action="store_true", help="print the composed config and exit")
    parser.add_argument("--multirun", "-m", action="store_true",
                        help="run every job of the sweeps in the overrides (seed=0,1,2 "
                             "algorithm.learning_rate=1e-4,3e-4), then print a summary table")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. env.num_envs=4 cluster=inprocess")
    args = parser.parse_args(argv)
    from m2flow.configs import ConfigError
    from m2flow.configs.loader import sweeps

    if args.multirun:
        from m2flow.sweep import multirun

        return multirun(args.config_name, args.overrides, show_cfg=args.cfg)
    try:
        swept = sweeps(args.overrides)
        if swept:
            raise ConfigError(
                f"config error: {swept[0]} gives several values (a sweep); run every job with "
                f"-m (m2flow-train -m {shlex.join(args.overrides)}), or give one value.")
        cfg = load_run_config(args.config_name, args.overrides, make_plan=not args.cfg)
    except ConfigError as e:
        print(f"m2flow-train: {e}", file=sys.stderr)
        return EXIT_CONFIG
    if args.cfg:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        return 0
    _setup_logging()
    w = workload(cfg.workload)
    return _interruptible("m2flow-train", lambda: w.train(cfg),
                          command=lambda ckpt: _train_command(args.config_name, args.overrides, ckpt),
                          hint=lambda: w.memory_hint(cfg) if w.memory_hint else "", cfg=cfg)


@_quiet_ctrl_c("m2flow-eval")
def evaluate(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="m2flow-eval", description=EVAL_HELP,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*",
                        help="checkpoint=PATH or config groups (env=..., policy=...), "
                             "episodes_per_task=N, videos_per_task=K, and dotted overrides")
    args = parser.parse_args(argv)
    from m2flow.configs import ConfigError

    try:
        cfg, state = load_eval_config(args.overrides)
    except ConfigError as e:
        print(f"m2flow-eval: {e}", file=sys.stderr)
        return EXIT_CONFIG
    _setup_logging()
    w = workload(cfg.workload)
    env = getattr(cfg, "env", None)  # no learner here: only the simulators' count to lower
    return _interruptible("m2flow-eval", lambda: w.evaluate(cfg, state),
                          hint=lambda: f"lower env.num_envs (now {env.num_envs})" if env else "",
                          cfg=cfg)


def _interruptible(prog: str, run, command=None, hint=lambda: "", cfg=None) -> int:
    """Runs ``run`` with Ctrl-C (and SIGTERM) handled as ``runs.session.stop_on_ctrl_c``
    says: it stops within seconds in any phase and ends with one line saying where; with
    ``command`` (the command line that resumes from a checkpoint, or starts again from None),
    that too; exit code 130 (143 after SIGTERM).

    A failure ends it with one line too (exit code 1): a worker that died (killed, crashed,
    or for memory: then the fields to change, ``hint()``), a channel that stopped
    delivering, an exception raised in a worker or here. The line names the worker, its
    method and the cause, the phase, the checkpoint and how to resume; the traceback goes to
    the run's ``train.log`` (``runs.session.run_failed``, for the run of ``cfg``; without
    ``cfg`` only the failures a runner turned into a ``RunFailed`` are one line)."""
    from m2flow.pipelines.futures import Stopped
    from m2flow.runs.session import (
        RunFailed,
        RunInterrupted,
        current_phase,
        run_failed,
        stop_on_ctrl_c,
        stop_signal,
    )

    restore = stop_on_ctrl_c()
    try:
        return run()
    except (Stopped, RunInterrupted, KeyboardInterrupt) as e:
        if isinstance(e, RunInterrupted):
            line = e.describe(command)
        else:  # before the run's loop (start-up), or a run with no loop (m2flow-eval)
            again = f"; start again with: {command(None)}" if command else "; nothing was saved."
            line = f"interrupted during {current_phase()}{again}"
        lead = "\n" if sys.stderr.isatty() else ""  # off a progress bar's line
        print(f"{lead}{prog}: {line}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Workers, simulators, Ray and the run's files are closed by now; the interpreter's
        # own teardown (torch, Ray, simulator modules) would take 1-2 s more.
        os._exit(128 + (stop_signal() or signal.SIGINT))
    except Exception as e:
        if not isinstance(e, RunFailed):  # before the run's loop (start-up), or m2flow-eval
            if cfg is None:
                raise
            e = run_failed(e, cfg, hint=hint())
        lead = "\n" if sys.stderr.isatty() else ""
        print(f"{lead}{prog}: {e.describe(command)}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        restore()


def _train_command(config_name: str, overrides: Sequence[str], checkpoint=None) -> str:
    """The ``m2flow-train`` command line with the user's overrides that resumes from
    ``checkpoint`` (replacing any ``resume=``); None: the user's command as it was.

    >>> _train_command("maniskill_pushcube_ppo_mlp", ["env.num_envs=2", "resume=a.pt"], "b b.pt")
    "m2flow-train --config-name maniskill_pushcube_ppo_mlp env.num_envs=2 'resume=b b.pt'"
    """
    kept = list(overrides)
    if checkpoint is not None:
        kept = [o for o in kept if o.partition("=")[0].lstrip("+") != "resume"]
        kept.append(f"resume={checkpoint}")
    return shlex.join(["m2flow-train", "--config-name", config_name, *kept])


EVAL_HELP = """m2flow-eval: N episodes per task of any registered env, with a checkpoint or a policy
config's initial weights; writes results.json, results.md and MP4 videos.

    m2flow-eval checkpoint=runs/.../checkpoints/last.pt episodes=64
    m2flow-eval env=libero_spatial policy=cnn episodes_per_task=2 videos_per_task=1
    m2flow-eval config=libero_spatial_ppo_cnn episodes_per_task=50
    m2flow-eval checkpoint=runs/reasoning_arith_grpo_tiny/.../checkpoints/last.pt size=200
"""


def _setup_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
