"""The run session: what every workload's run is made of, in one place.

A runner (embodied, reasoning, or a new workload) opens a :class:`RunSession` and gets:

- the cluster and the validated placement of its components;
- worker groups (``session.group("rollout", RolloutWorker, ...)``), shut down in reverse order
  by ``close()``, and the links between them (``session.weight_link``: the torch.distributed group
  weights are broadcast over with ``cluster.weight_sync=dist``);
- the context switcher for the components that share a device (``take_turns``);
- per-component timings by one rule: ``time/<group>_<phase>``, the slowest rank's seconds;
- the run directory (``<log_dir>/<run_name>/<timestamp>/`` with ``config.yaml``), the logger;
- checkpoints tagged with their workload, written atomically, the newest ``keep_checkpoints``
  kept plus the best by evaluation (``best.pt``), ``last.pt`` pointing at the newest, and
  ``load`` refusing another workload's file;
- the progress of a long phase (``progress``: an evaluation's episodes), in the bar or as
  lines in the log;
- Ctrl-C (or SIGTERM) that stops the run within seconds in any phase (``stop_on_ctrl_c``,
  ``stopped``);
- a failure (a worker that died or raised, a channel that stopped delivering, a worker that
  stalled: :mod:`m2flow.pipelines.watchdog`, limited by ``runner.stall_timeout_s``) as one
  line, its traceback in the run's ``train.log`` (``failed``, :func:`run_failed`).
"""

from __future__ import annotations

import math
import os
import re
import signal
import sys
import threading
import traceback
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from omegaconf import OmegaConf

from m2flow.pipelines import (
    Cluster,
    ContextSwitcher,
    Placement,
    WorkerGroup,
    offloads_for,
)
from m2flow.pipelines.link import LinkGroup, form_link, weight_sync_transport
from m2flow.pipelines.errors import OutOfMemory, failure_cause
from m2flow.pipelines import watchdog
from m2flow.pipelines.futures import Stopped, clear_stop, request_stop
from m2flow.runs import checkpoint
from m2flow.runs.logger import LOG_FILE, LogField, Progress, RunLogger, announce, log, terminal


_LAUNCH: Optional[dict] = None  # the command of the run under way (launched_as)


@contextmanager
def launched_as(config_name: str, overrides: Sequence[str]) -> Iterator[None]:
    """While it lasts, the runs started in this process were launched as ``m2flow-train
    --config-name <config_name> <overrides>``: every checkpoint keeps that (``launch``), so
    that ``m2flow-train resume=<run>`` alone composes the run's own config again
    (``m2flow.cli.common.resumed_launch``). The CLI sets it; a run without it saves none."""
    global _LAUNCH
    previous, _LAUNCH = _LAUNCH, {"config_name": config_name, "overrides": list(overrides)}
    try:
        yield
    finally:
        _LAUNCH = previous


