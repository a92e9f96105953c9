"""What a run writes: its directory (``<log_dir>/<run_name>/<timestamp>/`` with
``config.yaml``), its logger and the progress of a long phase, and its checkpoints: tagged with
their workload, written atomically, the newest ``runner.keep_checkpoints`` kept plus the best by
evaluation (``best.pt``), ``last.pt`` pointing at the newest, and ``load`` refusing another
workload's file.
"""

from __future__ import annotations

import math
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence

from omegaconf import OmegaConf

from m2flow.runs import checkpoint
from m2flow.runs.logger import LogField, Progress, RunLogger, announce, log, terminal


class RunFiles:
    """The run directory, the logger and the checkpoints of one run.

    Args:
        cfg: the workload's root config; it has ``runner`` (``log_dir``, ``keep_checkpoints``,
            ``progress_bar``, ``progress_interval_s``) and ``run_name``.
        workload: the workload's name, written into every checkpoint (``"embodied"``).
        best_metric: the metric that ranks checkpoints (``"eval/success_once"``, higher is
            better): the checkpoint with its highest value is kept as ``best.pt``.
        launch: the command the run was started with (``runs.control.launch``), kept in every
            checkpoint; None: none is kept.
    """

    def __init__(self, cfg: Any, *, workload: str, best_metric: Optional[str] = None,
                 launch: Optional[dict] = None):
        self.cfg, self.workload, self.best_metric, self.launch = cfg, workload, best_metric, launch
        self.best_score: Optional[float] = None  # best_metric of best.pt
        self.logger: Optional[RunLogger] = None
        self.run_dir: Optional[Path] = None
        self.last_checkpoint: Optional[Path] = None
        self.saved_iteration: Optional[int] = None  # the iteration of last_checkpoint

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
            **({"launch": dict(self.launch)} if self.launch is not None else {}),
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

    def resume_point(self, resumed_from: Optional[str] = None) -> Optional[Path]:
        """The checkpoint a run ending now resumes from: its newest, else the one it resumed
        from (``cfg.resume``); None: there is none."""
        return self.last_checkpoint or (Path(resumed_from) if resumed_from else None)


def config_yaml(cfg: Any) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def new_run_dir(cfg: Any) -> Path:
    """``<runner.log_dir>/<run_name>/<time>/`` with the run's ``config.yaml``, made now."""
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    run_dir = Path(cfg.runner.log_dir) / cfg.run_name / stamp
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(config_yaml(cfg))
    return run_dir
