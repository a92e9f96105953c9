"""The search: every plan for a node, its predicted iteration time and memory, the best first.

A plan is a placement of the graph's components (collocated: all share the cores;
hybrid: the loop components pinned to cores of their own, the learner floating; disaggregated:
every component on cores of its own; GPU-capable components on GPUs where the node has them),
a worker count and a lane count (pipeline stages) for the first loop component, and learner
overlap. Each placement is checked by the engine's own :class:`~m2flow.pipelines.Placement`,
so a plan the run would refuse is refused here, with the same sentence.

**Time.** Each component rank's calls cost what the profile's fitted models say on the cores
that rank gets (``costmodel``). Work that runs at the same time is combined by
:func:`makespan`: the longest activity, but never less than the CPU work of any set of
activities divided by the cores they share (components sharing cores add their CPU-seconds:
on a node whose simulators already fill every core, overlapping inference or the learner
with them buys nothing). A phase holds the cores it runs on for its whole time (torch
threads spin at their barriers; simulators spread over k cores run as fast as the profile
measured them there): its work is cores x time, at least its time on one core. A cycle (embodied) round costs the most of: one lane's trip round
the loop (sim + infer + hand-offs), each worker's busy time (S stages one after another),
and the shared-core bound. A chain (reasoning) costs the fill plus the bottleneck phase per
item. The update runs after the loop, or during it (learner overlap, streaming).

**Memory.** The sum of each rank's fitted memory at its size on the host, and per GPU
(rollout and learner taking turns on one GPU count the larger of the two there).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

from m2flow.pipelines.cluster import NodeInfo
from m2flow.pipelines.errors import PlacementError
from m2flow.pipelines.placement import ComponentPlacement, Placement, PlacementConfig
from m2flow.pipelines.planner.costmodel import CostModels, ModelError
from m2flow.pipelines.planner.graph import Graph, Phase
from m2flow.pipelines.planner.profiles import Node

SIMPLER_WITHIN = 0.02
"""A simpler plan (fewer lanes, workers) within this fraction of the fastest one is chosen
instead: predictions are not that exact, and simpler plans fail less."""
OVERLAP_GAIN = 0.10
"""Learner overlap trains on data one update stale, which costs iterations: the default
job needed 24 % more to reach 0.9 (bench/README.md, to_target.py). It is chosen only when it
predicts iterations at least this much faster than the best plan without it."""


class PlanError(ValueError):
    """No plan fits the node, or the node offers nothing to plan on; says why."""


@dataclass(frozen=True)
class Plan:
    """One point of the search space."""

    mode: str
    """collocated | hybrid | disaggregated (the placement mode it runs under)."""
    components: tuple[tuple[str, ComponentPlacement], ...]
    """Each component's placement, in the graph's order."""
    lanes: int = 1
    """Lanes per worker of the first loop component (pipeline stages; generate calls)."""
    overlap: bool = False

    def placement(self, name: str) -> ComponentPlacement:
        return dict(self.components)[name]

    @property
    def workers(self) -> int:
        return self.components[0][1].workers

    def label(self, graph: Optional[Graph] = None) -> str:
        """One line: mode, each component's cores (or GPU) and threads, the knobs. With
        ``graph``, threads are left out where they do not matter and lanes get its name."""
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
        knobs = f"{graph.lanes_label if graph else 'S'}={self.lanes}"
        knobs += " overlap" if self.overlap else ""
        return f"{self.mode}: {', '.join(parts)}; {knobs}"


@dataclass
class Prediction:
    plan: Plan
    iteration_s: float = math.inf
    throughput: float = 0.0
    """steps_per_iteration / iteration_s (env steps/s; completions/s)."""
    memory_mb: float = 0.0
    gpu_memory_mb: dict = field(default_factory=dict)
    breakdown: dict = field(default_factory=dict)
    """Seconds of each part: before, loop, train, sync, switch (or overlap)."""
    busy: dict = field(default_factory=dict)
    """Per component, the seconds its busiest rank computes in an iteration (alone-speed):
    what a run's ``time/<component>_<phase>`` measures."""
    infeasible: Optional[str] = None

    @property
    def feasible(self) -> bool:
        return self.infeasible is None