class RunSession:
    """Cluster, placement, worker groups, switcher, run directory and checkpoints of one run.

    Args:
        cfg: the workload's root config; it has ``cluster``, ``runner`` (``log_dir``,
            ``keep_checkpoints``, ``progress_bar``, ``progress_interval_s``), ``run_name``
            and ``seed``.
        workload: the workload's name, written into every checkpoint (``"embodied"``).
        best_metric: the metric that ranks checkpoints (``"eval/success_once"``, higher is
            better): the checkpoint with its highest value is kept as ``best.pt``.
    """

    def __init__(self, cfg: Any, *, workload: str, best_metric: Optional[str] = None):
        self.cfg = cfg
        self.workload = workload
        self.best_metric = best_metric
        self.best_score: Optional[float] = None  # best_metric of best.pt
        self.logger: Optional[RunLogger] = None
        # a worker that stops making progress ends the run (pipelines.watchdog)
        self.watchdog = watchdog.Watchdog(cfg.runner.stall_timeout_s)
        self.cluster = Cluster(cfg.cluster)
        self.placement = Placement(cfg.cluster.placement, self.cluster.nodes)
        watchdog.install(self.watchdog)
        self.groups: list[WorkerGroup] = []
        self.links: list[LinkGroup] = []
        self.switcher = ContextSwitcher({}, {})  # nobody takes turns until take_turns()
        self.run_dir: Optional[Path] = None
        self.last_checkpoint: Optional[Path] = None
        self.saved_iteration: Optional[int] = None  # the iteration of last_checkpoint
        self.phase = "start-up"

    # -- workers -----------------------------------------------------------------------------
    def group(self, name: str, cls: type, *args: Any, **kwargs: Any) -> WorkerGroup:
        """Starts the ranks of component ``name`` (as placed) as workers of class ``cls``."""
        # (its ranks are watched from their launch on: WorkerGroup adds them to the watchdog)
        group = WorkerGroup(self.cluster, name, cls, self.placement.ranks(name), *args, **kwargs)
        self.groups.append(group)
        return group

    def weight_link(self, learner: WorkerGroup, rollout: WorkerGroup) -> Optional[str]:
        """The link weights travel over from learner rank 0 to every rollout rank, formed
        now, when ``cluster.weight_sync`` says so (:mod:`m2flow.pipelines.link`); None: they
        travel as Ray objects. Pass it to ``runs.weights.sync_groups``."""
        transport = weight_sync_transport(self.cfg.cluster.weight_sync, self.cluster.backend,
                                          learner.resources[0], rollout.resources)
        if transport != "dist":
            return None
        self.links.append(form_link(self.cluster, "weights", learner, rollout))
        return self.links[-1].name

    def offloads_for(self, components: Sequence[str]) -> dict[str, list[str]]:
        """Who steps aside for whom among ``components`` on a shared device."""
        return offloads_for(self.placement.shares_device, list(components),
                            self.cfg.cluster.context_switch)

    def take_turns(self, groups: dict[str, WorkerGroup],
                   offloads: dict[str, list[str]]) -> ContextSwitcher:
        """The switcher that hands the shared device to one component at a time."""
        self.switcher = ContextSwitcher(groups, offloads,
                                        force=self.cfg.cluster.context_switch == "always")
        return self.switcher

    def timings(self) -> dict[str, float]:
        """Seconds per component and phase since the last call: the slowest rank's."""
        out: dict[str, float] = {}
        for g in self.groups:
            per_rank = g.call(g.worker_cls.pop_timings).wait()
            for phase in {p for t in per_rank for p in t}:
                out[f"time/{g.name}_{phase}"] = max(t.get(phase, 0.0) for t in per_rank)
        return out

    # -- the run directory -------------------------------------------------------------------
    def open_run(self, total: int, start: int, fields: Sequence[LogField],
                 bar_fields: Sequence[LogField] = ()) -> RunLogger:
        """Creates the run directory with ``config.yaml`` and returns the run's logger."""
        self.run_dir = new_run_dir(self.cfg)
        self.logger = RunLogger(self.run_dir, total, start, bar=self.cfg.runner.progress_bar,
                                fields=fields, bar_fields=bar_fields,
                                progress_every_s=self.cfg.runner.progress_interval_s)
        return self.logger

    def progress(self, desc: str, total: int, unit: str = "ep", bar: bool = True) -> Progress:
        """A long phase's progress (``total`` ``unit``): under the run's bar and in its log
        while a run is open (training); else its own bar on a terminal (with ``bar`` and
        ``runner.progress_bar``), or lines on stdout every ``runner.progress_interval_s``."""
        if self.logger is not None and not self.logger.closed:
            return self.logger.progress(desc, total, unit)
        shown = bar and self.cfg.runner.progress_bar and terminal()
        return Progress(desc, total, unit=unit, bar=shown, write=None if shown else announce,
                        every_s=self.cfg.runner.progress_interval_s)

    # -- checkpoints -------------------------------------------------------------------------
    def save(self, iteration: int, state: dict, metrics: Optional[dict] = None,
             prefix: str = "iter") -> Path:
        """Writes ``<run_dir>/checkpoints/<prefix>_<iteration>.pt`` with ``state`` plus the
        workload, iteration, config and metrics; points ``last.pt`` at it, and ``best.pt`` when
        its ``best_metric`` is at least that of every earlier one (ties: the newer; never a
        checkpoint whose metrics say ``eval/curtailed``); keeps the
        newest ``runner.keep_checkpoints`` (0: all) and the one ``best.pt`` points at."""
        full = {
            **state,
            "workload": self.workload,
            **checkpoint.stamp(),
            "iteration": iteration,
            "config": config_yaml(self.cfg),
            "metrics": {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float))},
            **({"launch": dict(_LAUNCH)} if _LAUNCH is not None else {}),
        }
        folder = self.run_dir / "checkpoints"
        path = checkpoint.save(folder / f"{prefix}_{iteration:05d}.pt", full)
        checkpoint.link_latest(path)
        score = full["metrics"].get(self.best_metric) if self.best_metric else None
        if full["metrics"].get("eval/curtailed"):  # an evaluation cut short ranks nothing
            score = None
        if score is not None and math.isfinite(score) and (
                self.best_score is None or score >= self.best_score):
            checkpoint.link_latest(path, checkpoint.BEST)
            self.best_score = score
        checkpoint.prune(folder, keep=self.cfg.runner.keep_checkpoints, pattern=f"{prefix}_*.pt",
                         protect=(checkpoint.BEST,))
        self.last_checkpoint, self.saved_iteration = path, iteration
        return path

    def load(self, path: str) -> dict:
        """A checkpoint's state; one written by another workload is an error."""
        state = checkpoint.load(path, workload=self.workload)
        log.info(f"resumed from {path} at iteration {state['iteration']}")
        return state

    @property
    def phase(self) -> str:
        """What the run is doing, in words (``"evaluation"``); the stop line names it."""
        return _PHASE[0]

    @phase.setter
    def phase(self, value: str) -> None:
        _PHASE[0] = value
        self.watchdog.enter(value)  # measures the phase left: its stall limit

    def stopped(self, exc: BaseException, iteration: int, *, start: int,
                save: Callable[[], Any], learner: str = "learner", unit: str = "iterations",
                resumed_from: Optional[str] = None) -> "RunInterrupted":
        """What a runner raises when Ctrl-C ended its loop: ``exc`` is ``Stopped`` (the first
        Ctrl-C), or ``KeyboardInterrupt`` (a second one: nothing more is saved).

        After a first Ctrl-C, ``save()`` writes the last completed ``iteration`` when the
        driver was not waiting on group ``learner`` (so no call of the learner is in flight:
        an update would change the state while it is read), the run got past ``start``, and
        that iteration has no checkpoint yet. A second Ctrl-C during that save abandons it.

        Args:
            iteration: iterations (or steps) completed.
            start: the iteration the run started (or resumed) at.
            save: writes a checkpoint of the current iteration with ``RunSession.save``.
            unit: what an iteration is called in the stop line.
            resumed_from: the checkpoint the run resumed from (``cfg.resume``).
        """
        learner_busy = not isinstance(exc, Stopped) or any(
            w.startswith(f"{learner}.") for w in exc.waiting_on)
        note = ""
        if not learner_busy and iteration > start and self.saved_iteration != iteration:
            try:
                save()
            except KeyboardInterrupt:  # a second Ctrl-C: the last checkpoint stays
                pass
            except checkpoint.CheckpointWriteError as e:  # a full disk: the last one stays
                note = f" (its checkpoint {e})"
        _ENDING.set()
        ckpt = self.last_checkpoint or (Path(resumed_from) if resumed_from else None)
        return RunInterrupted(iteration, ckpt, self.phase, unit, note=note)

    def failed(self, exc: BaseException, iteration: Optional[int], *, hint: str = "",
               unit: str = "iterations",
               resumed_from: Optional[str] = None) -> "RunFailed":
        """What a runner raises when an error ended its loop (``exc``): a worker that died
        (killed, crashed, or by Ray's memory monitor: a :class:`RunOutOfMemory`, with
        ``hint``, the fields that size the run's memory), a channel that stopped delivering,
        an exception raised in a worker or in the driver. Nothing more is saved (a worker may
        be gone, or hold a state half updated); the traceback goes to the run's ``train.log``;
        the last checkpoint (or ``resumed_from``) resumes the run.

        Args:
            iteration: iterations (or steps) completed; None before the run's loop.
            unit: what an iteration is called in the line.
        """
        _ENDING.set()
        ckpt = self.last_checkpoint or (Path(resumed_from) if resumed_from else None)
        return run_failed(exc, self.cfg, iteration=iteration, checkpoint=ckpt, phase=self.phase,
                          unit=unit, hint=hint, run_dir=self.run_dir)

    def close(self) -> None:
        """Ends the workers (calls still running are abandoned) and the cluster."""
        _ENDING.set()  # a Ctrl-C now would leave processes behind (see stop_on_ctrl_c)
        watchdog.uninstall(self.watchdog)  # (a stalled worker is ended with its group)
        for link in self.links:
            link.close()
        self.links = []
        for g in reversed(self.groups):
            g.shutdown()
        self.groups = []
        self.cluster.shutdown()


