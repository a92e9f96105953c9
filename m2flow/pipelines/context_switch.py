"""Context switching: a component moves its tensors off its device so another can use it.

A worker registers what it owns (modules, optimisers, caches) in a :class:`DeviceContext`;
``offload()`` copies every tensor of them (parameters, gradients, buffers, optimiser state)
into host memory (pinned when the device is CUDA) and frees the device copies; ``onload()``
copies them back. ``torch.nn.Parameter`` objects keep their identity (only ``.data`` moves), so
an optimiser's references stay valid and its next step continues exactly. Caches (a generation
KV cache, say) are dropped on offload: they are rebuilt on the next use.

Who switches is decided from the placement, not by the components: :func:`switch_plan` lists,
for components that share a device, which ones must step aside while another runs. On a CPU
the device *is* host memory, so a context offloads nothing (no-op mode) unless
``cluster.context_switch=always`` asks it to copy anyway (tests, CPU dry runs).

>>> import torch
>>> net = torch.nn.Linear(3, 2)
>>> ctx = DeviceContext("cpu", modules={"net": net}, force=True)
>>> w = net.weight.detach().clone()
>>> ctx.offload().bytes == 4 * (3 * 2 + 2)
True
>>> _ = ctx.onload(); torch.equal(net.weight, w)
True
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Optional

import torch

SWITCH_MODES = ("auto", "always", "never")


@dataclass
class SwitchStats:
    """What one offload or onload moved and how long it took."""

    bytes: int = 0
    seconds: float = 0.0
    tensors: int = 0

    @property
    def gb_per_s(self) -> float:
        return self.bytes / 1e9 / self.seconds if self.seconds > 0 else float("nan")


class DeviceContext:
    """The device-resident state of one component, moved as a whole.

    Args:
        device: where the component computes ('cpu', 'cuda:0', ...).
        modules: modules whose parameters, gradients and buffers move.
        optimizers: optimisers whose state tensors move.
        caches: name -> function that drops a cache (called on offload).
        force: copy even when the device is the CPU (no-op otherwise there).
    """

    def __init__(
        self,
        device: str | torch.device,
        modules: Optional[Mapping[str, torch.nn.Module]] = None,
        optimizers: Optional[Mapping[str, torch.optim.Optimizer]] = None,
        caches: Optional[Mapping[str, Callable[[], None]]] = None,
        force: bool = False,
    ):
        self.device = torch.device(device)
        self.modules = dict(modules or {})
        self.optimizers = dict(optimizers or {})
        self.caches = dict(caches or {})
        self.force = force
        self.on_device = True

    @property
    def active(self) -> bool:
        """False in no-op mode: the device is host memory and no copy was asked for."""
        return self.device.type != "cpu" or self.force

    def register(self, *, modules=None, optimizers=None, caches=None) -> None:
        """Adds more state (a worker builds its optimiser after its model, say)."""
        if not self.on_device:
            raise RuntimeError("register() while offloaded: onload() first.")
        self.modules.update(modules or {})
        self.optimizers.update(optimizers or {})
        self.caches.update(caches or {})

    def offload(self) -> SwitchStats:
        """Device -> host. Idempotent: offloading an offloaded context moves nothing."""
        if not self.on_device or not self.active:
            self.on_device = False
            return SwitchStats()
        for drop in self.caches.values():
            drop()
        pin = self.device.type == "cuda"
        stats = self._move(lambda t: _copy(t, torch.device("cpu"), pin))
        self.on_device = False
        return stats

    def onload(self) -> SwitchStats:
        """Host -> device. Idempotent like ``offload``."""
        if self.on_device or not self.active:
            self.on_device = True
            return SwitchStats()
        stats = self._move(lambda t: _copy(t, self.device, False))
        self.on_device = True
        return stats

    def nbytes(self) -> int:
        """Bytes of state this context moves (parameters, gradients, buffers, optimiser)."""
        return sum(t.numel() * t.element_size() for t in self._tensors())

    # -- internals ---------------------------------------------------------------------------
    def _move(self, copy: Callable[[torch.Tensor], torch.Tensor]) -> SwitchStats:
        t0 = time.perf_counter()
        stats = SwitchStats()
        seen: dict[int, torch.Tensor] = {}  # shared tensors (tied weights) move once

        def moved(t: torch.Tensor) -> torch.Tensor:
            key = id(t)
            if key not in seen:
                seen[key] = copy(t)
                stats.bytes += t.numel() * t.element_size()
                stats.tensors += 1
            return seen[key]

        with torch.no_grad():
            for module in self.modules.values():
                for p in _unique_params(module):
                    p.data = moved(p.data)
                    if p.grad is not None:
                        p.grad = moved(p.grad)
                for sub in module.modules():
                    for name, buf in sub._buffers.items():
                        if buf is not None:
                            sub._buffers[name] = moved(buf)
            for opt in self.optimizers.values():
                for state in opt.state.values():
                    for k, v in state.items():
                        if _movable(v, self.device):
                            state[k] = moved(v)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _tensors(self) -> Iterator[torch.Tensor]:
        seen = set()
        for module in self.modules.values():
            for p in _unique_params(module):
                for t in (p.data, p.grad):
                    if t is not None and id(t) not in seen:
                        seen.add(id(t))
                        yield t
            for buf in module.buffers():
                if id(buf) not in seen:
                    seen.add(id(buf))
                    yield buf
        for opt in self.optimizers.values():
            for state in opt.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor) and v.dim() > 0 and id(v) not in seen:
                        seen.add(id(v))
                        yield v


def _unique_params(module: torch.nn.Module) -> Iterator[torch.nn.Parameter]:
    return module.parameters()  # parameters() already skips tied duplicates


def _movable(v, device: torch.device) -> bool:
    """Optimiser state tensors that live with the parameters (Adam's moments); a scalar
    ``step`` kept on the CPU by the optimiser stays there."""
    return isinstance(v, torch.Tensor) and (v.dim() > 0 or v.device.type == device.type != "cpu")


def _copy(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """A copy of ``t`` in fresh storage on ``device`` (the source is then free to go)."""
    out = torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin)
    out.copy_(t, non_blocking=pin or device.type == "cuda")
    return out


def switch_plan(shares_device: Callable[[str, str], bool], components: list[str],
                mode: str = "auto") -> dict[str, list[str]]:
    """For each component, the components that must offload while it runs.

    ``auto``: those placed on a common GPU (collocated); disaggregated components never
    switch. ``always``: every pair (CPU dry runs and tests). ``never``: none.

    >>> switch_plan(lambda a, b: True, ["rollout", "learner"])
    {'rollout': ['learner'], 'learner': ['rollout']}
    >>> switch_plan(lambda a, b: False, ["rollout", "learner"])
    {'rollout': [], 'learner': []}
    """
    if mode not in SWITCH_MODES:
        raise ValueError(
            f"cluster.context_switch={mode!r} is not a mode; use one of {list(SWITCH_MODES)}."
        )
    plan: dict[str, list[str]] = {c: [] for c in components}
    if mode == "never":
        return plan
    for a in components:
        for b in components:
            if a != b and (mode == "always" or shares_device(a, b)):
                plan[a].append(b)
    return plan


class ContextSwitcher:
    """Runs a :func:`switch_plan` over worker groups: ``activate(name)`` offloads the groups
    that must step aside for ``name`` and onloads ``name``; it returns what moved.

    Both runners (embodied and reasoning) drive their turns through this one class.
    """

    def __init__(self, groups: Mapping[str, object], plan: Mapping[str, list[str]],
                 force: bool = False):
        self.groups = dict(groups)
        self.plan = {k: list(v) for k, v in plan.items() if k in self.groups}
        self.enabled = any(self.plan.values())
        self._on = set(self.groups)  # every component starts with its state on its device
        if self.enabled and force:
            for g in self.groups.values():
                g.call("set_context_force", True).wait()

    def activate(self, name: str) -> dict[str, float]:
        """Gives the device to ``name``; seconds and bytes moved, for the run's metrics."""
        out = {"time/offload": 0.0, "time/onload": 0.0, "switch/bytes": 0.0}
        if not self.enabled:
            return out
        for other in self.plan.get(name, []):
            if other in self._on:
                t0 = time.perf_counter()
                stats = self.groups[other].call("offload").wait()
                out["time/offload"] += time.perf_counter() - t0
                out["switch/bytes"] += sum(s["bytes"] for s in stats)
                self._on.discard(other)
        if name not in self._on:
            t0 = time.perf_counter()
            stats = self.groups[name].call("onload").wait()
            out["time/onload"] += time.perf_counter() - t0
            out["switch/bytes"] += sum(s["bytes"] for s in stats)
            self._on.add(name)
        return out