@dataclass(frozen=True)
class Block:
    """An activity in a period: its time alone, its CPU work on ``cpus``, GPU work on ``gpus``."""

    wall: float
    work: float = 0.0
    cpus: frozenset = frozenset()
    gpu_work: float = 0.0
    gpus: frozenset = frozenset()


def makespan(blocks: Sequence[Block]) -> float:
    """Time of activities that run at the same time: the longest one alone, or the CPU (GPU)
    work of any set of them over the cores (GPUs) they share, whichever is more.

    >>> a = Block(wall=1.0, work=2.0, cpus=frozenset({0, 1}))  # fills both cores for 1 s
    >>> b = Block(wall=0.5, work=0.5, cpus=frozenset({1}))
    >>> makespan([a, b]), makespan([Block(1.0, 1.0, frozenset({0})), b])
    (1.25, 1.0)
    """
    best = max((b.wall for b in blocks), default=0.0)
    for r in range(1, len(blocks) + 1):
        for sub in itertools.combinations(blocks, r):
            cpus = frozenset().union(*(b.cpus for b in sub))
            if cpus:
                best = max(best, sum(b.work for b in sub) / len(cpus))
            gpus = frozenset().union(*(b.gpus for b in sub))
            if gpus:
                best = max(best, sum(b.gpu_work for b in sub) / len(gpus))
    return best


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
    """Every plan of the search space (placements x workers x lanes x overlap), deduplicated."""
    first = graph.loop[0].component
    out, seen = [], set()
    for mode, comps in placements(graph, node):
        for workers in graph.workers:
            for lanes in graph.lanes:
                for overlap in ((False, True) if graph.overlap else (False,)):
                    cs = dict(comps)
                    f = cs[first]
                    cs[first] = ComponentPlacement(workers=workers, cpus=f.cpus, gpus=f.gpus,
                                                   cpu_ids=f.cpu_ids)
                    plan = Plan(mode, tuple((n, cs[n]) for n in graph.names), lanes, overlap)
                    key = plan.label(graph)
                    if key not in seen:
                        seen.add(key)
                        out.append(plan)
    return out


# -- prediction ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Rank:
    cpus: frozenset
    cores: int
    """Cores a call of a processes-per-item phase may spread over (pinned cores or all)."""
    threads: int
    gpu: Optional[int]

    @property
    def device(self) -> str:
        return "cpu" if self.gpu is None else "cuda"


def _ranks(plan: Plan, graph: Graph, node: Node) -> dict[str, list[_Rank]]:
    """Each component's ranks as the engine's Placement resolves them; PlacementError if it
    refuses the plan."""
    placed = Placement(PlacementConfig(mode=plan.mode, components=dict(plan.components)),
                       [NodeInfo("planned", "", node.cores, node.gpus)], graph.names)
    every = frozenset(range(node.cores))
    out = {}
    for name in graph.names:
        out[name] = [_Rank(cpus=frozenset(r.cpu_ids) or every,
                           cores=len(r.cpu_ids) or node.cores,
                           threads=min(r.threads, node.cores),
                           gpu=r.gpu_ids[0] if r.gpu_ids else None)
                     for r in placed.ranks(name)]
    return out


class _Costs:
    """Calls of phases on ranks, as time alone and work."""

    def __init__(self, graph: Graph, models: CostModels):
        self.graph, self.models = graph, models

    def seconds(self, phase: Phase, size: float, rank: _Rank) -> float:
        spec = self.graph.component(phase.component)
        cores = rank.cores if spec.processes_per_item else rank.threads
        return self.models.seconds(phase.component, phase.phase, size, cores, rank.device)

    def block(self, phase: Phase, size: float, rank: _Rank, calls: float = 1.0) -> Block:
        """The calls as an activity. Its CPU work is what it holds: the cores it runs on x
        its time there, at least its time on one core (a torch op on k threads keeps k
        cores busy, spinning at its barriers; simulators on k cores run as fast as the
        profile measured them there, contention included)."""
        one = self.seconds(phase, size, rank)
        wall = calls * one
        work = calls * self.models.work(phase.component, phase.phase, size, rank.device)
        if rank.gpu is None:
            spread = (max(1.0, min(rank.cores, size))
                      if self.graph.component(phase.component).processes_per_item
                      else rank.threads)
            work = max(work, calls * spread * one)
        if rank.gpu is None:
            return Block(wall, work, rank.cpus)
        return Block(wall, 0.0, frozenset(), work, frozenset({rank.gpu}))


