"""What every m2flow command shares: exit codes, config loading and its one-line errors,
interrupt handling (Ctrl-C, SIGTERM) and the end line a run leaves on stderr.

The commands sit above this module, one module each (:mod:`m2flow.cli.train`, ``eval``,
``plan``, ``sweep``, ``demos``, ``plot``); the table of workloads and the checked config
object are below it (:mod:`m2flow.cli.workloads`), with the plan maker in between
(:mod:`m2flow.cli.planning`: ``cluster.plan`` is applied while a config loads).
"""

from __future__ import annotations

import functools
import logging
import os
import shlex
import signal
import sys
from typing import Optional, Sequence

from m2flow.cli.workloads import check_config, register_schemas, run_config, workload

DEFAULT_CONFIG = "maniskill_pushcube_ppo_mlp"
DEFAULT_EVAL_CONFIG = "eval"  # m2flow/configs/eval.yaml
EXIT_FAILED, EXIT_CONFIG, EXIT_INTERRUPTED = 1, 2, 130  # 143 after SIGTERM


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
        from m2flow.cli.planning import with_plan  # (imports the planner only when used)

        composed = with_plan(config_name, overrides, composed)
    return run_config(composed)


def load_eval_config(overrides: Sequence[str]) -> tuple[object, Optional[dict]]:
    """(config, checkpoint state or None) for ``m2flow-eval``:

    - ``checkpoint=PATH [key=value ...]``: the checkpoint's own config (its workload's schema,
      from the checkpoint's tag; one written by an older version in this one's layout),
      overrides and config-group options on top;
    - otherwise a Hydra-composed config (entry config ``config=NAME``, default ``eval``) with
      the policy's initial weights: ``m2flow-eval env=libero_spatial policy=cnn``.
    """
    from omegaconf import OmegaConf

    from m2flow.configs import ConfigError, load_config
    from m2flow.configs.loader import check_retired, group_option, merge_onto, to_object
    from m2flow.runs import checkpoint

    register_schemas()
    check_retired(overrides)
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
        check_config(w, cfg)
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
    try:  # its own config fits this m2flow's settings (an older m2flow's may not)
        merge_onto(w.typed_base(saved) if w.typed_base else w.config_class, saved)
    except ConfigError as e:
        raise ConfigError(unfit_checkpoint(path, str(e), state.get("m2flow_version"))) from None
    except ValueError as e:  # e.g. the algorithm that wrote it is not installed here
        raise ConfigError(f"config error: checkpoint={path}: {e}") from None
    given = OmegaConf.from_dotlist(dotlist)
    try:  # typed by the names the run will have (a group or an override may change them)
        base = (w.typed_base(OmegaConf.merge(saved, *groups, given)) if w.typed_base
                else w.config_class)
    except ValueError as e:  # e.g. the algorithm that wrote it is not installed here
        raise ConfigError(f"config error: checkpoint={path}: {e}") from None
    merged = merge_onto(base, saved, *groups, given)
    cfg = to_object(merged)
    check_config(w, cfg)
    return cfg, state


def unfit_checkpoint(path: str, error: str, version: Optional[str]) -> str:
    """The one line refusing checkpoint ``path`` whose own config does not fit this m2flow's
    settings (``error``: the merge's config-error line; its first clause names the field),
    written by m2flow ``version`` (None: before checkpoints recorded it). Such a checkpoint
    (one written before each env and policy had settings of their own, with ``env.kwargs``)
    is refused as a whole, like any other this m2flow cannot read, not converted.

    >>> import m2flow
    >>> line = unfit_checkpoint("last.pt", "config error: env.kwargs is gone: its entries "
    ...                         "are fields of env now; move them up one level: env.<entry>.", None)
    >>> line.replace(m2flow.__version__, "X")
    "config error: checkpoint=last.pt: its config does not fit this m2flow's (X) settings (env.kwargs is gone: its entries are fields of env now): it was written by m2flow (unknown version); evaluate it with that m2flow."
    """
    import re

    import m2flow

    detail = re.split(r"[.;] ", error.removeprefix("config error: "), maxsplit=1)[0]
    return (f"config error: checkpoint={path}: its config does not fit this m2flow's "
            f"({m2flow.__version__}) settings ({detail.rstrip('.')}): it was written by m2flow "
            f"{version or '(unknown version)'}; evaluate it with that m2flow.")


