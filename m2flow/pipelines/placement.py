"""Placement: which node, how many CPUs and which GPUs each rank of each component gets.

Modes:
- ``collocated``: components share devices (every GPU-using component on the same GPUs; CPU
  shares may overlap) and take turns on them.
- ``disaggregated``: components get disjoint devices (no GPU id used twice on a node, CPU
  shares of a node add up to at most its cores) so they run at the same time.
- ``hybrid``: any mix; sharing is allowed where the config asks for it.

>>> from m2flow.pipelines.cluster import NodeInfo
>>> nodes = [NodeInfo("n0", "127.0.0.1", num_cpus=2, num_gpus=0)]
>>> p = Placement(PlacementConfig(mode="disaggregated", components={
...     "env": ComponentPlacement(cpus=1), "rollout": ComponentPlacement(cpus=1)}), nodes)
>>> p.ranks("env")
[RankResources(node=0, cpus=1.0, gpu_ids=())]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from m2flow.pipelines.cluster import NodeInfo
from m2flow.pipelines.errors import PlacementError

MODES = ("collocated", "disaggregated", "hybrid")


@dataclass
class ComponentPlacement:
    """Resources of one component (env, rollout, learner, ...)."""

    workers: int = 1
    """Number of ranks (Ray actors) of this component."""
    cpus: float = 1.0
    """CPU cores per rank; sets torch threads and simulator processes so nobody oversubscribes."""
    gpus: Optional[List[int]] = None
    """GPU ids on the node used by the whole component, split evenly over its ranks; None: CPU."""
    node: int = 0
    """Index of the node in the cluster (0: the head node)."""


@dataclass
class PlacementConfig:
    """Maps component names to resources under one mode."""

    mode: str = "collocated"
    """collocated | disaggregated | hybrid."""
    components: Dict[str, ComponentPlacement] = field(default_factory=dict)
    """Per-component resources; a component not listed gets ``ComponentPlacement()``."""


@dataclass(frozen=True)
class RankResources:
    node: int
    cpus: float
    gpu_ids: tuple[int, ...]


class Placement:
    """A validated placement: raises ``PlacementError`` naming the component at fault."""

    def __init__(self, cfg: PlacementConfig, nodes: list[NodeInfo]):
        if cfg.mode not in MODES:
            raise PlacementError(
                f"placement.mode={cfg.mode!r} is not a mode; use one of {list(MODES)}."
            )
        self.mode = cfg.mode
        self.nodes = nodes
        self._components = {name: _as_component(c) for name, c in cfg.components.items()}
        self._ranks: dict[str, list[RankResources]] = {}
        for name, comp in self._components.items():
            self._ranks[name] = self._resolve(name, comp)
        self._check_mode()

    def component(self, name: str) -> ComponentPlacement:
        return self._components.setdefault(name, ComponentPlacement())

    def ranks(self, name: str) -> list[RankResources]:
        """Resources of each rank of ``name`` (a component not in the config gets defaults)."""
        if name not in self._ranks:
            self._ranks[name] = self._resolve(name, self.component(name))
            try:
                self._check_mode()
            except PlacementError:
                del self._ranks[name], self._components[name]
                raise
        return self._ranks[name]

    def shares_device(self, a: str, b: str) -> bool:
        """True when components a and b use a common GPU (so they must take turns on it)."""
        ga = {(r.node, g) for r in self.ranks(a) for g in r.gpu_ids}
        gb = {(r.node, g) for r in self.ranks(b) for g in r.gpu_ids}
        return bool(ga & gb)

    def _resolve(self, name: str, comp: ComponentPlacement) -> list[RankResources]:
        where = f"placement.components.{name}"
        if comp.workers < 1:
            raise PlacementError(f"{where}.workers={comp.workers}: a component needs >= 1 worker.")
        if comp.cpus <= 0:
            raise PlacementError(f"{where}.cpus={comp.cpus}: give each worker a positive CPU share.")
        if not 0 <= comp.node < len(self.nodes):
            raise PlacementError(
                f"{where}.node={comp.node}: the cluster has {len(self.nodes)} node(s) "
                f"(indices 0-{len(self.nodes) - 1})."
            )
        node = self.nodes[comp.node]
        if comp.cpus > node.num_cpus:
            raise PlacementError(
                f"{where}.cpus={comp.cpus} but node {comp.node} has {node.num_cpus} CPUs; "
                f"lower it to at most {node.num_cpus}."
            )
        gpus = list(comp.gpus or [])
        for g in gpus:
            if not 0 <= g < node.num_gpus:
                have = f"ids 0-{node.num_gpus - 1}" if node.num_gpus else "no GPUs"
                raise PlacementError(
                    f"{where}.gpus asks for GPU {g}, but node {comp.node} has {have}; "
                    f"use existing ids or gpus=null to run '{name}' on CPU."
                )
        if len(set(gpus)) != len(gpus):
            raise PlacementError(f"{where}.gpus={gpus} lists a GPU twice.")
        return [
            RankResources(node=comp.node, cpus=float(comp.cpus), gpu_ids=ids)
            for ids in _split(where, gpus, comp.workers)
        ]

    def _check_mode(self) -> None:
        names = list(self._ranks)
        if self.mode == "disaggregated":
            for i, a in enumerate(names):
                for b in names[i + 1 :]:
                    if self.shares_device(a, b):
                        raise PlacementError(
                            f"placement: components '{a}' and '{b}' share a GPU but mode is "
                            "'disaggregated' (disjoint devices); give them disjoint gpus or set "
                            "placement.mode=collocated or hybrid."
                        )
            for n, node in enumerate(self.nodes):
                used = 0.0
                for name in names:
                    used += sum(r.cpus for r in self._ranks[name] if r.node == n)
                    if used > node.num_cpus:
                        raise PlacementError(
                            f"placement.components.{name}: with mode 'disaggregated' the CPU "
                            f"shares on node {n} add up to {used:g} > {node.num_cpus} cores; "
                            "lower the cpus (or workers) or set placement.mode=collocated."
                        )
        elif self.mode == "collocated":
            on_gpu = {n: self._gpu_set(n) for n in names if self._gpu_set(n)}
            if len(set(on_gpu.values())) > 1:
                (a, ga), (b, gb) = list(on_gpu.items())[:2]
                if ga == gb:
                    b, gb = next((k, v) for k, v in on_gpu.items() if v != ga)
                raise PlacementError(
                    f"placement: mode 'collocated' puts every component on the same GPUs, but "
                    f"'{a}' uses {sorted(ga)} and '{b}' uses {sorted(gb)}; give them the same "
                    "gpus or set placement.mode=hybrid."
                )

    def _gpu_set(self, name: str) -> frozenset:
        return frozenset((r.node, g) for r in self._ranks[name] for g in r.gpu_ids)


def _as_component(c) -> ComponentPlacement:
    if isinstance(c, ComponentPlacement):
        return c
    return ComponentPlacement(**dict(c))


def _split(where: str, gpus: list[int], workers: int) -> list[tuple[int, ...]]:
    """Splits a component's GPUs over its ranks: several GPUs per rank, or several ranks per GPU."""
    if not gpus:
        return [()] * workers
    if len(gpus) % workers == 0:
        k = len(gpus) // workers
        return [tuple(gpus[i * k : (i + 1) * k]) for i in range(workers)]
    if workers % len(gpus) == 0:
        k = workers // len(gpus)
        return [(gpus[i // k],) for i in range(workers)]
    raise PlacementError(
        f"{where}: {workers} workers cannot split {len(gpus)} GPUs evenly; use a number of "
        "workers that divides the GPUs or is a multiple of them."
    )
