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
[RankResources(node=0, cpus=1.0, gpu_ids=(), cpu_ids=(0,), shard='none')]
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from m2flow.pipelines.cluster import NodeInfo
from m2flow.pipelines.errors import PlacementError

MODES = ("collocated", "disaggregated", "hybrid")
SHARD_MODES = ("none", "fsdp")  # (pipelines.fsdp's; kept here so placement imports no torch)


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
    node_resource: Optional[str] = None
    """A custom Ray resource naming the node to run on (``ray start --resources=
    '{"sim_node": 1}'``): the one node of the cluster that offers it, instead of ``node``
    (indices past the head follow Ray's node ids, not the order nodes joined). None: ``node``."""
    cpu_ids: Optional[List[int]] = None
    """Cores of the node this component's processes (and the simulator processes they start)
    are pinned to, split evenly over its ranks; sets ``cpus`` to the cores per rank. None: not
    pinned, except in mode 'disaggregated', which pins each component to its own cores."""
    shard: str = "none"
    """How the ranks of a component that trains one model (the learner) hold it: ``none``
    (each rank the whole model, gradients all-reduced: small models) | ``fsdp`` (FSDP2 shards
    parameters, gradients and optimiser state over the ranks: models too large for one
    device). With one worker there is nothing to shard."""


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
    cpu_ids: tuple[int, ...] = ()
    """Cores this rank is pinned to; () = not pinned."""
    shard: str = "none"
    """How this rank holds the model its group trains (``ComponentPlacement.shard``)."""

    @property
    def threads(self) -> int:
        """Compute threads this rank should use (torch, OpenMP): its cores, at least one."""
        return max(1, len(self.cpu_ids) or int(self.cpus))


