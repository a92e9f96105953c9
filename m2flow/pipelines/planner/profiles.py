"""Profiles: what each component cost when it ran alone, as plain numbers a planner fits.

A profiler (``m2flow.embodied.profile``, ``m2flow.reasoning.profile``) runs each component
alone for a few warm calls at two or three sizes and on one core and on all of them, and
records one :class:`Timing` per (component, phase, size, cores) and one :class:`Memory` per
(component, size). A :class:`Profile` holds them with the node they were taken on and the
workload's constants (``facts``: envs, steps per iteration, ...), and is saved as JSON so a
plan can be searched again without measuring again (``m2flow-plan --profile FILE``).

>>> p = Profile("embodied", Node(cores=2), facts={"rollout_steps": 50})
>>> p.add_time("env", "step", size=8, cores=1, seconds=0.2)
>>> Profile.from_json(p.to_json()).timings[0]
Timing(component='env', phase='step', size=8.0, cores=1, seconds=0.2, device='cpu')
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional


@dataclass(frozen=True)
class Node:
    """The machine a plan is for: its cores, GPUs and memory."""

    cores: int
    """CPU cores the run may use."""
    gpus: int = 0
    """GPUs (ids 0..gpus-1)."""
    memory_mb: float = float("inf")
    """Host memory a run may fill (MB); inf: not checked."""
    gpu_memory_mb: float = float("inf")
    """Memory of each GPU (MB)."""


@dataclass(frozen=True)
class Timing:
    """Median wall seconds of one call of ``component``'s ``phase`` alone."""

    component: str
    phase: str
    """What was timed: 'step' (one env step of every env), 'reset', 'infer' (one batch),
    'learn' (one update), 'sync' (weights learner -> rollout), 'offload', 'onload', ..."""
    size: float
    """The call's size: envs, batch rows, samples, bytes (the phase says which)."""
    cores: int
    """Cores it ran on (processes pinned there, torch threads = cores); GPU phases: 0."""
    seconds: float
    device: str = "cpu"
    """'cpu' or 'cuda'."""


@dataclass(frozen=True)
class Memory:
    """Resident memory of ``component`` holding ``size`` (envs, batch rows, samples)."""

    component: str
    size: float
    mb: float
    device: str = "cpu"
    """'cpu': host RAM (PSS of its processes); 'cuda': GPU memory."""


@dataclass
class Profile:
    """Measured timings and memory of one workload's components on one node."""

    workload: str
    """'embodied' or 'reasoning': which component graph the planner searches."""
    node: Node
    facts: dict[str, Any] = field(default_factory=dict)
    """The workload's constants the graph needs (e.g. ``total_envs``, ``rollout_steps``)."""
    timings: list[Timing] = field(default_factory=list)
    memory: list[Memory] = field(default_factory=list)
    source: dict[str, Any] = field(default_factory=dict)
    """Where it comes from: config name, overrides, date, commit (free-form, for people)."""

    def add_time(self, component: str, phase: str, *, size: float, cores: int,
                 seconds: float, device: str = "cpu") -> None:
        self.timings.append(Timing(component, phase, float(size), int(cores), float(seconds),
                                   device))

    def add_memory(self, component: str, *, size: float, mb: float, device: str = "cpu") -> None:
        self.memory.append(Memory(component, float(size), float(mb), device))

    def times(self, component: str, phase: str, device: Optional[str] = None) -> list[Timing]:
        return [t for t in self.timings if t.component == component and t.phase == phase
                and (device is None or t.device == device)]

    def to_json(self) -> str:
        node = {k: (None if v == float("inf") else v) for k, v in asdict(self.node).items()}
        return json.dumps({"workload": self.workload, "node": node, "facts": self.facts,
                           "timings": [asdict(t) for t in self.timings],
                           "memory": [asdict(m) for m in self.memory],
                           "source": self.source}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> "Profile":
        d = json.loads(text)
        node = Node(**{k: (float("inf") if v is None else v) for k, v in d["node"].items()})
        return cls(d["workload"], node, d.get("facts", {}),
                   [Timing(**t) for t in d.get("timings", [])],
                   [Memory(**m) for m in d.get("memory", [])], d.get("source", {}))

    def save(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path) -> "Profile":
        return cls.from_json(Path(path).read_text())
