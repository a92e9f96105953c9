"""Context switching: a component moves its tensors off its device so another can use it.

A worker registers what it owns (modules, optimisers, caches) in a :class:`DeviceContext`;
``offload()`` copies every tensor of them (parameters, gradients, buffers, optimiser state)
into host memory (pinned when the device is CUDA) and frees the device copies; ``onload()``
copies them back. ``torch.nn.Parameter`` objects keep their identity (only ``.data`` moves), so
an optimiser's references stay valid and its next step continues exactly. Caches (a generation
KV cache, say) are dropped on offload: they are rebuilt on the next use.

Who switches is decided from the placement, not by the components: :func:`offloads_for` lists,
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
from functools import partial
from typing import Callable, Iterator, Mapping, Optional

import torch

SWITCH_MODES = ("auto", "always", "never")


@dataclass
class SwitchStats:
    """What one offload or onload moved and how long it took."""

    bytes: int = 0
    seconds: float = 0.0
    tensors: int = 0


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
        if pin:
            # the component that takes the device next may live in another process (a Ray
            # actor): give the freed blocks back to the driver, not to this process's cache
            torch.cuda.empty_cache()
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
        return sum(t.numel() * t.element_size() for t, _ in self._slots())

    # -- internals ---------------------------------------------------------------------------
    def _move(self, copy: Callable[[torch.Tensor], torch.Tensor]) -> SwitchStats:
        t0 = time.perf_counter()
        stats = SwitchStats()
        with torch.no_grad():
            for t, put in self._slots():
                new = copy(t)
                put(new)
                stats.bytes += t.numel() * t.element_size()
                stats.tensors += 1
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats.seconds = time.perf_counter() - t0
        return stats

    def _slots(self) -> Iterator[tuple[torch.Tensor, Callable[[torch.Tensor], None]]]:
        """Each tensor to move, once, with a function that puts its copy in its place.

        Tensors are told apart by object, and every one seen is held until the walk ends: an
        ``id`` is unique only among live objects, and ``p.data`` is a new object at each access
        (keyed on ids of dropped tensors, one parameter would receive another's copy).
        Parameters are told apart by the ``Parameter`` itself, so a tied weight moves once.
        """
        held: dict[int, torch.Tensor] = {}

        def first(t: torch.Tensor) -> bool:
            if id(t) in held:
                return False
            held[id(t)] = t
            return True

        params: dict[int, torch.nn.Parameter] = {}
        for module in self.modules.values():
            for p in module.parameters():
                params.setdefault(id(p), p)
        for p in params.values():
            yield p.data, partial(_set_data, p)
            if p.grad is not None and first(p.grad):
                yield p.grad, partial(_set_grad, p)
        for module in self.modules.values():
            for sub in module.modules():
                for name, buf in sub._buffers.items():
                    if buf is not None and first(buf):
                        yield buf, partial(sub._buffers.__setitem__, name)
        for opt in self.optimizers.values():
            for state in opt.state.values():
                for k, v in state.items():
                    if _movable(v, self.device) and first(v):
                        yield v, partial(state.__setitem__, k)


def _set_data(p: torch.nn.Parameter, t: torch.Tensor) -> None:
    p.data = t


def _set_grad(p: torch.nn.Parameter, t: torch.Tensor) -> None:
    p.grad = t


def _movable(v, device: torch.device) -> bool:
    """Optimiser state tensors that live with the parameters (Adam's moments); a scalar
    ``step`` kept on the CPU by the optimiser stays there."""
    return isinstance(v, torch.Tensor) and (v.dim() > 0 or v.device.type == device.type != "cpu")


def _copy(t: torch.Tensor, device: torch.device, pin: bool) -> torch.Tensor:
    """A copy of ``t`` in fresh storage on ``device`` (the source is then free to go)."""
    # empty_like keeps the strides (a channels-last weight stays channels-last), so kernels
    # after a round trip take the same paths and give the same bits.
    out = torch.empty_like(t, device=device, pin_memory=pin)
    out.copy_(t, non_blocking=pin or device.type == "cuda")
    return out


def offloads_for(shares_device: Callable[[str, str], bool], components: list[str],
                 mode: str = "auto") -> dict[str, list[str]]:
    """For each component, the components that must offload while it runs.

    ``auto``: those placed on a common GPU (collocated); disaggregated components never
    switch. ``always``: every pair (CPU dry runs and tests). ``never``: none.

    >>> offloads_for(lambda a, b: True, ["rollout", "learner"])
    {'rollout': ['learner'], 'learner': ['rollout']}
    >>> offloads_for(lambda a, b: False, ["rollout", "learner"])
    {'rollout': [], 'learner': []}
    """
    if mode not in SWITCH_MODES:
        raise ValueError(
            f"cluster.context_switch={mode!r} is not a mode; use one of {list(SWITCH_MODES)}."
        )
    offloads: dict[str, list[str]] = {c: [] for c in components}
    if mode == "never":
        return offloads
    for a in components:
        for b in components:
            if a != b and (mode == "always" or shares_device(a, b)):
                offloads[a].append(b)
    return offloads


class ContextSwitcher:
    """Runs the turns :func:`offloads_for` lists over worker groups: ``activate(name)``
    offloads the groups that must step aside for ``name`` and onloads ``name``; it returns
    what moved.

    Both runners (embodied and reasoning) drive their turns through this one class.
    """

    def __init__(self, groups: Mapping[str, object], offloads: Mapping[str, list[str]],
                 force: bool = False):
        self.groups = dict(groups)
        self.offloads = {k: list(v) for k, v in offloads.items() if k in self.groups}
        self.enabled = any(self.offloads.values())
        self._on = set(self.groups)  # every component starts with its state on its device
        if self.enabled and force:
            for g in self.groups.values():
                g.call(g.worker_cls.set_context_force, True).wait()

    def activate(self, name: str) -> dict[str, float]:
        """Gives the device to ``name``; seconds and bytes moved, for the run's metrics."""
        out = {"time/switch_offload": 0.0, "time/switch_onload": 0.0, "switch/bytes": 0.0}
        if not self.enabled:
            return out
        for other in self.offloads.get(name, []):
            if other in self._on:
                t0 = time.perf_counter()
                stats = self.groups[other].call(self.groups[other].worker_cls.offload).wait()
                out["time/switch_offload"] += time.perf_counter() - t0
                out["switch/bytes"] += sum(s["bytes"] for s in stats)
                self._on.discard(other)
        if name not in self._on:
            t0 = time.perf_counter()
            stats = self.groups[name].call(self.groups[name].worker_cls.onload).wait()
            out["time/switch_onload"] += time.perf_counter() - t0
            out["switch/bytes"] += sum(s["bytes"] for s in stats)
            self._on.add(name)
        return out