class Placement:
    """A validated placement: raises ``PlacementError`` naming the component at fault."""

    def __init__(self, cfg: PlacementConfig, nodes: list[NodeInfo],
                 components: Optional[Sequence[str]] = None):
        """``components``: the names the workload places (the config may list fewer); a
        listed name outside them is an error. None: any name."""
        check_placement(cfg, components)
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
        _check_component(where, comp)
        index = self._node_index(where, comp)
        node = self.nodes[index]
        if comp.cpus > node.num_cpus:
            raise PlacementError(
                f"{where}.cpus={comp.cpus} but node {index} has {node.num_cpus} CPUs; "
                f"lower it to at most {node.num_cpus}."
            )
        gpus = list(comp.gpus or [])
        for g in gpus:
            if not 0 <= g < node.num_gpus:
                have = f"ids 0-{node.num_gpus - 1}" if node.num_gpus else "no GPUs"
                raise PlacementError(
                    f"{where}.gpus asks for GPU {g}, but node {index} has {have}; "
                    f"use existing ids or gpus=null to run '{name}' on CPU."
                )
        cores = self._cores(where, comp, index)
        return [
            RankResources(node=index, cpus=float(len(c) or comp.cpus), gpu_ids=ids,
                          cpu_ids=tuple(c), shard=comp.shard)
            for ids, c in zip(_split(where, gpus, comp.workers), cores)
        ]

    def _node_index(self, where: str, comp: ComponentPlacement) -> int:
        """The index of the component's node: the one offering ``node_resource``, or ``node``."""
        name = comp.node_resource
        if name is None:
            if not 0 <= comp.node < len(self.nodes):
                raise PlacementError(
                    f"{where}.node={comp.node}: the cluster has {len(self.nodes)} node(s) "
                    f"(indices 0-{len(self.nodes) - 1})."
                )
            return comp.node
        hits = [i for i, n in enumerate(self.nodes) if name in n.resources]
        if not hits:
            offered = sorted({r for n in self.nodes for r in n.resources})
            raise PlacementError(
                f"{where}.node_resource={name!r}: no node of the cluster offers it (custom "
                f"resources: {', '.join(offered) or 'none'}); start that node with "
                f"ray start --resources='{{\"{name}\": 1}}' and join the cluster with "
                "cluster.address=auto."
            )
        if len(hits) > 1:
            raise PlacementError(
                f"{where}.node_resource={name!r}: {len(hits)} nodes offer it; give each "
                "node a resource name of its own."
            )
        return hits[0]

    def _cores(self, where: str, comp: ComponentPlacement, index: int) -> list[list[int]]:
        """Each rank's cores: from ``cpu_ids``, or the next free ones in disaggregated mode."""
        node = self.nodes[index]
        ids = list(comp.cpu_ids) if comp.cpu_ids is not None else None
        if ids is None and self.mode == "disaggregated" and float(comp.cpus).is_integer():
            taken = {c for r in self._ranks.values() for rr in r if rr.node == index
                     for c in rr.cpu_ids}
            free = [c for c in range(int(node.num_cpus)) if c not in taken]
            need = int(comp.cpus) * comp.workers
            ids = free[:need] if len(free) >= need else None  # the share check reports it
        if not ids:
            return [[] for _ in range(comp.workers)]
        bad = [c for c in ids if not 0 <= c < node.num_cpus]
        if bad or len(set(ids)) != len(ids):
            raise PlacementError(
                f"{where}.cpu_ids={ids}: cores must be distinct ids 0-{int(node.num_cpus) - 1} "
                f"of node {index}."
            )
        if len(ids) % comp.workers:
            raise PlacementError(
                f"{where}.cpu_ids has {len(ids)} cores for {comp.workers} workers; give a "
                "multiple of the number of workers."
            )
        k = len(ids) // comp.workers
        return [ids[i * k : (i + 1) * k] for i in range(comp.workers)]

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
            for i, a in enumerate(names):
                for b in names[i + 1 :]:
                    common = self._core_set(a) & self._core_set(b)
                    if common:
                        raise PlacementError(
                            f"placement: components '{a}' and '{b}' are both pinned to cores "
                            f"{sorted(c for _, c in common)} but mode is 'disaggregated'; give "
                            "them disjoint cpu_ids or set placement.mode=hybrid."
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

    def _core_set(self, name: str) -> frozenset:
        return frozenset((r.node, c) for r in self._ranks[name] for c in r.cpu_ids)

    def _gpu_set(self, name: str) -> frozenset:
        return frozenset((r.node, g) for r in self._ranks[name] for g in r.gpu_ids)


def check_placement(cfg: PlacementConfig, components: Optional[Sequence[str]] = None) -> None:
    """What a placement config must satisfy on any cluster (before its nodes are known): a
    known mode, only the ``components`` given (None: any), and each component's workers, CPU
    share, GPU and core ids in range (a node's own limits: :class:`Placement`). Raises
    ``PlacementError``."""
    if cfg.mode not in MODES:
        raise PlacementError(
            f"placement.mode={cfg.mode!r} is not a mode; use one of {list(MODES)}."
        )
    for name, c in cfg.components.items():
        if components is not None and name not in components:
            close = difflib.get_close_matches(name, list(components), n=1)
            hint = f" Did you mean {close[0]!r}?" if close else ""
            raise PlacementError(
                f"placement.components.{name}: this run has no component {name!r}; its "
                f"components are {list(components)}.{hint}"
            )
        _check_component(f"placement.components.{name}", _as_component(c))


def _check_component(where: str, comp: ComponentPlacement) -> None:
    if comp.workers < 1:
        raise PlacementError(f"{where}.workers={comp.workers}: a component needs >= 1 worker.")
    if not comp.cpus > 0:
        raise PlacementError(f"{where}.cpus={comp.cpus}: give each worker a positive CPU share.")
    gpus = list(comp.gpus or [])
    if any(g < 0 for g in gpus):
        raise PlacementError(f"{where}.gpus={gpus}: GPU ids start at 0.")
    if len(set(gpus)) != len(gpus):
        raise PlacementError(f"{where}.gpus={gpus} lists a GPU twice.")
    ids = list(comp.cpu_ids or [])
    if any(c < 0 for c in ids) or len(set(ids)) != len(ids):
        raise PlacementError(f"{where}.cpu_ids={ids}: cores must be distinct ids >= 0.")
    if comp.node_resource is not None and not comp.node_resource.strip():
        raise PlacementError(f"{where}.node_resource is empty; give a custom resource name "
                             "of a node, or null to place by node index.")
    if comp.shard not in SHARD_MODES:
        raise PlacementError(f"{where}.shard={comp.shard!r} is not a sharding mode; use one of "
                             f"{list(SHARD_MODES)} (fsdp: the learner's ranks shard its model).")
    if comp.node_resource is not None and comp.node != 0:
        raise PlacementError(
            f"{where}: node={comp.node} and node_resource={comp.node_resource!r} both pick "
            "a node; give one of them.")


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