def config_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


class RunInterrupted(Exception):
    """A run ended by Ctrl-C: after how many iterations (``unit``), during which phase, and
    the checkpoint to resume from (None: there is none yet)."""

    def __init__(self, iteration: int, checkpoint: Optional[Path], phase: str = "the run",
                 unit: str = "iterations", note: str = ""):
        super().__init__(iteration, checkpoint, phase, unit)
        self.iteration, self.checkpoint, self.phase, self.unit = iteration, checkpoint, phase, unit
        self.note = note  # what went wrong on the way out: a checkpoint that was not written

    def describe(self, command: Optional[Callable[[Optional[Path]], str]] = None) -> str:
        """The stop line after ``<program>: ``. ``command(checkpoint)``: the command line that
        resumes from ``checkpoint`` (None: the command that starts the run again)."""
        return _end_line(f"interrupted during {self.phase} after {self.iteration} {self.unit}"
                         f"{self.note}", self.checkpoint, command)


class EvalInterrupted(RunInterrupted):
    """An evaluation (``m2flow-eval``) ended by Ctrl-C or SIGTERM: the episodes it counted of
    those asked, and the folder of the partial report holding them (None: none was written)."""

    def __init__(self, episodes: int, asked: int, report: Optional[Path]):
        super().__init__(episodes, None, "evaluation", f"of {asked} episodes")
        self.report = report

    def describe(self, command: Optional[Callable[[Optional[Path]], str]] = None) -> str:
        """``interrupted during evaluation after 6 of 2000 episodes; partial report in
        eval/<time>.`` (or ``; no report was written.``)."""
        kept = (f"partial report in {self.report}" if self.report is not None
                else "no report was written")
        return f"interrupted during {self.phase} after {self.iteration} {self.unit}; {kept}."


