"""The run session: what every workload's run is made of, in one place.

A runner (embodied, reasoning, or a new workload) opens a :class:`RunSession` and gets its
three parts, each with one job, and the control that ties them together:

- ``workers`` (:class:`~m2flow.runs.workers.RunWorkers`): the cluster, the validated placement,
  worker groups (``session.group("rollout", RolloutWorker, ...)``, or ``session.launch`` for
  groups that build at once) and the links between them
  (``session.weight_link``), the context switcher (``take_turns``), the watchdog, timings;
- ``files`` (:class:`~m2flow.runs.run_files.RunFiles`): the run directory, the logger, the
  progress of a long phase, checkpoints (``save``, ``load``);
- ``control`` (:class:`~m2flow.runs.control.RunControl`): how the run was launched, its phase,
  the stop request (Ctrl-C or SIGTERM stops the run within seconds in any phase) and whether
  it is ending; the command line hands it in, else the session makes its own;
- the end of the run as one line (:mod:`m2flow.runs.failure`): ``stopped`` after Ctrl-C,
  ``failed`` after a failure (a worker that died or raised, a channel that stopped delivering,
  a worker that stalled), its traceback in the run's ``train.log``.

The methods below are the parts' own, named here so a runner reads ``self.session.save(...)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from m2flow.pipelines import ContextSwitcher, WorkerGroup
from m2flow.runs import checkpoint
from m2flow.runs.control import RunControl
from m2flow.runs.failure import (
    EvalInterrupted,
    RunFailed,
    RunInterrupted,
    RunOutOfMemory,
    run_failed,
    saves_on_stop,
)
from m2flow.runs.logger import LogField, Progress, RunLogger
from m2flow.runs.run_files import RunFiles
from m2flow.runs.workers import RunWorkers

# the session and the ends of its run (runs.failure's, importable from here too)
__all__ = ["RunSession", "RunInterrupted", "EvalInterrupted", "RunFailed", "RunOutOfMemory",
           "run_failed"]


class RunSession:
    """Workers, files and control of one run.

    Args:
        cfg: the workload's root config; it has ``cluster``, ``runner`` (``log_dir``,
            ``keep_checkpoints``, ``progress_bar``, ``progress_interval_s``,
            ``stall_timeout_s``), ``run_name`` and ``seed``.
        workload: the workload's name, written into every checkpoint (``"embodied"``).
        best_metric: the metric that ranks checkpoints (``"eval/success_once"``, higher is
            better): the checkpoint with its highest value is kept as ``best.pt``.
        control: the command's :class:`RunControl` (its signal handlers set its stop); None:
            one of the session's own, which only ``control.request_stop()`` stops.
    """

    def __init__(self, cfg: Any, *, workload: str, best_metric: Optional[str] = None,
                 control: Optional[RunControl] = None):
        self.cfg = cfg
        self.control = control if control is not None else RunControl()
        self.control.begin()
        self.workers = RunWorkers(cfg, self.control.stop)
        self.files = RunFiles(cfg, workload=workload, best_metric=best_metric,
                              launch=self.control.launch)
        self.cluster, self.placement = self.workers.cluster, self.workers.placement
        self.phase = "start-up"

    # -- the workers -------------------------------------------------------------------------
    def group(self, name: str, cls: type, *args: Any, **kwargs: Any) -> WorkerGroup:
        return self.workers.group(name, cls, *args, **kwargs)

    def launch(self, name: str, cls: type, *args: Any, **kwargs: Any) -> WorkerGroup:
        return self.workers.launch(name, cls, *args, **kwargs)

    def weight_link(self, learner: WorkerGroup, rollout: WorkerGroup) -> Optional[str]:
        return self.workers.weight_link(learner, rollout)

    def offloads_for(self, components: Sequence[str]) -> dict[str, list[str]]:
        return self.workers.offloads_for(components)

    def take_turns(self, groups: dict[str, WorkerGroup],
                   offloads: dict[str, list[str]]) -> ContextSwitcher:
        return self.workers.take_turns(groups, offloads)

    def timings(self) -> dict[str, float]:
        return self.workers.timings()

    @property
    def links(self) -> list:
        return self.workers.links

    @property
    def switcher(self) -> ContextSwitcher:
        return self.workers.switcher

    # -- the files ---------------------------------------------------------------------------
    def open_run(self, total: int, start: int, fields: Sequence[LogField],
                 bar_fields: Sequence[LogField] = ()) -> RunLogger:
        return self.files.open_run(total, start, fields, bar_fields)

    def progress(self, desc: str, total: int, unit: str = "ep", bar: bool = True) -> Progress:
        return self.files.progress(desc, total, unit, bar)

    def save(self, iteration: int, state: dict, metrics: Optional[dict] = None,
             prefix: str = "iter") -> Path:
        return self.files.save(iteration, state, metrics, prefix)

    def load(self, path: str) -> dict:
        return self.files.load(path)

    @property
    def run_dir(self) -> Optional[Path]:
        return self.files.run_dir

    @property
    def last_checkpoint(self) -> Optional[Path]:
        return self.files.last_checkpoint

    @property
    def saved_iteration(self) -> Optional[int]:
        return self.files.saved_iteration

    # -- the phase and the end ---------------------------------------------------------------
    @property
    def phase(self) -> str:
        """What the run is doing, in words (``"evaluation"``); the stop line names it."""
        return self.control.phase

    @phase.setter
    def phase(self, value: str) -> None:
        self.control.phase = value
        self.workers.watchdog.enter(value)  # measures the phase left: its stall limit

    def stopped(self, exc: BaseException, iteration: int, *, start: int,
                save: Callable[[], Any], learner: str = "learner", unit: str = "iterations",
                resumed_from: Optional[str] = None) -> RunInterrupted:
        """What a runner raises when Ctrl-C ended its loop: ``exc`` is ``Stopped`` (the first
        Ctrl-C), or ``KeyboardInterrupt`` (a second one: nothing more is saved).

        After a first Ctrl-C, ``save()`` writes the last completed ``iteration`` when
        :func:`~m2flow.runs.failure.saves_on_stop` says so (the learner idle, an iteration
        past ``start`` without a checkpoint). A second Ctrl-C during that save abandons it.

        Args:
            iteration: iterations (or steps) completed.
            start: the iteration the run started (or resumed) at.
            save: writes a checkpoint of the current iteration with ``RunSession.save``.
            learner: the group whose calls in flight forbid the save.
            unit: what an iteration is called in the stop line.
            resumed_from: the checkpoint the run resumed from (``cfg.resume``).
        """
        note = ""
        if saves_on_stop(exc, iteration, start=start, saved_iteration=self.saved_iteration,
                         learner=learner):
            try:
                save()
            except KeyboardInterrupt:  # a second Ctrl-C: the last checkpoint stays
                pass
            except checkpoint.CheckpointWriteError as e:  # a full disk: the last one stays
                note = f" (its checkpoint {e})"
        self.control.end()
        return RunInterrupted(iteration, self.files.resume_point(resumed_from), self.phase,
                              unit, note=note)

    def failed(self, exc: BaseException, iteration: Optional[int], *, hint: str = "",
               unit: str = "iterations", resumed_from: Optional[str] = None) -> RunFailed:
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
        self.control.end()
        return run_failed(exc, self.cfg, phase=self.phase, iteration=iteration,
                          checkpoint=self.files.resume_point(resumed_from), unit=unit,
                          hint=hint, run_dir=self.run_dir)

    def close(self) -> None:
        """Ends the workers (calls still running are abandoned) and the cluster."""
        self.control.end()  # a Ctrl-C now would leave processes behind (RunControl)
        self.workers.close()
