"""Cost models fitted to a profile: seconds against size and cores, memory against size.

Time of one call of a phase at size x (envs, batch rows, samples) on c cores is a line for
each core count the profile measured (one core, all cores), fitted by non-negative least
squares:

    seconds(x, c_i) = a_i + b_i u,    u = x                 (torch threads)
                                      u = x / min(c_i, x)   (one process per item, cap='size')

For a phase that runs one process per item (a simulator per env), u is the rounds of
per-item work its cores get through (x envs on c cores: x/c of them each, at least one);
any c uses the line of the nearest measured count with its own u. For threads, between two
measured core counts Amdahl's law ``t = S + P / c`` holds, linear in 1/c, so the two lines are
interpolated in 1/c (outside the measured counts the nearest one holds). A phase whose time
grows with cores (threads fighting over busy cores) keeps that: nothing forces more cores to
be faster.

The CPU work of a call, what it takes from cores it shares with others, is its time on one
core: ``work(x) = seconds(x, 1)``. A GPU phase is one line and its work is on the GPU.

Memory of a component holding x: ``mb(x) = m0 + m1 x`` (MB), fitted the same way.

>>> from m2flow.pipelines.planner.profiles import Profile, Node
>>> p = Profile("embodied", Node(cores=4))
>>> for n in (2, 4, 8):
...     for c in (1, 4):  # 1 ms fixed, 10 ms of simulation per env spread over the cores
...         p.add_time("env", "step", size=n, cores=c, seconds=0.001 + 0.010 * n / min(c, n))
>>> m = fit(p, caps={"env": "size"})
>>> round(m.seconds("env", "step", 8, cores=2), 4), round(m.work("env", "step", 16), 4)
(0.041, 0.161)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence, Union

import numpy as np

from m2flow.pipelines.planner.profiles import Memory, Profile, Timing

Cap = Union[str, float, None]
"""How many cores a phase can use: 'size' (one process per item), a number, or None (any)."""


class ModelError(ValueError):
    """A cost model that cannot be fitted or was not measured; the message says which."""


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    from scipy.optimize import nnls

    return nnls(a, b)[0]


def _rounds(x: float, c: float, cap: Cap) -> float:
    """The regressor of a line: x, or x / min(c, x) for one process per item."""
    return x / _cores(c, x, cap) if cap == "size" else x


def _cores(c: float, x: float, cap: Cap) -> float:
    limit = x if cap == "size" else (math.inf if cap is None else float(cap))
    return max(1.0, min(float(c), max(1.0, limit)))


@dataclass(frozen=True)
class TimeModel:
    """One line ``a + b x`` per measured core count; see the module docstring."""

    lines: tuple[tuple[float, float, float], ...]
    """(cores, a, b) per measured (effective) core count, fewest cores first."""
    cap: Cap = None
    device: str = "cpu"
    fit_error: float = 0.0
    """Largest relative error of the fit on the timings it was fitted to."""

    def seconds(self, x: float, cores: float = 1) -> float:
        if self.device != "cpu" or len(self.lines) == 1 and self.cap != "size":
            _, a, b = self.lines[0]
            return a + b * x
        if self.cap == "size":  # the nearest measured count's line, at this count's rounds
            k, a, b = min(self.lines, key=lambda line: (abs(math.log(line[0] / cores)), -line[0]))
            return a + b * _rounds(x, cores, self.cap)
        at = [(k, a + b * x) for k, a, b in self.lines]
        c = max(1.0, float(cores))
        if c <= at[0][0]:
            return at[0][1]
        for (c0, t0), (c1, t1) in zip(at, at[1:]):
            if c <= c1:  # Amdahl: linear in 1/c between the two measured counts
                return t0 + (t1 - t0) * (1 / c - 1 / c0) / (1 / c1 - 1 / c0)
        return at[-1][1]

    def work(self, x: float) -> float:
        """CPU-seconds of one call (GPU phases: GPU-seconds): its time on one core."""
        return self.seconds(x, 1)

    def describe(self, unit: str = "item") -> str:
        parts = [f"{1e3 * a:.2f} ms + {1e3 * b:.3f} ms/{unit}"
                 + (f" on {k:g} cores" if self.device == "cpu" else f" on {self.device}")
                 for k, a, b in self.lines]
        return "; ".join(parts) + f" (fit within {100 * self.fit_error:.0f}%)"


def fit_time(timings: Sequence[Timing], cap: Cap = None) -> TimeModel:
    """A :class:`TimeModel` from timings of one phase on one device.

    >>> ts = [Timing("learner", "learn", x, c, 0.01 + 1e-4 * x / c) for x in (100, 400)
    ...       for c in (1, 4)]
    >>> m = fit_time(ts)
    >>> round(m.seconds(800, 4), 4), round(m.seconds(800, 2), 4), m.fit_error < 1e-6
    (0.03, 0.05, True)
    """
    if not timings:
        raise ModelError("no timings to fit")
    device = timings[0].device
    groups: dict[float, list[Timing]] = {}
    for t in timings:
        groups.setdefault(1.0 if device != "cpu" else float(max(1, t.cores)), []).append(t)
    lines = []
    for k in sorted(groups):
        x = np.array([_rounds(t.size, k, cap) for t in groups[k]], dtype=float)
        y = np.array([t.seconds for t in groups[k]], dtype=float)
        if len(set(x.tolist())) < 2:
            lines.append((k, float(np.median(y)), 0.0))
        else:
            a, b = _nnls(np.stack([np.ones_like(x), x], 1), y)
            lines.append((k, float(a), float(b)))
    model = TimeModel(tuple(lines), cap, device)
    err = max(abs(model.seconds(t.size, t.cores) - t.seconds) / max(t.seconds, 1e-9)
              for t in timings)
    return TimeModel(model.lines, cap, device, float(err))


@dataclass(frozen=True)
class MemoryModel:
    """mb(x) = m0 + m1 x."""

    m0: float
    m1: float = 0.0
    device: str = "cpu"

    def mb(self, x: float) -> float:
        return self.m0 + self.m1 * x


def fit_memory(samples: Sequence[Memory]) -> MemoryModel:
    """A :class:`MemoryModel` from memory samples of one component on one device.

    >>> round(fit_memory([Memory("env", 2, 300), Memory("env", 8, 780)]).mb(16), 1)
    1420.0
    """
    if not samples:
        raise ModelError("no memory samples to fit")
    x = np.array([s.size for s in samples], dtype=float)
    y = np.array([s.mb for s in samples], dtype=float)
    if len(set(x.tolist())) < 2:
        return MemoryModel(float(y.mean()), 0.0, samples[0].device)
    m0, m1 = _nnls(np.stack([np.ones_like(x), x], 1), y)
    return MemoryModel(float(m0), float(m1), samples[0].device)


@dataclass
class CostModels:
    """Every phase's time model and every component's memory model of one profile."""

    times: dict[tuple[str, str, str], TimeModel] = field(default_factory=dict)
    """(component, phase, device) -> model."""
    memory: dict[tuple[str, str], MemoryModel] = field(default_factory=dict)
    """(component, device) -> model."""
    overhead_s: float = 0.0
    """Seconds per iteration the components alone do not account for (the framework's
    calls, transfers and bookkeeping), from a calibration run: added to every plan."""
    overhead_overlap_s: Optional[float] = None
    """The same for plans with learner overlap, where part of it hides behind the update
    (from a calibration run with overlap; None: ``overhead_s``)."""
    scale: dict[str, float] = field(default_factory=dict)
    """Per component, a factor on its fitted times (a run's measured component times
    against the predicted ones: see ``monitor``); 1 where absent."""
    in_situ: dict[tuple[str, str, float], float] = field(default_factory=dict)
    """(component, phase, cores) -> a factor on that phase's fitted time on that many cores:
    what a calibration run measured it at inside a real iteration against the profile's
    time alone (a multi-threaded learner on cores it shares with simulators and Ray runs
    slower than alone); 1 where absent."""

    def scaled(self, factors: Mapping[str, float], overhead_s: float) -> "CostModels":
        """These models with ``factors`` on top of the present scale and ``overhead_s`` for
        every plan, overlapped or not."""
        scale = dict(self.scale)
        for name, f in factors.items():
            scale[name] = scale.get(name, 1.0) * f
        return CostModels(self.times, self.memory, overhead_s, None, scale, dict(self.in_situ))

    def overhead(self, overlap: bool) -> float:
        if overlap and self.overhead_overlap_s is not None:
            return self.overhead_overlap_s
        return self.overhead_s

    def has(self, component: str, phase: str, device: str = "cpu") -> bool:
        return (component, phase, device) in self.times

    def time_model(self, component: str, phase: str, device: str = "cpu") -> TimeModel:
        try:
            return self.times[(component, phase, device)]
        except KeyError:
            known = ", ".join(f"{c}.{p} ({d})" for c, p, d in sorted(self.times)) or "none"
            raise ModelError(f"the profile has no timings of {component}.{phase} on {device}; "
                             f"it has {known}. Profile on a machine with that device, or "
                             "leave plans that need it out.") from None

    def seconds(self, component: str, phase: str, size: float, cores: float = 1,
                device: str = "cpu") -> float:
        f = self.scale.get(component, 1.0) * self._in_situ(component, phase, cores, device)
        return f * self.time_model(component, phase, device).seconds(size, cores)

    def work(self, component: str, phase: str, size: float, device: str = "cpu") -> float:
        f = self.scale.get(component, 1.0) * self._in_situ(component, phase, 1, device)
        return f * self.time_model(component, phase, device).work(size)

    def _in_situ(self, component: str, phase: str, cores: float, device: str) -> float:
        return 1.0 if device != "cpu" else self.in_situ.get((component, phase, float(cores)), 1.0)

    def mb(self, component: str, size: float, device: str = "cpu") -> float:
        model = self.memory.get((component, device))
        return 0.0 if model is None else model.mb(size)


def fit(profile: Profile, caps: Optional[Mapping[str, Cap]] = None) -> CostModels:
    """Fits every (component, phase, device) of ``profile``; ``caps``: per component, the
    cores one call can use (``'size'``: one process per item; default unbounded)."""
    caps = dict(caps or {})
    out = CostModels()
    for key in sorted({(t.component, t.phase, t.device) for t in profile.timings}):
        ts = [t for t in profile.timings if (t.component, t.phase, t.device) == key]
        out.times[key] = fit_time(ts, caps.get(key[0]) if key[2] == "cpu" else None)
    for key in sorted({(m.component, m.device) for m in profile.memory}):
        out.memory[key] = fit_memory([m for m in profile.memory
                                      if (m.component, m.device) == key])
    return out