class RunFailed(RuntimeError):
    """A run ended by an error: a worker that died (killed or crashed), a channel that stopped
    delivering, an exception raised in a worker (or in the driver). ``cause`` names the worker,
    its method and what it raised (:func:`~m2flow.pipelines.errors.failure_cause`), ``log`` the
    file that holds the traceback, ``checkpoint`` the one to resume from (None: none was
    written). Not an interruption: a sweep records it as the job's failure and goes on."""

    def __init__(self, iteration: Optional[int], checkpoint: Optional[Path],
                 phase: str = "the run", unit: str = "iterations", cause: str = "",
                 log: Optional[Path] = None):
        """``iteration`` None: before the run's loop (start-up, or an evaluation)."""
        self.iteration, self.checkpoint, self.phase, self.unit = iteration, checkpoint, phase, unit
        self.cause, self.log = cause.rstrip("."), log
        super().__init__(self.describe())

    what = "failed"  # the line's first word(s)

    def headline(self) -> str:
        """The line without the traceback's file and the checkpoint: what failed, during which
        phase, after how many iterations (a sweep's summary row)."""
        after = "" if self.iteration is None else f" after {self.iteration} {self.unit}"
        return f"{self.what} during {self.phase}{after}: {self.cause}"

    def describe(self, command: Optional[Callable[[Optional[Path]], str]] = None) -> str:
        """The line after ``<program>: ``: ``failed during learning after 3 iterations: worker
        learner[rank 0] in update(): ValueError: ... (traceback in .../train.log); checkpoint
        ...; resume with: ...``; ``command`` as for :meth:`RunInterrupted.describe`."""
        where = f" (traceback in {self.log})" if self.log is not None else ""
        return _end_line(self.headline() + where, self.checkpoint, command)