def predict(plan: Plan, graph: Graph, models: CostModels, node: Node) -> Prediction:
    """Iteration time, throughput and memory of ``plan`` (or why it cannot run)."""
    out = Prediction(plan)
    try:
        reason = _check(plan, graph)
        if reason:
            out.infeasible = reason
            return out
        ranks = _ranks(plan, graph, node)
        parts = _time(plan, graph, _Costs(graph, models), ranks, out.busy)
        _memory(out, plan, graph, models, ranks)
    except PlacementError as e:
        out.infeasible = str(e)
        return out
    except ModelError as e:
        out.infeasible = str(e)
        return out
    if models.overhead(plan.overlap) > 0:
        parts["overhead"] = models.overhead(plan.overlap)
    out.breakdown = parts
    out.iteration_s = sum(parts.values())
    out.throughput = graph.steps_per_iteration / out.iteration_s
    if out.memory_mb > node.memory_mb:
        out.infeasible = (f"needs {out.memory_mb / 1024:.1f} GB of host memory, the node has "
                          f"{node.memory_mb / 1024:.1f} GB")
    for gpu, mb in out.gpu_memory_mb.items():
        if mb > node.gpu_memory_mb:
            out.infeasible = (f"needs {mb / 1024:.1f} GB on GPU {gpu}, which has "
                              f"{node.gpu_memory_mb / 1024:.1f} GB")
    return out


def _check(plan: Plan, graph: Graph) -> Optional[str]:
    """The workload's own rules on workers and lanes (sizes that do not split)."""
    first = graph.loop[0].component
    e, s = plan.workers, plan.lanes
    if graph.items % e:
        return f"{graph.items} {graph.item_unit}s do not split over {e} {first} workers"
    per = graph.items // e
    if per % graph.group:
        return (f"{per} {graph.item_unit}s per {first} worker is not a multiple of "
                f"the group of {graph.group}")
    if s > per:
        return f"S={s} lanes need at least {s} {graph.item_unit}s per {first} worker, not {per}"
    if not graph.cycle and per % s:
        return f"{per} {graph.item_unit}s do not split into {s} equal calls"
    comps = dict(plan.components)
    shared = _shared_gpu(comps, graph)
    if plan.overlap and shared:
        return ("learner overlap runs the learner during collection, but rollout and learner "
                "share a GPU (they take turns on it)")
    return None


def _shared_gpu(comps: dict, graph: Graph) -> bool:
    roll = graph.loop[-1].component if graph.cycle else graph.loop[0].component
    a, b = comps.get(roll), comps.get(graph.train.component)
    return bool(a and b and a.gpus and b.gpus and set(a.gpus) & set(b.gpus))


def _time(plan: Plan, graph: Graph, costs: _Costs, ranks: dict,
          busy: dict) -> dict[str, float]:
    first = graph.loop[0].component
    e, s = plan.workers, plan.lanes
    lanes = e * s
    size = graph.items / lanes  # per lane (one call of each loop phase)
    env_ranks = ranks[first]
    # before the loop: each worker's lanes one after another, the workers at once
    before = [Block(0.0)]
    for r in env_ranks:
        for p in graph.before:
            before.append(costs.block(p, size, r, calls=s))
    t_before = makespan(before)
    learner = ranks[graph.train.component][0]
    train = costs.block(graph.train, graph.samples, learner)
    busy[first] = max(b.wall for b in before)
    busy[graph.train.component] = train.wall
    hop = 0.0
    if graph.hop is not None and costs.models.has(graph.hop.component, graph.hop.phase):
        hop = costs.models.seconds(graph.hop.component, graph.hop.phase, size)
    blocks, trip, item_times = [], 0.0, []
    for p in graph.loop:
        rs = ranks[p.component]
        calls = s if p.component == first else lanes / len(rs)
        for r in rs:
            blocks.append(costs.block(p, size, r, calls=calls * (graph.rounds if graph.cycle else 1)))
        busy[p.component] = busy.get(p.component, 0.0) + blocks[-1].wall
        a = costs.seconds(p, size, rs[0])
        trip += a
        item_times.append(a * (1 if p.component == first else 1))
    comps = dict(plan.components)
    parts: dict[str, float] = {}
    if graph.cycle:
        chain = Block(graph.rounds * (trip + hop))
        if plan.overlap:
            parts["collect+train"] = makespan([Block(t_before + chain.wall), *before[1:],
                                               *blocks, train])
        else:
            parts["before"] = t_before
            parts["loop"] = makespan([chain, *blocks])
            parts["train"] = train.wall
    else:
        k = lanes
        streamed = graph.stream_train and plan.mode != "collocated" and not _shared_gpu(comps, graph)
        if streamed:
            share = train.wall / k
            chain = Block(trip + hop + share + (k - 1) * max(*item_times, share))
            parts["before"] = t_before
            parts["loop+train"] = makespan([chain, *blocks, train])
        else:
            chain = Block(trip + hop + (k - 1) * max(item_times))
            parts["before"] = t_before
            parts["loop"] = makespan([chain, *blocks])
            parts["train"] = train.wall
    if graph.sync is not None:
        device = learner.device
        if not costs.models.has(graph.sync.component, graph.sync.phase, device):
            device = "cpu"  # measured on the CPU only: the copy is the same bytes
        if costs.models.has(graph.sync.component, graph.sync.phase, device):
            parts["sync"] = costs.models.seconds(graph.sync.component, graph.sync.phase,
                                                 graph.sync_size, device=device)
    if _shared_gpu(comps, graph):
        parts["switch"] = sum(costs.models.seconds(p.component, p.phase, 0, device="cuda")
                              for p in graph.switch
                              if costs.models.has(p.component, p.phase, "cuda"))
    return {k: v for k, v in parts.items() if v > 0 or k in ("loop", "train")}


