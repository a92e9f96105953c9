"""The one run loop both workloads fill in: iterate, evaluate, log, checkpoint, stop; Ctrl-C
and failures end it with one line.

A workload's runner subclasses :class:`RunLoop` and fills in what an iteration is
(``iterate``), how it evaluates (``evaluate``), what a checkpoint holds (``checkpoint_state``)
and its own rules (``watch``, ``stop_reason``, ``over_budget``, ``before_loop``). The loop owns
the order, which is the same for both:

    before_loop (once, inside the same error handling)
    for it in range(iteration, total):
        metrics = iterate(it)                 # sets self.iteration = it + 1
        watch(metrics)                        # warnings, plan monitor
        out of budget? -> this is the last iteration
        last, or every eval_interval if evaluation_wanted(metrics): evaluate; stop_reason
        log (step: logged_step())
        stopping, last or every checkpoint_interval: save
        stopping: say why, leave

``self.iteration`` counts the iterations done (a GRPO step of the reasoning workload is one):
what the learner holds, what a checkpoint is numbered by and what a resumed run starts from.
A first Ctrl-C saves the last completed iteration and ends the run with one line saying how to
resume (``RunSession.stopped``); an error ends it with one line naming the worker and the cause
(``RunSession.failed``, the traceback in the run's ``train.log``). An error that leaves the
learner alive and idle (another worker died or stalled during collection, weight sync or
evaluation) first saves the last completed iteration too, within a bound
(:meth:`RunLoop.save_on_failure`), so a failure loses no more than Ctrl-C would.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Optional, Sequence

from m2flow.pipelines.errors import failure_cause
from m2flow.pipelines.futures import Stopped
from m2flow.runs import checkpoint
from m2flow.runs.logger import LogField, RunLogger
from m2flow.runs.session import RunSession

FAILURE_SAVE_MIN_S = 20.0
"""The least time a save after a failure gets (``RunLoop.save_on_failure``); more when this
run's own saves took longer (``FAILURE_SAVE_FACTOR`` times the longest)."""
FAILURE_SAVE_FACTOR = 3.0