class RunOutOfMemory(RunFailed):
    """A run ended because a worker was killed for memory (an
    :class:`~m2flow.pipelines.OutOfMemory`): the worker and the node's memory (``cause``),
    what to change (``hint``: the fields that size the run's memory), and the checkpoint to
    resume from once they are changed. Not an interruption: a sweep goes on to its next job."""

    what = "out of memory"

    def __init__(self, iteration: Optional[int], checkpoint: Optional[Path],
                 phase: str = "the run", unit: str = "iterations", cause: str = "",
                 hint: str = "", log: Optional[Path] = None):
        """``iteration`` None: before the run's loop (start-up, or an evaluation)."""
        self.hint = hint
        super().__init__(iteration, checkpoint, phase, unit, cause, log)

    def describe(self, command: Optional[Callable[[Optional[Path]], str]] = None) -> str:
        """``out of memory during learning after 3 iterations: <cause>; <hint>; checkpoint
        ...; resume with: ...``"""
        head = self.headline()
        if self.hint:
            head = f"{head}; {self.hint}"
        if self.checkpoint is None:  # the same command would run out again: no command
            return f"{head}; no checkpoint was written."
        return _end_line(head, self.checkpoint, command, resume="with those changed, resume")


def run_failed(exc: BaseException, cfg: Any, *, iteration: Optional[int] = None,
               checkpoint: Optional[Path] = None, phase: Optional[str] = None,
               unit: str = "iterations", hint: str = "",
               run_dir: Optional[Path] = None) -> RunFailed:
    """``exc``, which ended the run of ``cfg``, as the run's one line (a
    :class:`RunOutOfMemory` for an :class:`~m2flow.pipelines.OutOfMemory`, with ``hint``);
    its traceback appended to ``run_dir``'s ``train.log``. Without ``run_dir`` (a failure
    before the run's loop opened it: start-up, or ``m2flow-eval``) a run directory is made
    for it, as ``RunSession.open_run`` makes one. ``phase``: the newest run's by default."""
    phase = phase or current_phase()
    try:
        log_path = _log_traceback(exc, run_dir or new_run_dir(cfg))
    except OSError as e:  # no run directory to write to: the traceback has only the terminal
        if not isinstance(exc, checkpoint.CheckpointWriteError):  # (its line says it all)
            traceback.print_exception(exc)
            print(f"(the traceback above could not be written to the run's log: {e})",
                  file=sys.stderr)
        log_path = None
    if isinstance(exc, OutOfMemory):
        return RunOutOfMemory(iteration, checkpoint, phase, unit, cause=str(exc), hint=hint,
                              log=log_path)
    return RunFailed(iteration, checkpoint, phase, unit, cause=failure_cause(exc), log=log_path)


def new_run_dir(cfg: Any) -> Path:
    """``<runner.log_dir>/<run_name>/<time>/`` with the run's ``config.yaml``, made now."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    run_dir = Path(cfg.runner.log_dir) / cfg.run_name / stamp
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_yaml(cfg))
    return run_dir


def _log_traceback(exc: BaseException, run_dir: Path) -> Path:
    """Appends ``exc``'s traceback (with its notes: a worker's own traceback) to the run's
    log, in the file itself: the run's logger may be closed already."""
    path = run_dir / LOG_FILE
    stamp = datetime.now().strftime("%Y-%m-%d %H:%M:%S,%f")[:-3]  # as the logger writes it
    text = "".join(traceback.format_exception(exc)).rstrip()
    text = re.sub(r"\x1b\[[0-9;]*m", "", text)  # Ray colours a worker's name in its traceback
    with open(path, "a") as f:
        f.write(f"{stamp} the run failed ({failure_cause(exc)}):\n{text}\n")
    return path


