"""How a run ends, in one line: stopped (:class:`RunInterrupted`, :class:`EvalInterrupted`) or
failed (:class:`RunFailed`, :class:`RunOutOfMemory`, :func:`run_failed`: the traceback goes to
the run's ``train.log``), each naming the phase, the iterations done and the checkpoint to
resume from; and whether a stop saves the last iteration first (:func:`saves_on_stop`).

>>> RunInterrupted(3, None, "collection").describe()
'interrupted during collection after 3 iterations; no checkpoint was written.'
"""

from __future__ import annotations

import re
import sys
import traceback
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, Optional

from m2flow.pipelines.errors import OutOfMemory, failure_cause
from m2flow.pipelines.futures import Stopped
from m2flow.runs.checkpoint import CheckpointWriteError
from m2flow.runs.logger import LOG_FILE
from m2flow.runs.run_files import new_run_dir


def saves_on_stop(exc: BaseException, iteration: int, *, start: int,
                  saved_iteration: Optional[int], learner: str = "learner") -> bool:
    """Whether a stop (``exc``) saves the last completed ``iteration`` before the run ends: it
    is a first Ctrl-C (``Stopped``, not the ``KeyboardInterrupt`` of a second one), the driver
    was not waiting on group ``learner`` (no call of the learner in flight: an update would
    change the state while it is read), the run got past ``start``, and that iteration has no
    checkpoint yet (``saved_iteration``).

    >>> saves_on_stop(Stopped(["env.collect()"]), 3, start=0, saved_iteration=None)
    True
    >>> saves_on_stop(Stopped(["learner.update()", "env.collect()"]), 3, start=0,
    ...               saved_iteration=None)
    False
    >>> saves_on_stop(KeyboardInterrupt(), 3, start=0, saved_iteration=None)
    False
    >>> saves_on_stop(Stopped([]), 3, start=3, saved_iteration=None)  # nothing new
    False
    >>> saves_on_stop(Stopped([]), 3, start=0, saved_iteration=3)  # saved already
    False
    """
    learner_busy = not isinstance(exc, Stopped) or any(
        w.startswith(f"{learner}.") for w in exc.waiting_on)
    return not learner_busy and iteration > start and saved_iteration != iteration


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


class EvalFailed(Exception):
    """An evaluation (``m2flow-eval``) ended by ``exc`` after counting ``episodes`` of
    ``asked``, kept in the partial report in ``report`` (None: none was written).
    :func:`run_failed` turns it into ``exc``'s line, which then says what was kept."""

    def __init__(self, exc: BaseException, episodes: int, asked: int, report: Optional[Path]):
        super().__init__(str(exc))
        self.exc, self.episodes, self.asked, self.report = exc, episodes, asked, report

    def kept(self) -> str:
        """``"; 72 of 200 episodes kept: partial report in eval/<time>"`` (or ``"; no episode
        was counted"``)."""
        if self.report is None:
            return f"; no episode of {self.asked} was counted"
        return f"; {self.episodes} of {self.asked} episodes kept: partial report in {self.report}"


class RunFailed(RuntimeError):
    """A run ended by an error: a worker that died (killed or crashed), a channel that stopped
    delivering, an exception raised in a worker (or in the driver). ``cause`` names the worker,
    its method and what it raised (:func:`~m2flow.pipelines.errors.failure_cause`), ``log`` the
    file that holds the traceback, ``checkpoint`` the one to resume from (None: none was
    written). Not an interruption: a sweep records it as the job's failure and goes on."""

    def __init__(self, iteration: Optional[int], checkpoint: Optional[Path],
                 phase: str = "the run", unit: str = "iterations", cause: str = "",
                 log: Optional[Path] = None, kept: str = ""):
        """``iteration`` None: before the run's loop (start-up, or an evaluation); ``kept``:
        what an evaluation kept (``EvalFailed.kept``)."""
        self.iteration, self.checkpoint, self.phase, self.unit = iteration, checkpoint, phase, unit
        self.cause, self.log, self.kept = cause.rstrip("."), log, kept
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
        if self.kept:  # an evaluation: what it kept, and nothing to resume
            return f"{self.headline()}{where}{self.kept}."
        return _end_line(self.headline() + where, self.checkpoint, command)


class RunOutOfMemory(RunFailed):
    """A run ended because a worker was killed for memory (an
    :class:`~m2flow.pipelines.OutOfMemory`): the worker and the node's memory (``cause``),
    what to change (``hint``: the fields that size the run's memory), and the checkpoint to
    resume from once they are changed. Not an interruption: a sweep goes on to its next job."""

    what = "out of memory"

    def __init__(self, iteration: Optional[int], checkpoint: Optional[Path],
                 phase: str = "the run", unit: str = "iterations", cause: str = "",
                 hint: str = "", log: Optional[Path] = None, kept: str = ""):
        """``iteration`` None: before the run's loop (start-up, or an evaluation)."""
        self.hint = hint
        super().__init__(iteration, checkpoint, phase, unit, cause, log, kept)

    def describe(self, command: Optional[Callable[[Optional[Path]], str]] = None) -> str:
        """``out of memory during learning after 3 iterations: <cause>; <hint>; checkpoint
        ...; resume with: ...``"""
        head = self.headline()
        if self.hint:
            head = f"{head}; {self.hint}"
        if self.kept:  # an evaluation: what it kept, and nothing to resume
            return f"{head}{self.kept}."
        if self.checkpoint is None:  # the same command would run out again: no command
            return f"{head}; no checkpoint was written."
        return _end_line(head, self.checkpoint, command, resume="with those changed, resume")


def run_failed(exc: BaseException, cfg: Any, *, phase: str, iteration: Optional[int] = None,
               checkpoint: Optional[Path] = None, unit: str = "iterations", hint: str = "",
               run_dir: Optional[Path] = None) -> RunFailed:
    """``exc``, which ended the run of ``cfg`` during ``phase`` (its ``RunControl.phase``),
    as the run's one line (a :class:`RunOutOfMemory` for an
    :class:`~m2flow.pipelines.OutOfMemory`, with ``hint``); its traceback appended to
    ``run_dir``'s ``train.log``. Without ``run_dir`` (a failure before the run's loop opened
    it: start-up, or ``m2flow-eval``) a run directory is made for it, as
    ``RunFiles.open_run`` makes one. An :class:`EvalFailed` is its error's line, with what
    the evaluation kept."""
    kept = ""
    if isinstance(exc, EvalFailed):
        kept, exc = exc.kept(), exc.exc
    try:
        log_path = _log_traceback(exc, run_dir or new_run_dir(cfg))
    except OSError as e:  # no run directory to write to: the traceback has only the terminal
        if not isinstance(exc, CheckpointWriteError):  # (its line says it all)
            traceback.print_exception(exc)
            print(f"(the traceback above could not be written to the run's log: {e})",
                  file=sys.stderr)
        log_path = None
    if isinstance(exc, OutOfMemory):
        return RunOutOfMemory(iteration, checkpoint, phase, unit, cause=str(exc), hint=hint,
                              log=log_path, kept=kept)
    return RunFailed(iteration, checkpoint, phase, unit, cause=failure_cause(exc), log=log_path,
                     kept=kept)



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