class RunLoop:
    """Base of a runner: :meth:`train` runs the loop; subclasses fill in the hooks below.

    A subclass sets ``cfg`` (with ``runner.eval_interval``, ``runner.checkpoint_interval`` and
    ``resume``), ``session`` and ``iteration`` before :meth:`train`.
    """

    unit = "iterations"
    """What an iteration is called in the end line (reasoning: its GRPO "steps")."""
    checkpoint_prefix = "iter"
    """Checkpoint file names: ``<prefix>_<iteration>.pt``."""
    learner_group = "learner"
    """The worker group whose state a checkpoint holds (a failure it caused saves nothing)."""
    learner_idle_phases: Sequence[str] = ("collection", "generation", "weight sync", "evaluation")
    """Phases (``RunSession.phase``) past ``iterate``'s update: no learner update is in flight,
    and the learner holds exactly ``self.iteration``'s state (weight sync only reads it)."""
    _longest_save_s = 0.0
    log_fields: Sequence[LogField] = ()
    bar_fields: Sequence[LogField] = ()
    cfg: object
    session: RunSession
    iteration: int = 0

    # -- what a runner fills in --------------------------------------------------------------
    def total(self) -> int:
        """Iterations the run goes to (at most)."""
        raise NotImplementedError

    def iterate(self, it: int) -> dict:
        """Iteration ``it``; sets ``self.iteration = it + 1`` once the learner holds its
        update (a stop from there saves it); returns its metrics."""
        raise NotImplementedError

    def evaluate(self) -> dict:
        """An evaluation; its metrics (``eval/...``), merged into the iteration's."""
        raise NotImplementedError

    def logged_step(self) -> int:
        """The x of the iteration's log line and scalars (env steps, samples)."""
        raise NotImplementedError

    def checkpoint_state(self) -> dict:
        """What a checkpoint holds besides the run's own fields (the learner's state)."""
        raise NotImplementedError

    def describe(self) -> str:
        """The run's first log line after ``run dir X; ``."""
        return ""

    def before_loop(self, logger: RunLogger) -> dict:
        """Work before the first iteration (reasoning: its warm start and first evaluation);
        returns metrics the summary keeps."""
        return {}

    def watch(self, metrics: dict, logger: RunLogger) -> None:
        """After each iteration: warnings and monitors (may add metrics)."""

    def over_budget(self, loop_seconds: float) -> Optional[str]:
        """Why the run stops now for its time budget (this iteration is then the last:
        evaluated and saved), or None: ``runner.max_minutes`` of loop time."""
        minutes = self.cfg.runner.max_minutes
        if minutes is not None and loop_seconds > 60 * minutes:
            return f"runner.max_minutes={minutes} reached"
        return None

    def stop_reason(self, metrics: dict) -> Optional[str]:
        """After an evaluation: why the run stops here (a success target reached), or None."""
        return None

    def evaluation_wanted(self, metrics: dict) -> bool:
        """Before a scheduled evaluation (not the last one): whether it runs, from the
        iteration's metrics (the embodied runner's ``runner.eval_gate``)."""
        return True

    def memory_hint(self) -> str:
        """The fields that size the run's memory, for the line of a run killed for memory."""
        return ""

    def drain(self) -> None:
        """Finishes work started ahead (learner overlap) before an evaluation, a save or the end."""

    def abandon(self) -> None:
        """Forgets work started ahead when the run ends by Ctrl-C or an error (its workers end
        with the session)."""

    def summary(self) -> dict:
        """The workload's own entries of the summary ``train`` returns."""
        return {}

    # -- the loop ----------------------------------------------------------------------------
    def due(self, interval: int) -> bool:
        """True after the last iteration, and every ``interval`` iterations (0: never else)."""
        return self.iteration == self.total() or (interval > 0 and self.iteration % interval == 0)

    def save(self, metrics: Optional[dict] = None) -> Path:
        """A checkpoint of the iterations done, named by ``checkpoint_prefix``."""
        t0 = time.monotonic()
        path = self.session.save(self.iteration, self.checkpoint_state(), metrics,
                                 prefix=self.checkpoint_prefix)
        self._longest_save_s = max(self._longest_save_s, time.monotonic() - t0)
        return path

    def save_on_failure(self, exc: BaseException, start: int) -> None:
        """After the error ``exc`` ended the loop: saves the last completed iteration, as a
        first Ctrl-C does, when it has no checkpoint yet, the run got past ``start``, the
        error struck in one of ``learner_idle_phases`` (not mid-update: the learner's state
        would be half of the next iteration), the error is not the learner's own (its death,
        stall or exception) and not a checkpoint write that failed (a full disk).

        The save (the learner's state fetched, then written by ``checkpoint.save``:
        atomically, never half a file) runs in a thread the driver waits on for
        ``FAILURE_SAVE_MIN_S``, or ``FAILURE_SAVE_FACTOR`` times this run's longest save if
        longer: a learner that answers nothing (stalled too, or blocked behind a weight sync
        to a dead peer) or a disk that hangs leaves the last checkpoint on disk the one to
        resume from, as before. A save given up before it writes writes nothing later (a
        write under way when given up is atomic: its file appears whole, or not at all). A
        second Ctrl-C meanwhile gives it up too. The session's ``last_checkpoint`` names the
        newer checkpoint once it is written."""
        if (self.iteration <= start or self.session.saved_iteration == self.iteration
                or self.session.phase not in self.learner_idle_phases
                or isinstance(exc, checkpoint.CheckpointWriteError)
                or f"worker {self.learner_group}[" in failure_cause(exc)):
            return
        given_up = threading.Event()

        def save() -> None:
            try:
                state = self.checkpoint_state()
                if not given_up.is_set():
                    t0 = time.monotonic()
                    self.session.save(self.iteration, state, prefix=self.checkpoint_prefix)
                    self._longest_save_s = max(self._longest_save_s, time.monotonic() - t0)
            except BaseException:  # the learner (or the disk) failed too: the last one stays
                pass

        thread = threading.Thread(target=save, name="m2flow-save-on-failure", daemon=True)
        thread.start()
        try:
            thread.join(max(FAILURE_SAVE_MIN_S, FAILURE_SAVE_FACTOR * self._longest_save_s))
        except KeyboardInterrupt:  # a second Ctrl-C: the last checkpoint stays
            pass
        given_up.set()

    def train(self) -> dict:
        """Iterates to ``total()``, or until a stop reason or the budget; returns a summary:
        the last evaluation's metrics, ``iterations``, ``wall_s`` (the whole call), ``loop_s``
        (the iterations and their evaluations), ``eval_s``, ``checkpoint`` (``last.pt``) and
        the workload's own (``summary``)."""
        cfg, r = self.cfg, self.cfg.runner
        logger = self.session.open_run(self.total(), self.iteration, self.log_fields,
                                       self.bar_fields)
        self.run_dir = self.session.run_dir
        logger.info(f"run dir {self.run_dir}; {self.describe()}")
        start_wall, start = time.perf_counter(), self.iteration
        loop_start, result, eval_s = start_wall, {}, 0.0
        try:
            result.update(self.before_loop(logger))
            loop_start = time.perf_counter()
            for it in range(self.iteration, self.total()):
                metrics = self.iterate(it)
                self.watch(metrics, logger)
                reason = self.over_budget(time.perf_counter() - loop_start)
                last = self.iteration == self.total() or reason is not None
                if last or (self.due(r.eval_interval) and self.evaluation_wanted(metrics)):
                    t0 = time.perf_counter()
                    self.session.phase = "evaluation"
                    metrics.update(self.evaluate())
                    metrics["time/eval"] = time.perf_counter() - t0
                    eval_s += metrics["time/eval"]
                    result.update(metrics)
                    reason = reason or self.stop_reason(metrics)
                logger.log(it, self.logged_step(), metrics)
                if reason is not None or last or self.due(r.checkpoint_interval):
                    self.session.phase = "checkpointing"
                    self.save(metrics)
                if reason is not None:
                    logger.info(f"{reason}: stopping")
                    break
        except (Stopped, KeyboardInterrupt) as e:  # Ctrl-C (see runs.control.RunControl)
            self.abandon()
            raise self.session.stopped(e, self.iteration, start=start, save=self.save,
                                       unit=self.unit, resumed_from=cfg.resume) from None
        except Exception as e:  # a worker died or raised, a channel stopped: one line
            self.abandon()
            self.save_on_failure(e, start)
            raise self.session.failed(e, self.iteration, hint=self.memory_hint(),
                                      unit=self.unit, resumed_from=cfg.resume) from e
        finally:
            try:
                self.drain()
            finally:
                logger.close()
        return {**result, "iterations": self.iteration,
                "wall_s": time.perf_counter() - start_wall,
                "loop_s": time.perf_counter() - loop_start, "eval_s": eval_s,
                "checkpoint": str(self.run_dir / "checkpoints" / "last.pt"), **self.summary()}
