"""A workload as the planner sees it: components, the phases an item goes through, the update.

Two shapes cover both workloads:

- a **cycle** (embodied): each item (a stage of envs) goes round ``loop`` -- simulate, infer --
  ``rounds`` times per iteration (T steps); the first component's workers each hold
  ``stages`` pipeline stages and run them one at a time;
- a **chain** (reasoning): each item (a generate call's completions) goes once through
  ``loop`` -- generate, score -- and, when the placement lets rollout and learner run at once,
  on into the update (``stream_train``).

Then the update (``train``) on the iteration's batch, the weight sync, and the context
switch when rollout and learner share a GPU. What a plan turns into as config overrides of the
workload's own keys (``knob_overrides``) is the workload's; placement overrides are generic.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional


@dataclass(frozen=True)
class ComponentSpec:
    """One component of the graph, with what the search may change about it."""

    name: str
    processes_per_item: bool = False
    """One process per item (a simulator per env): a call can use at most ``size`` cores."""
    gpu: bool = False
    """May run on a GPU."""
    threads: bool = True
    """Its speed depends on its torch threads (the search tries 1 and all cores)."""


@dataclass(frozen=True)
class Phase:
    """``component``'s ``phase`` (a name in the profile's timings)."""

    component: str
    phase: str


@dataclass(frozen=True)
class Graph:
    """A workload's component graph and its per-iteration sizes."""

    workload: str
    components: tuple[ComponentSpec, ...]
    loop: tuple[Phase, ...]
    """Phases each item goes through, in order; ``loop[0].component`` holds the items."""
    cycle: bool
    """True: items go round the loop ``rounds`` times (env <-> rollout); False: once (chain)."""
    rounds: int
    """Rounds of the loop per iteration (embodied: policy calls per env, T)."""
    items: int
    """Size of one round over all workers (envs; completions)."""
    train: Phase
    """The update on the iteration's batch."""
    samples: float
    """Size of the update (batch rows)."""
    steps_per_iteration: float
    """What the throughput column counts per iteration (env steps; completions)."""
    before: tuple[Phase, ...] = ()
    """Phases of the first loop component before each iteration's loop (resets), on each
    worker's stages one at a time."""
    sync: Optional[Phase] = None
    """Weights from the learner to the rollout (size: the profile's ``sync`` size)."""
    sync_size: float = 0.0
    switch: tuple[Phase, ...] = ()
    """Offload/onload phases paid when rollout and learner share a GPU."""
    hop: Optional[Phase] = None
    """Framework cost per item hand-off (channels, bookkeeping), if the profile has it."""
    pinned: tuple[str, ...] = ()
    """Components the hybrid shape pins to disjoint cores (the ones that run at the same
    time); the others float over every core. Default: the loop's components."""
    stages: tuple[int, ...] = (1,)
    """Stages per worker of the first loop component to try (pipeline stages; generate calls)."""
    workers: tuple[int, ...] = (1,)
    """Worker counts of the first loop component to try (items split among them)."""
    group: int = 1
    """Each worker's items must be a multiple of this (GRPO reset groups)."""
    overlap: bool = False
    """Cycle graphs: the update may run during the next iteration's loop (learner overlap)."""
    stream_train: bool = False
    """Chain graphs: the update consumes items as they come when rollout and learner may run
    at once (placement not collocated), else it runs after the loop."""
    stages_label: str = "S"
    """How the table names the stage count (``S`` pipeline stages; ``calls`` per step)."""
    item_unit: str = "item"
    throughput_unit: str = "steps/s"
    knob_overrides: Callable[..., list[str]] = field(default=lambda plan, elastic=False: [],
                                                     compare=False)
    """The workload's config overrides for a plan's stages, workers and overlap."""

    def component(self, name: str) -> ComponentSpec:
        return next(c for c in self.components if c.name == name)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.name for c in self.components)
