"""Config pieces every workload's root config shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from m2flow.fields import above, at_least, check_bound, optional
from m2flow.pipelines import ClusterConfig, PlacementConfig


@dataclass
class ClusterGroupConfig(ClusterConfig):
    """The ``cluster`` group: how to reach the machines and where each component goes."""

    placement: PlacementConfig = field(default_factory=PlacementConfig)
    """Per-component resources; see m2flow.pipelines.placement."""
    plan: Optional[str] = None
    """A plan file written by ``m2flow-plan`` (its placement and knobs are applied before the
    command line's own overrides), or ``auto``: profile the components and plan at start-up,
    then log predicted against measured iteration time and re-plan the pipeline stages when
    they drift apart. None: the placement above as it is."""


@dataclass
class RunnerBaseConfig:
    """What every workload's ``runner`` group has: where the run goes, how often it saves."""

    checkpoint_interval: int = 10
    """Save a checkpoint every N iterations (and after the last); 0: only after the last."""
    max_minutes: Optional[float] = None
    """Stop once the loop (iterations and their evaluations) has run this many minutes; the
    iteration that passes it is the last, evaluated and saved. What comes before the first
    iteration (start-up, reasoning's warm start) is not counted. None: the iteration count
    (``num_iterations``, ``num_steps``) decides."""
    keep_checkpoints: int = 5
    """Keep the newest N checkpoints of a run, and the best by evaluation (``best.pt``
    points at it, ``last.pt`` at the newest); 0: keep all."""
    log_dir: str = "runs"
    """Runs are written under <log_dir>/<config name>/<timestamp>/."""
    channel_timeout_s: float = 600.0
    """A channel get/put waiting longer than this fails the run (a stuck or dead worker)."""
    stall_timeout_s: Optional[float] = None
    """Seconds a worker may make no progress in any phase (start-up, collection, learning,
    weight sync, evaluation, checkpointing) before the run ends with a line naming it: a
    worker that answers nothing (stopped, stuck in native code), or a call that does not
    return. Set, it is the limit of every phase, a first one (start-up, a first learning
    step that compiles) too: set it above the run's slowest step. None: each phase's limit
    comes from its own measured durations (a multiple of its longest so far, with a floor),
    so a long step is never cut, and a phase not completed before gets a generous allowance:
    m2flow.pipelines.watchdog.stall_limit."""
    progress_bar: bool = True
    """Show a tqdm bar when stdout and stderr are terminals (the per-iteration log line is
    written either way)."""
    progress_interval_s: float = 15.0
    """A long phase (an evaluation) writes a progress line (episodes done, success so far)
    at most every N seconds, as its rounds end, and one when it is done; 0: at every round.
    On a terminal these lines go to train.log only (the bar shows the same)."""

    def validate_base(self) -> None:
        """Raises FieldError naming the first of these fields out of range: the ones every
        workload's runner has, checked after the workload's own groups
        (``m2flow.runs.checks.check_runner_base``); a workload's runner config checks its own
        fields in its ``validate``."""
        check_bound(self, "runner.checkpoint_interval", at_least(0),
                    "save every N iterations, or 0 for only the last")
        check_bound(self, "runner.max_minutes", optional(above(0), "the iteration count decides"),
                    "give the loop's wall-time budget in minutes, or null")
        check_bound(self, "runner.keep_checkpoints", at_least(0),
                    "keep the newest N checkpoints (and the best), or 0 for all")
        check_bound(self, "runner.progress_interval_s", at_least(0),
                    "give the seconds between progress lines of a long phase (0: every round)")
        check_bound(self, "runner.channel_timeout_s", above(0),
                    "give the seconds a worker may be silent (default 600)")
        check_bound(self, "runner.stall_timeout_s",
                    optional(above(0), "limits from each phase's measured durations"),
                    "give the seconds a worker may make no progress, or null")
