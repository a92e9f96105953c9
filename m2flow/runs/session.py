"""The run session: what every workload's run is made of, in one place.

A runner (embodied, reasoning, or a new workload) opens a :class:`RunSession` and gets:

- the cluster and the validated placement of its components;
- worker groups (``session.group("rollout", RolloutWorker, ...)``), shut down in reverse order
  by ``close()``;
- the context switcher for the components that share a device (``take_turns``);
- per-component timings by one rule: ``time/<group>_<phase>``, the slowest rank's seconds;
- the run directory (``<log_dir>/<run_name>/<timestamp>/`` with ``config.yaml``), the logger;
- checkpoints tagged with their workload, written atomically, the newest ``keep_checkpoints``
  kept plus the best by evaluation (``best.pt``), ``last.pt`` pointing at the newest, and
  ``load`` refusing another workload's file;
- the progress of a long phase (``progress``: an evaluation's episodes), in the bar or as
  lines in the log.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import OmegaConf

from m2flow.pipelines import (
    Cluster,
    ContextSwitcher,
    Placement,
    WorkerGroup,
    switch_plan,
)
from m2flow.runs import checkpoint
from m2flow.runs.logger import LogField, Progress, RunLogger, announce, log, terminal


class RunSession:
    """Cluster, placement, worker groups, switcher, run directory and checkpoints of one run.

    Args:
        cfg: the workload's root config; it has ``cluster``, ``runner`` (``log_dir``,
            ``keep_checkpoints``, ``progress_bar``, ``progress_interval_s``), ``run_name``
            and ``seed``.
        workload: the workload's name, written into every checkpoint (``"embodied"``).
        best_metric: the metric that ranks checkpoints (``"eval/success"``, higher is
            better): the checkpoint with its highest value is kept as ``best.pt``.
    """

    def __init__(self, cfg: Any, *, workload: str, best_metric: Optional[str] = None):
        self.cfg = cfg
        self.workload = workload
        self.best_metric = best_metric
        self.best_score: Optional[float] = None  # best_metric of best.pt
        self.logger: Optional[RunLogger] = None
        self.cluster = Cluster(cfg.cluster)
        self.placement = Placement(cfg.cluster.placement, self.cluster.nodes)
        self.groups: list[WorkerGroup] = []
        self.switcher = ContextSwitcher({}, {})  # nobody takes turns until take_turns()
        self.run_dir: Optional[Path] = None
        self.last_checkpoint: Optional[Path] = None

    # -- workers -----------------------------------------------------------------------------
    def group(self, name: str, cls: type, *args: Any, **kwargs: Any) -> WorkerGroup:
        """Starts the ranks of component ``name`` (as placed) as workers of class ``cls``."""
        group = WorkerGroup(self.cluster, name, cls, self.placement.ranks(name), *args, **kwargs)
        self.groups.append(group)
        return group

    def switch_plan(self, components: Sequence[str]) -> dict[str, list[str]]:
        """Who steps aside for whom among ``components`` on a shared device."""
        return switch_plan(self.placement.shares_device, list(components),
                           self.cfg.cluster.context_switch)

    def take_turns(self, groups: dict[str, WorkerGroup], plan: dict[str, list[str]]) -> ContextSwitcher:
        """The switcher that hands the shared device to one component at a time."""
        self.switcher = ContextSwitcher(groups, plan,
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
        stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
        self.run_dir = Path(self.cfg.runner.log_dir) / self.cfg.run_name / stamp
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(config_yaml(self.cfg))
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
        its ``best_metric`` is at least that of every earlier one (ties: the newer); keeps the
        newest ``runner.keep_checkpoints`` (0: all) and the one ``best.pt`` points at."""
        full = {
            **state,
            "workload": self.workload,
            "iteration": iteration,
            "config": config_yaml(self.cfg),
            "metrics": {k: v for k, v in (metrics or {}).items() if isinstance(v, (int, float))},
        }
        folder = self.run_dir / "checkpoints"
        path = checkpoint.save(folder / f"{prefix}_{iteration:05d}.pt", full)
        checkpoint.link_latest(path)
        score = full["metrics"].get(self.best_metric) if self.best_metric else None
        if score is not None and math.isfinite(score) and (
                self.best_score is None or score >= self.best_score):
            checkpoint.link_latest(path, checkpoint.BEST)
            self.best_score = score
        checkpoint.prune(folder, keep=self.cfg.runner.keep_checkpoints, pattern=f"{prefix}_*.pt",
                         protect=(checkpoint.BEST,))
        self.last_checkpoint = path
        return path

    def load(self, path: str) -> dict:
        """A checkpoint's state; one written by another workload is an error."""
        state = checkpoint.load(path, workload=self.workload)
        log.info(f"resumed from {path} at iteration {state['iteration']}")
        return state

    @staticmethod
    def stop_requested() -> bool:
        """True once Ctrl-C asked the run to stop (see ``stop_on_ctrl_c``)."""
        return _STOP.is_set()

    def interrupted(self, iteration: int) -> "RunInterrupted":
        """The exception a runner raises on Ctrl-C: it names the last checkpoint."""
        return RunInterrupted(iteration, self.last_checkpoint)

    def close(self) -> None:
        for g in reversed(self.groups):
            g.shutdown()
        self.groups = []
        self.cluster.shutdown()


def config_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


class RunInterrupted(Exception):
    """Ctrl-C during a run: where it stopped and the checkpoint to resume from."""

    def __init__(self, iteration: int, checkpoint: Optional[Path]):
        super().__init__(iteration, checkpoint)
        self.iteration, self.checkpoint = iteration, checkpoint

    def describe(self) -> str:
        if self.checkpoint is None:
            return f" at iteration {self.iteration}; no checkpoint was written yet."
        return (f" at iteration {self.iteration}; last checkpoint {self.checkpoint} "
                f"(continue with resume={self.checkpoint}).")


_STOP = threading.Event()


def stop_on_ctrl_c() -> None:
    """Ctrl-C asks a run to stop: it finishes the iteration in flight, saves a checkpoint and
    ends with one line naming it (a blocking Ray call in the driver would not see a
    KeyboardInterrupt, and the iteration's work would be lost). A second Ctrl-C stops at once.
    Call from the main thread of a command-line program."""
    _STOP.clear()

    def handler(signum, frame):
        if _STOP.is_set():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        _STOP.set()
        print("\nCtrl-C: stopping after this iteration and saving a checkpoint; Ctrl-C again "
              "stops now.", file=sys.stderr, flush=True)

    signal.signal(signal.SIGINT, handler)