def _memory(out: Prediction, plan: Plan, graph: Graph, models: CostModels, ranks: dict) -> None:
    first = graph.loop[0].component
    per_worker = graph.items / plan.workers
    lane = per_worker / plan.lanes
    sizes = {first: per_worker, graph.train.component: graph.samples}
    host, gpu = 0.0, {}
    shared = _shared_gpu(dict(plan.components), graph)
    for name in graph.names:
        x = sizes.get(name, lane)
        for r in ranks[name]:
            host += models.mb(name, x, "cpu")
            if r.gpu is not None:
                gpu.setdefault(r.gpu, []).append(models.mb(name, x, "cuda"))
    out.memory_mb = host
    out.gpu_memory_mb = {g: (max(v) if shared else sum(v)) for g, v in gpu.items()}


# -- the search ----------------------------------------------------------------------------------
def search(graph: Graph, models: CostModels, node: Node) -> list[Prediction]:
    """Every plan's prediction: the feasible ones fastest first (the chosen one first, see
    ``SIMPLER_WITHIN``), then the infeasible ones with their reasons. Raises PlanError when
    none is feasible."""
    if node.cores < 1:
        raise PlanError(f"the node offers {node.cores} CPU cores; a plan needs at least one.")
    preds = [predict(p, graph, models, node) for p in plans(graph, node)]
    ok = sorted((p for p in preds if p.feasible), key=lambda p: p.iteration_s)
    bad = [p for p in preds if not p.feasible]
    if not ok:
        reasons = sorted({p.infeasible for p in bad})
        raise PlanError(f"no plan of the {graph.workload} workload fits this node ({node.cores} "
                        f"cores, {node.gpus} GPUs, {_gb(node.memory_mb)} GB): "
                        + "; ".join(reasons[:3]) + ("; ..." if len(reasons) > 3 else ""))
    return [*_chosen_first(ok), *bad]


def _chosen_first(ok: list[Prediction]) -> list[Prediction]:
    """``ok`` (fastest first) with the chosen plan moved to the front: without overlap
    unless it gains ``OVERLAP_GAIN``, then the simplest within ``SIMPLER_WITHIN``."""
    plain = [p for p in ok if not p.plan.overlap]
    pool = ok
    if plain and ok[0].plan.overlap and \
            ok[0].iteration_s > plain[0].iteration_s * (1 - OVERLAP_GAIN):
        pool = plain
    best = pool[0]
    simple = min((p for p in pool if p.iteration_s <= best.iteration_s * (1 + SIMPLER_WITHIN)),
                 key=lambda p: (p.plan.lanes, p.plan.workers, p.iteration_s))
    rest = list(ok)
    rest.remove(simple)
    return [simple, *rest]