def _end_line(head: str, checkpoint: Optional[Path],
              command: Optional[Callable[[Optional[Path]], str]], resume: str = "resume") -> str:
    if checkpoint is None:
        again = f"; start again with: {command(None)}" if command else "."
        return f"{head}; no checkpoint was written{again}"
    resume = (f"; {resume} with: {command(checkpoint)}" if command
              else f" (continue with resume={checkpoint}).")
    return f"{head}; checkpoint {checkpoint}{resume}"


_PHASE = ["start-up"]  # the newest run's phase: a stop before its loop names it too
_ENDING = threading.Event()  # past the stop decision: the run is only ending its workers
_STOP_SIGNAL: list[Optional[int]] = [None]  # the signal that asked the newest run to stop


def current_phase() -> str:
    """The phase of the newest run (``RunSession.phase``), for a stop outside its loop."""
    return _PHASE[0]


def stop_on_ctrl_c() -> Callable[[], None]:
    """Makes Ctrl-C stop a run within seconds in any phase; returns the function that puts
    the previous handler back. Call from the main thread of a command-line program.

    The first Ctrl-C abandons the phase in flight (start-up, collection, learning,
    evaluation, generation): every wait of the driver on its workers ends within
    ``pipelines.futures.WAIT_SLICE_S`` by raising ``Stopped``, and the runner ends its loop
    (``RunSession.stopped``). If no call of the learner is in flight (the Ctrl-C came during
    collection, evaluation or generation, not mid-update) and the last completed iteration
    has no checkpoint yet, that iteration is saved; a save already under way finishes;
    otherwise the last checkpoint stays the one to resume from. A checkpoint is written
    atomically, never half a file. Then the workers and simulators are ended and one line
    says where the run stopped and the command that resumes it (exit code 130).

    A second Ctrl-C skips or abandons that save. Once the workers are being ended, a Ctrl-C
    is ignored (ending them takes seconds); a third one exits at once, leaving behind what
    was not ended yet. Steps that do not wait on workers (starting Ray, building an
    in-process worker such as a simulator or a model) are not cut short: the stop follows
    when they end.

    SIGTERM (``kill``, a scheduler's stop) is handled as a first Ctrl-C, however often it
    comes; the command then exits with 143 (``stop_signal`` says which signal stopped it).
    """
    clear_stop()
    _ENDING.clear()
    _PHASE[0] = "start-up"
    _STOP_SIGNAL[0] = None
    presses = 0

    def handler(signum, frame):
        nonlocal presses
        presses += 1
        if presses == 1:
            request_stop()
            _STOP_SIGNAL[0] = signal.SIGINT
            print("\nCtrl-C: stopping (Ctrl-C again: without saving a checkpoint).",
                  file=sys.stderr, flush=True)
        elif presses >= 3:
            print("\nCtrl-C a third time: exiting now.", file=sys.stderr, flush=True)
            os._exit(128 + signal.SIGINT)
        elif not _ENDING.is_set():
            raise KeyboardInterrupt
        else:
            print("\nCtrl-C: ending the workers (Ctrl-C again: exit at once).",
                  file=sys.stderr, flush=True)

    def on_sigterm(signum, frame):
        nonlocal presses
        if presses == 0:
            presses = 1
            request_stop()
            _STOP_SIGNAL[0] = signal.SIGTERM
            print("\nSIGTERM: stopping, as after a first Ctrl-C.", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, handler), signal.signal(signal.SIGTERM, on_sigterm)

    def restore() -> None:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])
    return restore


def stop_signal() -> Optional[int]:
    """The signal that asked the newest run to stop (SIGINT or SIGTERM); None: none did."""
    return _STOP_SIGNAL[0]