def quiet_ctrl_c(prog: str):
    """Ctrl-C while the command loads (imports, config checks; nothing is started yet) ends
    it at once with one line and exit code 130. A KeyboardInterrupt would not do: a library
    cut short mid-import fails in odd ways, with a traceback. ``interruptible`` takes over
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


def signals_as_ctrl_c():
    """For a command without workers to stop in order (``m2flow-demos``, ``m2flow-plan``):
    SIGTERM raises ``KeyboardInterrupt`` in the main thread as Ctrl-C does, so both end the
    command through one ``except KeyboardInterrupt``. Returns (the function that puts the old
    handlers back, the function giving the exit code of the signal that stopped it: 130 for
    Ctrl-C, 143 for SIGTERM). Ray's core worker installs its own SIGTERM handler when it
    connects; ``pipelines.cluster`` puts this one back."""
    got = [signal.SIGINT]

    def on_sigterm(signum, frame):
        got[0] = signal.SIGTERM
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: the stop is under way
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    return (lambda: signal.signal(signal.SIGTERM, previous)), (lambda: 128 + got[0])


def interruptible(prog: str, run, *, control, command=None, hint=lambda: "", cfg=None) -> int:
    """Runs ``run`` (which hands ``control``, a ``runs.control.RunControl``, to the run it
    starts) with Ctrl-C (and SIGTERM) handled as ``RunControl.handle_signals`` says: it stops
    within seconds in any phase and ends with one line saying where; with ``command`` (the
    command line that resumes from a checkpoint, or starts again from None), that too; exit
    code 130 (143 after SIGTERM).

    A failure ends it with one line too (exit code 1): a worker that died (killed, crashed,
    or for memory: then the fields to change, ``hint()``), a channel that stopped
    delivering, an exception raised in a worker or here. The line names the worker, its
    method and the cause, the phase, the checkpoint and how to resume; the traceback goes to
    the run's ``train.log`` (``runs.failure.run_failed``, for the run of ``cfg``; without
    ``cfg`` only the failures a runner turned into a ``RunFailed`` are one line)."""
    from m2flow.pipelines.futures import Stopped
    from m2flow.runs.failure import RunFailed, RunInterrupted, run_failed

    restore = control.handle_signals()
    try:
        return run()
    except (Stopped, RunInterrupted, KeyboardInterrupt) as e:
        if isinstance(e, RunInterrupted):
            line = e.describe(command)
        else:  # before the run's loop (start-up), or a run with no loop (m2flow-eval)
            again = f"; start again with: {command(None)}" if command else "; nothing was saved."
            line = f"interrupted during {control.phase}{again}"
        lead = "\n" if sys.stderr.isatty() else ""  # off a progress bar's line
        print(f"{lead}{prog}: {line}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Workers, simulators, Ray and the run's files are closed by now; the interpreter's
        # own teardown (torch, Ray, simulator modules) would take 1-2 s more.
        os._exit(control.exit_code())
    except Exception as e:
        if not isinstance(e, RunFailed):  # before the run's loop (start-up), or m2flow-eval
            if cfg is None:
                raise
            e = run_failed(e, cfg, phase=control.phase, hint=hint())
        lead = "\n" if sys.stderr.isatty() else ""
        print(f"{lead}{prog}: {e.describe(command)}", file=sys.stderr, flush=True)
        return EXIT_FAILED
    finally:
        restore()


def resumed_launch(overrides: Sequence[str]) -> Optional[tuple[str, list[str]]]:
    """``m2flow-train resume=<checkpoint or run>`` without ``--config-name``: the entry config
    and overrides the run was launched with (kept in its checkpoints, ``runs.control.
    launch``), its ``resume=`` replaced by ``overrides`` (which come last, so they win);
    None where there is no such ``resume=`` or the checkpoint kept no command (a run of an
    older m2flow, or one not started by the CLI): the default config is composed then, and a
    checkpoint of another config is refused at start-up, naming its ``config.yaml``."""
    from m2flow.runs import checkpoint

    given = [o.partition("=")[2] for o in overrides if _is_resume(o)]
    if not given or given[-1] in ("latest", "auto", "null", "None", ""):
        return None
    try:
        state = checkpoint.load(checkpoint.resolve(given[-1]), mmap=True)
    except (checkpoint.CheckpointError, OSError, RuntimeError):
        return None  # the start-up checks say what is wrong with it, in one line
    launch = state.get("launch") if isinstance(state, dict) else None
    if not launch:
        return None
    kept = [o for o in launch["overrides"] if not _is_resume(o)]
    return launch["config_name"], kept + list(overrides)


def _is_resume(override: str) -> bool:
    return override.partition("=")[0].lstrip("+") == "resume"


def train_command(config_name: str, overrides: Sequence[str], checkpoint=None) -> str:
    """The ``m2flow-train`` command line with the user's overrides that resumes from
    ``checkpoint`` (replacing any ``resume=``); None: the user's command as it was.

    >>> train_command("maniskill_pushcube_ppo_mlp", ["env.num_envs=2", "resume=a.pt"], "b b.pt")
    "m2flow-train --config-name maniskill_pushcube_ppo_mlp env.num_envs=2 'resume=b b.pt'"
    """
    kept = list(overrides)
    if checkpoint is not None:
        kept = [o for o in kept if not _is_resume(o)]
        kept.append(f"resume={checkpoint}")
    return shlex.join(["m2flow-train", "--config-name", config_name, *kept])


def print_config(cfg) -> int:
    """``--cfg``: the composed config object as YAML on stdout; exit code 0."""
    from omegaconf import OmegaConf

    print(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    return 0


def setup_logging() -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