def _gb(mb: float) -> str:
    return "unlimited" if mb == math.inf else f"{mb / 1024:.1f}"


def table(preds: Sequence[Prediction], graph: Graph, top: int = 10,
          measured: Optional[dict] = None) -> str:
    """The best ``top`` feasible plans and every infeasible one with its reason; with
    ``measured`` ({label: seconds}), a measured column and the error."""
    unit = graph.throughput_unit
    head = f"{'#':>3}  {'iter s':>8}  {unit:>12}  {'mem GB':>7}  "
    if measured is not None:
        head += f"{'measured':>9}  {'error':>6}  "
    lines = [head + "plan"]
    ok = [p for p in preds if p.feasible]
    for i, p in enumerate(ok[:top]):
        row = (f"{i + 1:>3}  {p.iteration_s:>8.3f}  {p.throughput:>12.1f}  "
               f"{p.memory_mb / 1024:>7.1f}  ")
        if measured is not None:
            m = measured.get(p.plan.label(graph))
            row += (f"{m:>9.3f}  {100 * (p.iteration_s / m - 1):>+5.0f}%  " if m
                    else f"{'-':>9}  {'-':>6}  ")
        lines.append(row + p.plan.label(graph))
    if len(ok) > top:
        lines.append(f"     ... {len(ok) - top} more feasible plans")
    reasons: dict[str, list[Prediction]] = {}
    for p in preds:
        if not p.feasible:
            reasons.setdefault(p.infeasible, []).append(p)
    for reason, ps in reasons.items():
        more = f" (and {len(ps) - 1} more like it)" if len(ps) > 1 else ""
        lines.append(f"{'-':>3}  infeasible: {ps[0].plan.label(graph)}{more}: {reason}")
    return "\n".join(lines)


def models_for(profile, graph: Graph) -> CostModels:
    """The profile's cost models, with a one-process-per-item component's cores capped, and
    calibrated when the profile holds calibration runs (``facts["calibration"]``: the
    config's own placement and, per run, its lanes, overlap and measured seconds per
    iteration): what a run's prediction misses of its measurement is the framework's own
    cost per iteration, added to every plan (plans with overlap: what the overlapped run
    missed, when there was one)."""
    from m2flow.pipelines.planner.costmodel import fit

    models = fit(profile, caps={c.name: "size" for c in graph.components
                                if c.processes_per_item})
    cal = profile.facts.get("calibration")
    if not cal:
        return models
    missed: dict[bool, float] = {}
    for run in cal["runs"]:
        plan = Plan(cal["mode"], tuple((n, ComponentPlacement(**cal["components"][n]))
                                       for n in graph.names), run["lanes"], run["overlap"])
        pred = predict(plan, graph, models, profile.node)
        if pred.feasible:
            missed[bool(run["overlap"])] = max(0.0, run["seconds"] - pred.iteration_s)
    if missed:
        models.overhead_s = missed.get(False, missed.get(True, 0.0))
        models.overhead_overlap_s = missed.get(True)
    return models


def plan_of(cluster_cfg, graph: Graph, *, lanes: int, overlap: bool) -> Plan:
    """The plan a config runs: its placement of the graph's components, its lanes and
    overlap."""
    cal = calibration(cluster_cfg, graph, [])
    return Plan(cal["mode"], tuple((n, ComponentPlacement(**cal["components"][n]))
                                   for n in graph.names), lanes, overlap)


def calibration(cluster_cfg, graph: Graph, runs) -> dict:
    """What ``models_for`` needs of calibration runs of a config: its placement of the
    graph's components and ``runs``, each ``(lanes, overlap, seconds per iteration)`` and
    optionally the timed iterations' seconds (kept to show the spread). A JSON-able dict,
    kept in the profile's facts."""
    comps = {}
    for name in graph.names:
        c = cluster_cfg.placement.components.get(name) or ComponentPlacement()
        comps[name] = {"workers": c.workers, "cpus": float(c.cpus),
                       "gpus": list(c.gpus) if c.gpus else None,
                       "cpu_ids": list(c.cpu_ids) if c.cpu_ids else None}
    return {"mode": cluster_cfg.placement.mode, "components": comps,
            "runs": [{"lanes": k, "overlap": bool(o), "seconds": float(t),
                      "times": [float(x) for x in (rest[0] if rest else [t])]}
                     for k, o, t, *rest in runs]}
