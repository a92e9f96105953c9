"""The search space: every execution plan of a component graph on a node.

A plan is a placement of the graph's components (collocated: all share the cores; hybrid:
the loop components pinned to cores of their own, the learner floating; disaggregated: every
component on cores of its own; GPU-capable components on GPUs where the node has them), a
worker count and a stage count (pipeline stages) for the first loop component, and learner
overlap. :mod:`.search` predicts each one.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from m2flow.pipelines.placement import ComponentPlacement
from m2flow.pipelines.planner.graph import Graph
from m2flow.pipelines.planner.profiles import Node


@dataclass(frozen=True)
class Plan:
    """One point of the search space."""

    mode: str
    """collocated | hybrid | disaggregated (the placement mode it runs under)."""
    components: tuple[tuple[str, ComponentPlacement], ...]
    """Each component's placement, in the graph's order."""
    stages: int = 1
    """Stages per worker of the first loop component (pipeline stages; generate calls)."""
    overlap: bool = False

    def placement(self, name: str) -> ComponentPlacement:
        return dict(self.components)[name]

    @property
    def workers(self) -> int:
        return self.components[0][1].workers

    def label(self, graph: Optional[Graph] = None) -> str:
        """One line: mode, each component's cores (or GPU) and threads, the knobs. With
        ``graph``, threads are left out where they do not matter and stages get its name."""
        quiet = {c.name for c in graph.components if not c.threads} if graph else set()
        parts = []
        for name, c in self.components:
            where = (f"gpu{','.join(map(str, c.gpus))}" if c.gpus else
                     f"core{'s' if len(c.cpu_ids) > 1 else ''} {_span(c.cpu_ids)}" if c.cpu_ids
                     else f"{int(c.cpus)} own core{'s' if c.cpus > 1 else ''}"
                     if self.mode == "disaggregated" else "any core")
            threads = ("" if c.cpu_ids or c.gpus or name in quiet
                       or self.mode == "disaggregated" else f" {int(c.cpus)}t")
            count = f"x{c.workers} " if c.workers > 1 else ""
            parts.append(f"{name} {count}{where}{threads}")
        knobs = f"{graph.stages_label if graph else 'S'}={self.stages}"
        knobs += " overlap" if self.overlap else ""
        return f"{self.mode}: {', '.join(parts)}; {knobs}"


# -- placements ----------------------------------------------------------------------------------
def placements(graph: Graph, node: Node) -> Iterable[tuple[str, dict[str, ComponentPlacement]]]:
    """(mode, {component: placement}) of every placement shape the search tries on ``node``:
    collocated (every component on any core; rollout with 1 or all threads), hybrid (the loop
    components pinned to disjoint core blocks, the learner on any core), disaggregated (every
    component pinned to cores of its own), each with the GPU-capable components on GPUs where
    the node has them. Shapes the node cannot hold come out too; :class:`Placement` refuses
    them with its reason."""
    names = graph.names
    pinned = list(graph.pinned) or _loop_components(graph)
    c, g = node.cores, node.gpus
    gpu_sets = [{}]  # component -> GPU id
    gpu_able = [n for n in names if graph.component(n).gpu]
    if g >= 1 and gpu_able:
        gpu_sets.append({n: 0 for n in gpu_able})
        if g >= 2 and len(gpu_able) >= 2:
            gpu_sets.append({n: i % g for i, n in enumerate(gpu_able)})
    for gpus in gpu_sets:
        mode = "collocated" if len(set(gpus.values())) <= 1 else "hybrid"
        tuned = [n for n in names if graph.component(n).threads and n not in gpus]
        for threads in itertools.product(sorted({1, c}), repeat=len(tuned)):
            cpus = dict(zip(tuned, threads))
            yield mode, {n: _comp(n, gpus, cpus=cpus.get(n, _float_cpus(graph, n, c)))
                         for n in names}
        cpu_pinned = [n for n in pinned if n not in gpus]
        if len(cpu_pinned) >= 2:
            floating = [n for n in tuned if n not in cpu_pinned]
            for cut in _cuts(c, len(cpu_pinned)):
                for threads in itertools.product(sorted({1, c}), repeat=len(floating)):
                    cpus = dict(zip(floating, threads))
                    comps = {n: _comp(n, gpus, cpus=cpus.get(n, _float_cpus(graph, n, c)))
                             for n in names}
                    for n, ids in zip(cpu_pinned, _blocks(cut)):
                        comps[n] = _comp(n, gpus, cpu_ids=ids)
                    yield "hybrid", comps
        cpu_all = [n for n in names if n not in gpus]
        if len(set(gpus.values())) == len(gpus):  # disaggregated: no GPU shared
            for cut in list(_cuts(c, len(cpu_all))) or [None]:
                comps = {n: _comp(n, gpus, cpus=1) for n in names}
                for n, k in zip(cpu_all, cut or ()):  # None: fewer cores than components
                    comps[n] = _comp(n, gpus, cpus=k)
                yield "disaggregated", comps


def _float_cpus(graph: Graph, name: str, cores: int) -> int:
    """CPU share of a floating component: all cores for one whose threads matter (the
    learner), one for the others (a simulator worker's own thread, a reward worker)."""
    spec = graph.component(name)
    return cores if spec.threads and not spec.processes_per_item else 1


def _loop_components(graph: Graph) -> list[str]:
    out = []
    for p in graph.loop:
        if p.component not in out:
            out.append(p.component)
    return out + [graph.train.component] * (2 - len(out))


def _comp(name: str, gpus: dict, *, cpus: float = 1, cpu_ids=None) -> ComponentPlacement:
    g = gpus.get(name)
    return ComponentPlacement(workers=1, cpus=float(len(cpu_ids) if cpu_ids else cpus),
                              gpus=None if g is None else [g],
                              cpu_ids=None if cpu_ids is None else list(cpu_ids))


def _cuts(cores: int, parts: int, limit: int = 6) -> list[tuple[int, ...]]:
    """Ways to give ``parts`` components positive core counts adding up to ``cores``, the
    most balanced first (at most ``limit``)."""
    if parts < 1 or cores < parts:
        return []
    cuts = [cut for cut in itertools.product(range(1, cores + 1), repeat=parts)
            if sum(cut) == cores] if cores <= 16 else [
        tuple(cores // parts + (i < cores % parts) for i in range(parts))]
    cuts.sort(key=lambda cut: max(cut) - min(cut))
    return cuts[:limit]


def _blocks(cut: Sequence[int]) -> list[list[int]]:
    out, start = [], 0
    for k in cut:
        out.append(list(range(start, start + k)))
        start += k
    return out


def _span(ids) -> str:
    ids = list(ids)
    return f"{ids[0]}-{ids[-1]}" if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)) \
        else ",".join(map(str, ids))


def plans(graph: Graph, node: Node) -> list[Plan]:
    """Every plan of the search space (placements x workers x stages x overlap), deduplicated."""
    first = graph.loop[0].component
    out, seen = [], set()
    for mode, comps in placements(graph, node):
        for workers in graph.workers:
            for stages in graph.stages:
                for overlap in ((False, True) if graph.overlap else (False,)):
                    cs = dict(comps)
                    f = cs[first]
                    cs[first] = ComponentPlacement(workers=workers, cpus=f.cpus, gpus=f.gpus,
                                                   cpu_ids=f.cpu_ids)
                    plan = Plan(mode, tuple((n, cs[n]) for n in graph.names), stages, overlap)
                    key = plan.label(graph)
                    if key not in seen:
                        seen.add(key)
                        out.append(plan)
    return out
